"""A Celery app whose pool child stops the whole worker once it consumes, as a GPU
worker's child does when it finds its GPUs owned after the main process's own check
passed (`tasks.serving.gpu.stop_worker`). Run by tests/test_control.py only."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_process_init, worker_ready

from tasks.serving.gpu import stop_worker

app = Celery("refusing", broker=os.environ["REFUSING_BROKER"])
READY = Path(os.environ["REFUSING_READY"])  # the main process writes it once it consumes


@worker_ready.connect
def _ready(**_: Any) -> None:
    READY.touch()


@worker_process_init.connect
def _refuse_once_consuming(**_: Any) -> None:
    def refuse() -> None:
        while not READY.exists():
            time.sleep(0.05)
        stop_worker("refused for the test")

    threading.Thread(target=refuse, daemon=True).start()
