"""The base class of every gpufleet task: it refuses wrong arguments with a `PayloadError`.

Celery calls a task's function with whatever arguments the message carries, so a call
with a missing or an extra argument would fail with a bare `TypeError` from deep inside
the worker. This base checks the arguments against the task's signature first and says
what the task takes.
"""

from __future__ import annotations

import inspect
from typing import Any

from celery import Task

from placement.errors import PayloadError


class CheckedTask(Task):
    """A task whose arguments are checked against its signature before it runs."""

    _signature: inspect.Signature | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        signature = self._signature
        if signature is None:
            signature = self._signature = inspect.signature(self.run)
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise PayloadError(
                f"{self.name} takes {_shown(signature)}: {exc}; send the arguments it names"
            ) from None
        return super().__call__(*args, **kwargs)


def _shown(signature: inspect.Signature) -> str:
    """`(model, inputs, params=None)`: the signature as a caller writes the call."""
    parts = [
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in signature.parameters.values()
    ]
    return f"({', '.join(parts)})"
