"""The message consumer of every gpufleet worker: Celery's, which also answers a message it
cannot read and, on a GPU worker, batches calls.

Celery drops a message whose body it may not or cannot decode (a pickled call, broken
JSON) after logging it, and its caller waits until its own timeout. When the task id can
be read from the message's headers (Celery's message protocol 2 keeps it there), this
consumer stores a `PayloadError` as that task's result first, so the caller learns at once
what was wrong.

On a GPU worker, the calls it receives go to a `tasks.batching.Batcher` rather than
straight to the pool, and the worker reserves enough messages (its prefetch) for two
full batches: one running, the next one gathering.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

from placement.errors import PayloadError
from tasks import context
from tasks.batching import Batcher

log = logging.getLogger(__name__)


class Consumer(CeleryConsumer):
    """Celery's consumer, failing the result of a message it cannot read."""

    def __init__(self, on_task_request: Any, *args: Any, **kwargs: Any) -> None:
        if context.role() == "gpu":
            on_task_request = self._batching(on_task_request, kwargs)
        self._batcher = on_task_request if isinstance(on_task_request, Batcher) else None
        super().__init__(on_task_request, *args, **kwargs)

    def on_close(self) -> None:
        if self._batcher is not None:
            self._batcher.forget()
        super().on_close()

    @staticmethod
    def _batching(on_task_request: Any, kwargs: dict[str, Any]) -> Any:
        from tasks import gpu  # GPU workers only: it imports torch

        catalog = context.catalog()
        largest = max((gpu.limits_of(name).size for name in catalog), default=1)
        if largest <= 1:
            return on_task_request
        per_process = 2 * largest
        # Celery passed processes x its multiplier; the pool has not started yet.
        multiplier = max(1, kwargs.get("prefetch_multiplier") or 1)
        processes = kwargs.get("initial_prefetch_count", 1) // multiplier
        kwargs["prefetch_multiplier"] = per_process
        kwargs["initial_prefetch_count"] = per_process * max(1, processes)
        return Batcher(
            kwargs["pool"], kwargs["timer"], on_task_request, gpu.limits_of, gpu.batch_job
        )

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._answer(message, exc)
        super().on_invalid_task(body, message, exc)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self._answer(message, exc)
        super().on_decode_error(message, exc)

    def _answer(self, message: Any, exc: Exception) -> None:
        headers = getattr(message, "headers", None)
        task_id = headers.get("id") if isinstance(headers, dict) else None
        if not isinstance(task_id, str) or not task_id:
            return
        refused = PayloadError(
            f"gpufleet could not read this call ({type(exc).__name__}, content type "
            f"{getattr(message, 'content_type', '?')!s:.60}); it accepts JSON only: send it "
            f"with serializer='json'"
        )
        try:
            self.app.backend.mark_as_failure(task_id, refused)
        except Exception:  # the message is dropped either way; say why in the log
            log.warning("could not store the refusal of call %s", task_id, exc_info=True)
