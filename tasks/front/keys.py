"""The HTTP front's API keys: Bearer tokens, kept on the server only as SHA-256 digests.

A key file holds one key per line as ``sha256:<hex digest> <name>`` (``#`` starts a
comment), so whoever reads it learns no key. `gpufleet up` makes one key for its fleet
(the file is ``api-keys`` in the fleet's directory, and its line named `UP_KEY_NAME` is
replaced at each start; the key itself is in the connection file, mode 0600, for
`gpufleet url --json`); `gpufleet api-key` adds another, which lasts until its line is
removed. The front
reads the file again when it changes: a key added or removed counts from the next
request, without a restart.

A key named `tenant:<name>` (`gpufleet api-key --tenant NAME`) is that tenant's: the front
sends its calls, and reads their answers, as the tenant's Redis user (`tenant_of`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from stat import S_ISREG

from placement.errors import ConfigError
from placement.ledger.tenancy import tenants

PREFIX = "gf-"  # what a gpufleet key starts with, so a leaked one is recognisable
UP_KEY_NAME = "gpufleet-up"  # the key `gpufleet up` makes, replaced at each start
TENANT_KEY = "tenant:"  # the name of a tenant's key: this, then the tenant's name


def tenant_key_name(tenant: str) -> str:
    """The name of tenant `tenant`'s keys."""
    return TENANT_KEY + tenants.check_name(tenant)


def tenant_of(name: str) -> str:
    """The tenant whose key is named `name` (the default tenant for any other name)."""
    return name[len(TENANT_KEY) :] if name.startswith(TENANT_KEY) else tenants.DEFAULT


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def add(path: Path, key: str, name: str) -> None:
    """Append `key`'s digest to the key file at `path` (made 0600 when missing)."""
    if not name or any(c.isspace() for c in name):
        raise ConfigError(f"a key's name is one word, got {name!r}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as fh:
        fh.write(f"{digest(key)} {name}\n")


def replace_key(path: Path, key: str, name: str) -> None:
    """Make `key` the only key named `name` in the file at `path`; other keys stay."""
    drop(path, name)
    add(path, key, name)


def drop(path: Path, name: str) -> int:
    """Remove every key named `name` from the file at `path` (none there: nothing to do);
    returns how many went."""
    return _drop(path, lambda named: named == name)


def drop_tenants(path: Path) -> int:
    """Remove every tenant's key from the file at `path`: their tenants are gone (a new
    fleet on the bundled Redis); returns how many went."""
    return _drop(path, lambda named: named is not None and named.startswith(TENANT_KEY))


def _drop(path: Path, dropped: Callable[[str | None], bool]) -> int:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    kept = [line for line in lines if not dropped(_name(line))]
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.writelines(f"{line}\n" for line in kept)
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _name(line: str) -> str | None:
    words = line.split("#", 1)[0].split()
    return words[1] if len(words) > 1 else None


class KeyFile:
    """The digests of the keys the front takes, read again when the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file read
        self._digests: dict[str, str] = {}  # digest -> name

    def name_of(self, key: str) -> str | None:
        """The name of `key` if the file holds its digest, else None."""
        self._reload()
        wanted = digest(key)
        for known, name in self._digests.items():
            if hmac.compare_digest(known, wanted):
                return name
        return None

    def __len__(self) -> int:
        self._reload()
        return len(self._digests)

    def _reload(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            stat = None
        if stat is None or not S_ISREG(stat.st_mode):  # a bind mount of a missing file: a dir
            raise ConfigError(
                f"{self.path}: no API key file; make one with `gpufleet api-key --keys {self.path}`"
            )
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen == self._seen:
            return
        digests = {}
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if not words[0].startswith("sha256:") or len(words[0]) != 71:
                raise ConfigError(
                    f"{self.path}:{number}: write `sha256:<64 hex digits> NAME` per key"
                )
            digests[words[0]] = words[1] if len(words) > 1 else f"line{number}"
        self._digests, self._seen = digests, seen
