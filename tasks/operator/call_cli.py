"""`gpufleet infer|deploy|evict`: the fleet's tasks called from the shell, as a Celery
client calls them (README, "Calling the fleet"), and the demo calls `gpufleet up --demo` makes.

Calls go with this machine's settings (`tasks.app`); `deploy --dedicated` alone goes with the
fleet's own user, which an operator's override of the catalog needs.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.markup import escape

from placement.config import connection_path, read_connection
from placement.errors import ConfigError
from tasks.config import DEPLOY, EVICT, INFER
from tasks.operator.console import console, err, guard, settings


def infer(  # noqa: PLR0917 - typer's options are keyword arguments to the user
    model: Annotated[str, typer.Argument(help="A model of the catalog.")],
    text: Annotated[
        str, typer.Argument(help="The input text (a chat's user message with --chat).")
    ],
    params: Annotated[
        list[str] | None,
        typer.Option(
            "--param", "-p", help="A param as KEY=VALUE, VALUE in JSON or a plain string."
        ),
    ] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Send TEXT as a user message of a chat.")
    ] = False,
    stream: Annotated[
        bool, typer.Option("--stream", help="Print generated text as it comes.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole result.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait.")] = 300.0,
) -> None:
    """Call gpufleet.infer and print the answer."""
    options = _params(params or [])
    inputs: Any = [{"role": "user", "content": text}] if chat else text
    if stream:
        from tasks.api import generate

        def printed() -> None:
            for piece in generate.stream(model, inputs, timeout=timeout, **options):
                typer.echo(printable(piece), nl=False)
            typer.echo()

        guard(printed)
        return
    result = guard(lambda: call(INFER, (model, inputs, options or None), timeout))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    console.print(summary(result))


#: C0 and C1 control characters but newline and tab, each shown as its escape.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n\t"}


def printable(text: str) -> str:
    """A model's text as a terminal should show it: its control characters escaped, so that
    no output (an ANSI escape sequence, a carriage return) can move the cursor, recolour or
    retitle the caller's terminal. `--json` and the Python client keep the text as it is."""
    return text.translate(_CONTROLS)


def _params(pairs: list[str]) -> dict[str, Any]:
    """`--param KEY=VALUE` options as a dict: VALUE read as JSON, else kept as a string."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r}: write KEY=VALUE, e.g. max_new_tokens=32")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def deploy(
    model: Annotated[str, typer.Argument(help="A model of the catalog.")],
    replicas: Annotated[int, typer.Option(min=1)] = 1,
    dedicated: Annotated[
        bool | None,
        typer.Option(
            "--dedicated/--not-dedicated",
            help="Never evict it under memory pressure (default: the catalog's `dedicated`).",
        ),
    ] = None,
) -> None:
    """Place replicas of a model without calling it; exit code 1 when some could not be.
    `--dedicated/--not-dedicated` is an operator's override of the catalog: it is sent with
    the fleet's own user (a caller's may not set it)."""
    args = (model, replicas, dedicated)
    if dedicated is None:
        result = guard(lambda: call(DEPLOY, args, 300.0))
    else:
        result = guard(lambda: call_as_fleet(DEPLOY, args, 300.0))
    typer.echo(json.dumps(result, indent=2))
    if result.get("missing"):  # the JSON still goes to stdout, for scripts
        err.print(
            f"[red]error:[/] {result['missing']} of {replicas} replica(s) of {model} could not "
            f"be placed: {result.get('refused') or 'no reason given'}"
        )
        raise typer.Exit(1)


def evict(
    model: Annotated[str, typer.Argument(help="A model of the catalog.")],
    replica: Annotated[str | None, typer.Option(help="Only this replica.")] = None,
) -> None:
    """Drain, then offload or drop a model's replicas."""
    result = guard(lambda: call(EVICT, (model, replica), 300.0))
    typer.echo(json.dumps(result, indent=2))


def call(name: str, args: tuple[Any, ...], timeout: float) -> Any:
    """Task `name`'s answer, called with this machine's settings (`tasks.app`)."""
    from tasks.app import app as celery_app

    return celery_app.send_task(name, args=args).get(timeout=timeout)


def call_as_fleet(name: str, args: tuple[Any, ...], timeout: float) -> Any:
    """A call only the fleet's own user may make: sent on the router's internal queue,
    which a caller's user may not write, with the fleet user's URL (the running fleet's
    connection file's, else GPUFLEET_REDIS_URL)."""
    from celery import Celery
    from redis.exceptions import NoPermissionError

    from tasks.config import INTERNAL_QUEUE, celery_conf, redis_conf

    s = settings()
    known = read_connection(connection_path(s.home, s.fleet))
    url = known.fleet if known is not None else s.registry_url
    client = Celery(set_as_current=False)
    conf = celery_conf(s)
    conf.update(redis_conf(url, url, s.visibility_timeout))
    client.conf.update(conf)
    try:
        return client.send_task(name, args=args, queue=INTERNAL_QUEUE).get(timeout=timeout)
    except NoPermissionError:
        raise ConfigError(
            "overriding the catalog's `dedicated` is the operator's: it needs the fleet's own "
            "user, not a caller's. Run it on the fleet's host, or set GPUFLEET_REDIS_URL to "
            "the `fleet` user's URL"
        ) from None


def summary(result: dict[str, Any]) -> str:
    """An answer of `INFER` in two lines of rich markup: where it ran and what it gave
    (its text escaped, so a model's output is never read as markup), then its timings."""
    outputs = result["outputs"]
    if "embeddings" in outputs:
        vector = outputs["embeddings"][0]
        shown = f"{len(vector)}-d embedding [{', '.join(f'{x:+.4f}' for x in vector[:4])}, ...]"
    else:
        shown = json.dumps(outputs)[:200]
    t = result["timings_ms"]
    return (
        f"[bold]{escape(result['model'])}[/] on {escape(', '.join(result['gpus']))} "
        f"({result['cache']}): {escape(shown)}\n"
        f"queue {t['queue']:.0f} ms, load {t['load']:.0f} ms, compute {t['compute']:.1f} ms"
    )


def demo() -> None:
    """Two calls to MiniLM: the first loads it (cold), the second takes the fast path (hot)."""
    for text in ("gpufleet shares GPUs by memory.", "The second call finds the model resident."):
        console.print(summary(call(INFER, ("minilm", text), 300.0)))
