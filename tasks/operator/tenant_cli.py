"""`gpufleet tenant add|list|remove`, and the tenant's URL for `gpufleet url --tenant`.

A tenant (`placement.ledger.tenancy.tenants`) is recorded in the registry with the digest of its
Redis password; the password itself is kept on the machine that added it, in the fleet's
directory (`tenants.json`, mode 0600, like the connection file), so that `gpufleet url
--tenant NAME` can print it again. On the bundled Redis the launcher gives the tenant its
user within half a second (`placement.server.tenant_users`), and `tenant add` waits for
it; a Redis of your own gets the user from the ACL line `tenant add` prints.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Annotated, Any

import redis
import typer
from redis.sentinel import MasterNotFoundError
from rich.console import Console
from rich.table import Table

from placement.config import Settings, connection_path, read_connection
from placement.errors import ConfigError, UnknownTenantError
from placement.ledger import endpoint
from placement.ledger.registry import Registry
from placement.ledger.tenancy import quotas, tenants
from placement.server.acl import tenant_line, tenant_sentinel_line, user_url
from placement.server.tenant_users import PASSWORDS, read_passwords, save_passwords
from tasks.front import KEY_FILE
from tasks.front.keys import drop, tenant_key_name
from tasks.operator.console import err, guard, settings

tenant_app = typer.Typer(
    help="Teams sharing the fleet: each with its own Redis user, queue and weight.",
    no_args_is_help=True,
)

#: How long `tenant add` waits for the launcher to make the tenant's user.
USER_WAIT_S = 10.0


def fleet_url(s: Settings) -> tuple[str, bool]:
    """The fleet user's URL (the running fleet's connection file's, else
    GPUFLEET_REDIS_URL), and whether it is a bundled Redis (with the fleet's users)."""
    known = read_connection(connection_path(s.home, s.fleet))
    if known is None:
        return s.registry_url, False
    return known.fleet, known.caller != known.fleet


def caller_url(s: Settings, name: str) -> str:
    """Tenant `name`'s URL: the fleet's caller URL as its own user and password."""
    password = _passwords(s).get(name)
    if password is None:
        raise UnknownTenantError(
            f"no password for tenant {name!r} on this machine (it is kept where `gpufleet "
            f"tenant add` ran, in {_path(s)}); add the tenant there, or remove and add it "
            f"again. A new `gpufleet up` on its bundled Redis starts with no tenants"
        )
    return user_url(s.registry_url, tenants.user_of(name), password)


def celery_conf(url: str, name: str) -> dict[str, Any]:
    """What a plain Celery client of tenant `name` passes to `app.conf.update(**conf)`:
    the caller's settings, its calls and their results under the tenant's key prefix (its
    own queue, and the results its Redis user alone may read)."""
    from tasks.config import caller_conf

    conf = caller_conf(url)
    for setting in ("broker_transport_options", "result_backend_transport_options"):
        options = dict(conf.get(setting) or {})
        options["global_keyprefix"] = tenants.key_prefix(name)
        conf[setting] = options
    return conf


def _path(s: Settings) -> Path:
    return s.fleet_dir() / PASSWORDS


def _passwords(s: Settings) -> dict[str, str]:
    return read_passwords(_path(s))


def _save(s: Settings, passwords: dict[str, str]) -> None:
    save_passwords(_path(s), passwords)


def _registry(s: Settings) -> tuple[Registry, bool]:
    url, bundled = fleet_url(s)
    return Registry.from_url(url, s.fleet), bundled


def _wait_for_user(url: str) -> None:
    """Until the tenant's user at `url` can sign in (the launcher makes it)."""
    deadline = time.monotonic() + USER_WAIT_S
    while True:
        client = endpoint.connect(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            client.ping()
            return
        except (redis.AuthenticationError, MasterNotFoundError):  # Sentinels: not yet there
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"the fleet's launcher did not make the tenant's Redis user within "
                    f"{USER_WAIT_S:.0f} s; is `gpufleet up` still running?"
                ) from None
            time.sleep(0.1)
        finally:
            client.close()


def add(
    s: Settings, name: str, weight: float, max_running: int = 0, max_queued: int = 0
) -> tuple[tenants.Tenant, str, tuple[str, str] | None]:
    """Add tenant `name`: returns it, its URL, and for a Redis of your own the ACL lines
    to load: its data nodes', and its Sentinels' ("" for a Redis no Sentinels watch);
    None on the bundled Redis, where its users exist on return."""
    registry, bundled = _registry(s)
    password = secrets.token_urlsafe(24)
    try:
        tenant = tenants.add(
            registry, name, weight, password, max_running=max_running, max_queued=max_queued
        )
        _save(s, {**_passwords(s), name: password})
        url = user_url(s.registry_url, tenants.user_of(name), password)
        if bundled:
            _wait_for_user(url)
            return tenant, url, None
        major = int(str(registry.client.info("server")["redis_version"]).split(".")[0])
        watched = endpoint.parse(s.registry_url).watched  # it finds the primary as itself
        sentinels = tenant_sentinel_line(tenant) if watched else ""
        return tenant, url, (tenant_line(tenant, major), sentinels)
    finally:
        registry.client.close()


@tenant_app.command("add")
def add_command(
    name: Annotated[str, typer.Argument(help="The tenant's name, e.g. team-a.")],
    weight: Annotated[
        float, typer.Option(help="Its share against other tenants' when they compete.")
    ] = 1.0,
    max_running: Annotated[
        int,
        typer.Option(help="Its calls running at once, at most; the rest wait, in order (0: any)."),
    ] = 0,
    max_queued: Annotated[
        int,
        typer.Option(
            help="Its calls waiting, at most; a call past it gets QuotaError at once (0: any)."
        ),
    ] = 0,
) -> None:
    """Add a tenant: its own Redis user and queue, its weight and its quotas. Prints its URL
    (a plain Celery client's settings: `gpufleet url --tenant NAME --json`)."""
    s = settings()
    tenant, url, lines = guard(lambda: add(s, name, weight, max_running, max_queued))
    if lines is not None:
        data, sentinels = lines
        err.print(
            "This fleet runs on a Redis of yours: add this line to its ACL file and load it "
            "(ACL LOAD), or run it as ACL SETUSER:",
            highlight=False,
        )
        typer.echo(data)
        if sentinels:
            err.print("and this one to each of your Sentinels (ACL SETUSER there):")
            typer.echo(sentinels)
    quota = "".join(
        f", {what} {value}"
        for what, value in (("max running", tenant.max_running), ("max queued", tenant.max_queued))
        if value
    )
    err.print(
        f"tenant {tenant.name} added, weight {tenant.weight:g}{quota}; its URL:", highlight=False
    )
    typer.echo(url)


@tenant_app.command("list")
def list_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The fleet's tenants: name, weight, quotas, and calls waiting on its queue, let in
    under its quota (not answered yet) and parked for a running slot."""
    s = settings()

    def read() -> list[dict[str, Any]]:
        registry, _ = _registry(s)
        try:
            found = tenants.all_tenants(registry)
            held = quotas.held(registry, list(found))
            pipe = registry.client.pipeline(transaction=False)
            for tenant in found.values():
                for key in _lists(tenant.queue):
                    pipe.llen(key)
            counts = iter(pipe.execute())
            return [
                {
                    "name": t.name,
                    "weight": t.weight,
                    "max_running": t.max_running,
                    "max_queued": t.max_queued,
                    "queue": t.queue,
                    "waiting": sum(next(counts) for _ in _lists(t.queue)),
                    "let_in": held[t.name][0],
                    "parked": held[t.name][1],
                }
                for t in found.values()
            ]
        finally:
            registry.client.close()

    rows = guard(read)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(
        "tenant", "weight", "max running", "max queued", "queue", "waiting", "parked", "let in"
    )
    for row in rows:
        limits = [str(row[k] or "-") for k in ("max_running", "max_queued")]
        table.add_row(
            row["name"], f"{row['weight']:g}", *limits, row["queue"], str(row["waiting"]),
            str(row["parked"]), str(row["let_in"]),
        )  # fmt: skip
    Console().print(table)


def _lists(queue: str) -> list[str]:
    from tasks.broker.presence import lists

    return lists(queue)


@tenant_app.command("set")
def set_command(
    name: Annotated[str, typer.Argument(help="The tenant's name.")],
    weight: Annotated[float | None, typer.Option(help="Its new weight.")] = None,
    max_running: Annotated[
        int | None, typer.Option(help="Its calls running at once, at most (0: any).")
    ] = None,
    max_queued: Annotated[
        int | None, typer.Option(help="Its calls waiting, at most (0: any).")
    ] = None,
) -> None:
    """Change a tenant's weight or quotas; its user, password and URL stay. Quotas hold
    from its next call, a weight within a second."""
    s = settings()

    def change() -> tenants.Tenant:
        registry, _ = _registry(s)
        try:
            return tenants.change(
                registry, name, weight=weight, max_running=max_running, max_queued=max_queued
            )
        finally:
            registry.client.close()

    tenant = guard(change)
    limits = ", ".join(
        f"{what} {value or 'any'}"
        for what, value in (("max running", tenant.max_running), ("max queued", tenant.max_queued))
    )
    err.print(f"tenant {tenant.name}: weight {tenant.weight:g}, {limits}", highlight=False)


@tenant_app.command("remove")
def remove_command(name: Annotated[str, typer.Argument(help="The tenant's name.")]) -> None:
    """Remove a tenant: its Redis user goes at once (on a Redis of yours, run the command
    this prints); the calls it sent before are still answered (its queues are still taken
    for a day, and until they are empty)."""
    s = settings()

    def remove() -> tuple[tenants.Tenant, bool]:
        registry, bundled = _registry(s)
        try:
            removed = tenants.remove(registry, name)
        finally:
            registry.client.close()
        _save(s, {k: v for k, v in _passwords(s).items() if k != name})
        drop(s.fleet_dir() / KEY_FILE, tenant_key_name(name))  # its HTTP API keys go too
        return removed, bundled

    tenant, bundled = guard(remove)
    if not bundled:
        err.print("This fleet runs on a Redis of yours: remove the tenant's user there:")
        typer.echo(f"ACL DELUSER {tenants.user_of(tenant.name)}")
    err.print(f"tenant {tenant.name} removed", highlight=False)
