"""The message consumer of every gpufleet worker: Celery's, which also answers a message it
cannot read.

Celery drops a message whose body it may not or cannot decode (a pickled call, broken
JSON) after logging it, and its caller waits until its own timeout. When the task id can
be read from the message's headers (Celery's message protocol 2 keeps it there), this
consumer stores a `PayloadError` as that task's result first, so the caller learns at once
what was wrong.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

from placement.errors import PayloadError

log = logging.getLogger(__name__)


class Consumer(CeleryConsumer):
    """Celery's consumer, failing the result of a message it cannot read."""

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
