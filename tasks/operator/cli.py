"""The `gpufleet` command line: look at a fleet's registry and its model catalog."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.table import Table

from placement.catalog.catalog import Catalog
from placement.config import (
    DEFAULT_FLOWER_PORT,
    DEFAULT_METRICS_PORT,
    FROM_DEFAULT,
    Settings,
    connection_path,
    read_connection,
)
from placement.errors import ConfigError
from placement.ledger.registry import Registry
from placement.units.memory import format_size
from tasks.operator import call_cli, simulate_cli
from tasks.operator.console import console, err
from tasks.operator.console import guard as _guard
from tasks.operator.console import settings as _settings
from tasks.operator.tenant_cli import tenant_app

app = typer.Typer(help="gpufleet: many models sharing GPUs by memory.", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")

T = TypeVar("T")

RedisUrl = Annotated[
    str | None,
    typer.Option(
        help="Registry URL (redis:// or rediss://); default: GPUFLEET_REDIS_URL, else the "
        "fleet `gpufleet up` runs on this machine."
    ),
]
FleetName = Annotated[
    str | None, typer.Option("--fleet", help="Fleet name; default: GPUFLEET_FLEET, else default.")
]


def _operator_urls(s: Settings) -> tuple[str, str]:
    """The registry and broker URLs that `status` and `metrics` read with: the running
    fleet's read-only `operator` user when its connection file gave one."""
    if s.operator_url:
        return s.operator_url, s.operator_url
    return s.registry_url, s.broker_url


@app.callback()
def _setup(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print the status object.")] = False,
    redis_url: RedisUrl = None,
    fleet: FleetName = None,
) -> None:
    """Show every GPU, what it holds, the warm caches, the queues and the hit rates."""
    from tasks.serving.status import full_status  # the same object the gpufleet.status task returns

    s = _settings(redis_url, fleet)
    registry, broker = _operator_urls(s)
    report = _guard(lambda: full_status(Registry.from_url(registry, s.fleet), broker))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    console.print(_gpu_table(report))
    for host in report["hosts"]:
        warm = [
            f"{d['model']} {format_size(d['cached_bytes'])}"
            for d in report["deployments"]
            if d["level"] == "WARM" and d["host"] == host["name"]
        ]
        console.print(
            f"[bold]{host['name']}[/] warm cache {format_size(host['warm_used_bytes'])}"
            f" / {format_size(host['warm_budget_bytes'])}"
            f" (pinned {format_size(host['pinned_bytes'])}): {', '.join(warm) or '-'}"
        )
    for model, load in report["load"].items():
        console.print(
            f"[bold]{model}[/] {load['waiting']} waiting, {load['running']} running on "
            f"{load['ready']} ready of {load['placed']} placed replicas"
            + (f" ({load['routing']} held by the router)" if load["routing"] else "")
        )
    for model, gen in report["generation"].items():
        budget = gen["kv_budget_tokens"]
        console.print(
            f"[bold]{model}[/] KV cache {gen['kv_held_tokens']} tokens held"
            + (
                f" of a {budget}-token budget ({format_size(gen['kv_budget_bytes'])})"
                if budget
                else ""
            )
            + (
                f"; blocks {gen['kv_blocks_in_use']} in use, {gen['kv_blocks_cached']} cached,"
                f" {gen['kv_blocks_free']} free"
                if gen["kv_blocks_in_use"] or gen["kv_blocks_cached"]
                else ""
            )
            + (
                f", prefix hits {gen['prefix_hit_rate']:.0%}"
                if gen["prefix_hit_rate"] is not None
                else ""
            )
            + f"; {gen['calls']} calls, {gen['tokens']} tokens"
            + (f", first token {gen['ttft_mean_ms']:.0f} ms" if gen["ttft_mean_ms"] else "")
            + (
                f", {gen['inter_token_mean_ms']:.1f} ms a token"
                if gen["inter_token_mean_ms"]
                else ""
            )
        )
        held = gen["adapters_by_replica"]
        if held or gen["adapter_loads"]:
            console.print(
                f"[bold]{model}[/] adapters "
                + ", ".join(f"{n} on {r}" for r, n in sorted(held.items()))
                + f"; {gen['adapter_hits']} hits, {gen['adapter_loads']} loads,"
                f" {gen['adapter_evictions']} evictions"
            )
        for name, why in sorted(gen["adapter_problems"].items()):
            console.print(f"[bold red]{model}:{name}[/] cannot be served: {why}")
    depths = ", ".join(f"{q} {n}" for q, n in report["queues"].items())
    console.print(f"[bold]queues[/] {depths}")
    where = report["redis"]
    others = "".join(
        f", {name} {', '.join(where[name]) or 'none'}"
        for name in ("replicas", "sentinels")
        if where[name] or (name == "replicas" and where["sentinels"])
    )
    console.print(f"[bold]redis[/] primary {where['primary'] or 'none found'}{others}")
    console.print(_rates(report))
    for problem in report["problems"]:
        err.print(f"[red]ledger problem:[/] {problem}")


@app.command()
def catalog(
    path: Annotated[
        Path | None, typer.Argument(help="models.yaml (default: $GPUFLEET_MODELS).")
    ] = None,
) -> None:
    """Validate a model catalog and list its models."""
    models = _guard(lambda: Catalog.load(path or _settings().models))
    table = Table(title=f"{models.origin}: {len(models)} models")
    for column in ("model", "task", "source", "memory", "dedicated", "replicas"):
        table.add_column(column)
    for spec in models.values():
        if spec.request is not None:
            memory = (
                f"{format_size(spec.request)} (limit {format_size(spec.limit or spec.request)})"
            )
        elif spec.memory is not None:
            memory = format_size(spec.memory)
        elif spec.gpus is not None:
            memory = f"{spec.gpus:g} GPU"
        else:
            memory = "estimated"
        scale = spec.autoscale
        replicas = f"{scale.floor}..{scale.ceiling}" if scale else str(spec.replicas)
        table.add_row(spec.name, spec.task, spec.source, memory, str(spec.dedicated), replicas)
    console.print(table)


@app.command()
def up(
    *,
    models: Annotated[
        Path | None, typer.Option(help="The model catalog; default: GPUFLEET_MODELS.")
    ] = None,
    sim_gpus: Annotated[
        str | None, typer.Option(help="Simulate GPUs, e.g. 2x8GiB (default when none is found).")
    ] = None,
    flower: Annotated[
        bool, typer.Option(help="Start Flower on 127.0.0.1, behind basic auth.")
    ] = False,
    flower_port: Annotated[
        int | None,
        typer.Option(help=f"Flower's port (default {DEFAULT_FLOWER_PORT}, or a free one)."),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help=f"Prometheus /metrics on 127.0.0.1 (default {DEFAULT_METRICS_PORT}, or a free "
            "one when another process holds it; 0: off).",
            min=0,
            max=65535,
        ),
    ] = None,
    api_port: Annotated[
        int | None,
        typer.Option(
            help="OpenAI's HTTP API on 127.0.0.1 (default 8000, or a free one when another "
            "process holds it; 0: off). `gpufleet url --json` prints its URL and key.",
            min=0,
            max=65535,
        ),
    ] = None,
    redis_ha: Annotated[
        bool,
        typer.Option(
            "--redis-ha",
            help="Bundle a Redis primary, two replicas and three Sentinels: the fleet outlives "
            'its primary\'s loss (docs/deploy.md, "Redis Sentinel").',
        ),
    ] = False,
    demo: Annotated[bool, typer.Option(help="Make demo calls once the fleet is ready.")] = False,
    once: Annotated[bool, typer.Option(help="Stop after the demo instead of serving.")] = False,
) -> None:
    """Start a fleet here: bundled Redis, a router, one worker per GPU, all supervised;
    Ctrl-C (or SIGTERM) stops it all."""
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from tasks.operator.launcher import Launcher

    settings = _settings()
    launcher = Launcher(
        models or settings.models,
        settings,
        sim_gpus=sim_gpus,
        flower=flower,
        flower_port=flower_port,
        metrics_port=metrics_port,
        api_port=api_port,
        redis_ha=redis_ha,
    )
    stop_on_signals()
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=err) as bar:
            bar.add_task("starting Redis, the router and the GPU workers...", total=None)
            _guard(launcher.start)
            _guard(launcher.wait_ready)
        _print_ready(launcher)
        if demo:
            _guard(call_cli.demo)
        while not once:
            _guard(launcher.supervise)
            time.sleep(1.0)
    except KeyboardInterrupt:
        err.print("stopping the fleet...")
    finally:
        launcher.stop()


@app.command()
def url(
    fleet: FleetName = None,
    tenant: Annotated[
        str | None,
        typer.Option(
            help="A tenant's URL instead (`gpufleet tenant add`): its calls go to its own "
            "queue, and --json gives its client's `global_keyprefix`."
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help='Print {"celery": CONF, "openai": {"base_url", "api_key"}, "map": {"url", '
            '"user", "password"}}: the settings a plain Celery client passes to '
            "app.conf.update(**CONF), Sentinels' transport options included, the fleet's "
            "HTTP API and its live map (null when it serves none).",
        ),
    ] = False,
) -> None:
    """Print the URL (with its password) that callers of the fleet this machine runs use,
    for a Celery client: `Celery(broker=URL, backend=URL)`. Its Redis user may send calls
    and read results, nothing else (docs/deploy.md, "Security")."""
    from placement.ledger import endpoint
    from tasks.config import caller_conf

    s = _settings(fleet=fleet)
    if s.url_from == FROM_DEFAULT:
        _guard(_no_fleet(s))
    if tenant is not None:
        from tasks.operator import tenant_cli

        tenant_url = _guard(lambda: tenant_cli.caller_url(s, tenant))
        if as_json:
            conf = tenant_cli.celery_conf(tenant_url, tenant)
            typer.echo(json.dumps({"celery": conf}, indent=2))
        else:
            typer.echo(tenant_url)
        return
    if as_json:
        found = read_connection(connection_path(s.home, s.fleet))
        front = found.openai if found is not None else None
        seen: dict[str, str | None] | None = dict(found.map) if found and found.map else None
        if seen is None and s.operator_url:  # a front of another's (compose): its user
            from tasks.front.fleet_map import MapAccess

            access = MapAccess(s.operator_url)
            if access.password:
                seen = {"url": None, "user": access.user, "password": access.password}
        conf = {"celery": caller_conf(s.registry_url), "openai": front, "map": seen}
        typer.echo(json.dumps(conf, indent=2))
        return
    if endpoint.parse(s.registry_url).watched:
        err.print(
            "Sentinels find this fleet's Redis: a Celery client needs their transport "
            "options too; `gpufleet url --json` prints its whole configuration",
            highlight=False,
        )
    typer.echo(s.registry_url)


@app.command()
def api(
    *,
    port: Annotated[int, typer.Option(help="The port to serve on.", min=1, max=65535)] = 8000,
    host: Annotated[str, typer.Option(help="The address to serve on.")] = "127.0.0.1",
    keys: Annotated[
        Path | None,
        typer.Option(help="The API key file (default: the fleet's, made by `gpufleet up`)."),
    ] = None,
    fd: Annotated[int | None, typer.Option(hidden=True)] = None,  # the launcher's socket
    fleet: FleetName = None,
) -> None:
    """Serve OpenAI's HTTP API (chat, completions, embeddings, models) for the fleet whose
    caller URL GPUFLEET_REDIS_URL gives, e.g. on another host; GPUFLEET_MODELS is its
    catalog. `gpufleet up` runs one itself (--api-port)."""
    from tasks import front

    s = _settings(fleet=fleet)
    if s.url_from == FROM_DEFAULT:
        _guard(_no_fleet(s))
    path = keys or s.fleet_dir() / front.KEY_FILE
    _guard(lambda: front.serve(path, host=host, port=port, fd=fd))


@app.command("api-key")
def api_key(
    *,
    name: Annotated[str, typer.Option(help="What the key is for (one word).")] = "key",
    tenant: Annotated[
        str | None,
        typer.Option(
            help="A tenant's key (`gpufleet tenant add`): its calls go as the tenant's, "
            "within its quotas, and it reaches no other tenant's."
        ),
    ] = None,
    keys: Annotated[
        Path | None, typer.Option(help="The API key file (default: the fleet's).")
    ] = None,
    fleet: FleetName = None,
) -> None:
    """Make an API key for the fleet's HTTP API and print it; the file keeps only its
    digest, and the API takes it from the next request on."""
    from tasks import front
    from tasks.front.keys import TENANT_KEY, add, new_key, tenant_key_name

    s = _settings(fleet=fleet)
    path = keys or s.fleet_dir() / front.KEY_FILE
    if tenant is None and name.startswith(TENANT_KEY):
        _guard(_refuse(f"key names starting with {TENANT_KEY!r} are tenants': use --tenant NAME"))
    if tenant is not None:
        from tasks.operator import tenant_cli

        _guard(lambda: tenant_cli.caller_url(s, tenant))  # its password is kept here
        name = _guard(lambda: tenant_key_name(tenant))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = new_key()
    _guard(lambda: add(path, key, name))
    typer.echo(key)


def _refuse(why: str) -> Callable[[], None]:
    def fail() -> None:
        raise ConfigError(why)

    return fail


def _no_fleet(s: Settings) -> Callable[[], None]:
    def fail() -> None:
        raise ConfigError(
            f"no running fleet {s.fleet!r} found on this machine (no connection file under "
            f"{s.home}) and GPUFLEET_REDIS_URL is not set; start one with `gpufleet up`"
        )

    return fail


@app.command()
def acl(
    url: Annotated[
        str, typer.Argument(help="Your Redis, as the fleet reaches it, e.g. redis://host:6379/1.")
    ],
    redis_major: Annotated[
        int, typer.Option("--redis", help="The Redis major version (7 or later: selectors).")
    ] = 7,
) -> None:
    """Print an ACL file with the fleet's users (fresh passwords) for a Redis of yours, and,
    on stderr, the URL each user takes; load it with `aclfile` (docs/deploy.md, "Security")."""
    import secrets

    from placement.server.acl import USERS, Users, acl_lines, user_url

    users = Users(*(secrets.token_hex(24) for _ in USERS))
    for user in USERS:
        err.print(f"{user}: {user_url(url, user, users.password(user))}", highlight=False)
    for line in acl_lines(users, redis_major):
        typer.echo(line)


app.command()(call_cli.infer)
app.command()(call_cli.deploy)
app.command()(call_cli.evict)


def _rates(report: dict[str, Any]) -> str:
    """The operator numbers against their targets, e.g. `hit rate 93.0% (target > 80%)`."""
    fleet = report["requests"]["fleet"]

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    return (
        f"[bold]requests[/] {fleet['requests']}: hit rate {share(fleet['hit_rate'])} "
        f"(target > 80%), reload rate {share(fleet['reload_rate'])} (target < 20%), "
        f"GPU memory reserved {share(report['summary']['utilization'])} (target 70-85%)\n"
        f"[bold]paths[/] {fleet['fast']} fast (client to GPU worker), "
        f"{fleet['routed']} through the router"
    )


@app.command()
def metrics(
    port: Annotated[int, typer.Option(help="Port of /metrics.", min=1, max=65535)] = (
        DEFAULT_METRICS_PORT
    ),
    addr: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    redis_url: RedisUrl = None,
    fleet: FleetName = None,
) -> None:
    """Export the fleet's Prometheus metrics until Ctrl-C (routers can do it too)."""
    from tasks.operator.metrics import serve

    s = _settings(redis_url, fleet)
    registry, broker = _operator_urls(s)
    _guard(lambda: serve(port, addr, Registry.from_url(registry, s.fleet), broker))
    console.print(f"metrics of fleet {s.fleet!r} on http://{addr}:{port}/metrics; Ctrl-C stops")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def _print_ready(launcher: Any) -> None:
    """Where the fleet is, printed once: the callers' URL in full (its password included),
    so a plain Celery client on another machine can connect."""
    from placement.catalog.catalog import Catalog
    from placement.ledger import endpoint

    gpus = ", ".join(f"{d.name} #{d.index}" for d in launcher.devices)
    count = len(launcher.devices)
    model = next(iter(Catalog.load(launcher.models)), "MODEL")  # one the caller may name
    console.print(
        f"[green]gpufleet is up[/]: {count} GPU{'' if count == 1 else 's'} ({gpus}), "
        f"registry {launcher.caller_url}",
        highlight=False,
    )
    console.print(f"  call it:  gpufleet infer {model} 'hello'    (or: gpufleet status)")
    if endpoint.parse(launcher.caller_url).watched:  # Sentinels: the URL alone is not enough
        console.print(
            "  Python:   app = celery.Celery(); app.conf.update(**CONF); app.send_task("
            f"'gpufleet.infer', args=[{model!r}, 'hello']).get()   CONF: gpufleet url --json"
        )
    else:
        console.print(
            "  Python:   celery.Celery(broker=URL, backend=URL)"
            f".send_task('gpufleet.infer', args=[{model!r}, 'hello']).get()   URL=$(gpufleet url)"
        )
    if launcher.api_url:
        console.print(
            f"  OpenAI:   {launcher.api_url}   (key: gpufleet url --json; any OpenAI client)"
        )
    if launcher.map:
        console.print(
            f"  map:      {launcher.map['url']}   (user {launcher.map['user']}; password: "
            "gpufleet url --json)"
        )
    if launcher.metrics_url:
        console.print(f"  metrics:  {launcher.metrics_url}")
    if launcher.flower:
        console.print(
            f"  Flower:   http://127.0.0.1:{launcher.flower_port} "
            f"(basic auth {launcher.flower_auth})"
        )
    console.print("  Ctrl-C stops everything.")


def stop_on_signals() -> None:
    """Make SIGINT, SIGTERM and SIGHUP stop the fleet as Ctrl-C does: workers first,
    then the bundled Redis. SIGINT and SIGTERM do even when the parent ignored them (a
    shell's `&` ignores SIGINT); SIGHUP (the terminal closed) does unless it was ignored
    on purpose, as `nohup` does to keep the fleet running."""
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


app.command()(simulate_cli.simulate)


def _gpu_table(report: dict[str, Any]) -> Table:
    summary = report["summary"]
    table = Table(title=f"gpufleet: {summary['gpus_alive']} of {summary['gpus']} GPUs alive")
    for column in ("GPU", "name", "memory", "use", "worker", "models"):
        # Ids are folded onto more lines, never cut short: a cut worker id names no process.
        table.add_column(column, overflow="fold" if column in ("GPU", "worker") else "ellipsis")
    for g in report["gpus"]:
        share = g["reserved_bytes"] / g["total_bytes"] if g["total_bytes"] else 0.0
        on_it = [
            f"{d['model']} [dim]{d['level']} {format_size(d['gpus'][g['id']])}[/]"
            for d in report["deployments"]
            if g["id"] in d["gpus"]
        ]
        on_it += [
            f"CUDA context [dim]of {worker} {format_size(nbytes)}[/]"
            for worker, nbytes in g.get("contexts", {}).items()
        ]
        table.add_row(
            f"{g['host']}:{g['index']}"
            if g["alive"]
            else f"[red]{g['host']}:{g['index']} (dead)[/]",
            g["name"],
            f"{format_size(g['reserved_bytes'])} / {format_size(g['total_bytes'])}"
            + (  # copies still leaving (or not yet admitted) make the two differ
                f"\n[dim]on device {format_size(g['held_bytes'])}[/]"
                if g["held_bytes"] != g["reserved_bytes"]
                else ""
            ),
            f"{share:.0%}",
            _owner(g),
            "\n".join(on_it) or "-",
        )
    return table


def _owner(gpu: dict[str, Any]) -> str:
    """The worker process that owns `gpu` (its id, as in `gpufleet status --json`), and
    whether its lease still holds."""
    if not gpu["worker"]:
        return "-"
    if gpu["alive"]:
        return f"{gpu['worker']}\n[dim]alive[/]"
    return f"[red]{gpu['worker']}\nlease expired[/]"


def main() -> None:
    """Console entry point."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # gpufleet never downloads models
    app()


if __name__ == "__main__":
    main()
