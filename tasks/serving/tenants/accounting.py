"""Counting what each tenant's calls used, as they end (`placement.ledger.tenancy.usage`).

Celery's `task_postrun` runs in the process that ran a call, after its answer is stored,
so the count costs the caller no wait: one pipelined write per call of a named tenant, and
nothing for the default tenant's calls. A call handed on (by a router, or to another
replica) is counted where it ends; a call refused before it ran (a bad payload, a quota)
is not counted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery import states
from celery.signals import task_postrun

from placement.errors import GpufleetError
from placement.ledger.tenancy import usage
from placement.ledger.tenancy.usage import Usage
from tasks import context
from tasks.config import CALL_TASKS
from tasks.serving.calls import tenant_of

log = logging.getLogger(__name__)


def used_by(answer: Any) -> Usage:
    """One answered call's counts, from its answer (`tasks.serving.gpu.serve`'s dict)."""
    if not isinstance(answer, Mapping):
        return Usage(calls=1)
    outputs, timings = answer.get("outputs"), answer.get("timings_ms")
    outputs = outputs if isinstance(outputs, Mapping) else {}
    timings = timings if isinstance(timings, Mapping) else {}
    tokens_in, tokens_out = _tokens(outputs)
    shared = max(1, _number(timings.get("batch_calls"), 1))
    return Usage(
        calls=1,
        gpu_ms=float(_number(timings.get("compute"))) / shared,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        wait_ms=float(_number(timings.get("queue"))),
    )


def _tokens(outputs: Mapping[str, Any]) -> tuple[int, int]:
    """(tokens in, tokens out): a generation's prompts' and generated tokens; an
    encoder's input tokens (its `tokens` is a count)."""
    made = outputs.get("tokens")
    if isinstance(made, list):
        prompts = outputs.get("prompt_tokens")
        given = sum(_number(p) for p in prompts) if isinstance(prompts, list) else 0
        return int(given), sum(len(t) for t in made if isinstance(t, list))
    return int(_number(made)), 0


def _number(value: Any, default: float = 0) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return value if ok else default


@task_postrun.connect
def _count(
    sender: Any = None, task: Any = None, state: Any = None, retval: Any = None, **_: Any
) -> None:
    if getattr(sender, "name", None) not in CALL_TASKS or state not in (
        states.SUCCESS,
        states.FAILURE,
    ):
        return  # handed on (`Ignore`d), retried: counted where it ends
    tenant = tenant_of(task.request)
    if not tenant:
        return
    used = used_by(retval) if state == states.SUCCESS else Usage(calls=1, failed=1)
    try:
        usage.record(context.registry(), tenant, used)
    except GpufleetError as exc:
        log.warning("could not count a call of tenant %s: %s", tenant, exc)
