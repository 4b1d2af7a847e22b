"""The base class of every gpufleet task: it refuses wrong arguments with a `PayloadError`.

Celery calls a task's function with whatever arguments the message carries, so a call
with a missing or an extra argument would fail with a bare `TypeError` from deep inside
the worker. The consumer refuses such a call before it reaches the pool
(`tasks.broker.intake.check`); this base checks again when a task runs by other ways (`apply`,
an eager call), with the same message.
"""

from __future__ import annotations

from typing import Any

from celery import Task

from tasks.broker.intake import bind


class CheckedTask(Task):
    """A task whose arguments are checked against its signature before it runs."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bind(self, args, kwargs)
        return super().__call__(*args, **kwargs)
