"""The Celery app of gpufleet: `from tasks.app import app`.

Every process of a fleet (router, GPU workers, clients that import the project) uses
this configuration; see `tasks.config`. GPU workers (GPUFLEET_ROLE=gpu) also register
the GPU-side tasks, which import torch; routers and clients never do.
"""

from __future__ import annotations

import gc
from typing import Any

from celery import Celery
from celery.signals import celeryd_init, worker_init, worker_shutdown

from tasks.config import INTERNAL_QUEUE, celery_conf
from tasks.context import settings

app = Celery("gpufleet", task_cls="tasks.serving.checked:CheckedTask")
app.conf.update(celery_conf(settings()))
app.conf.task_routes = ("tasks.serving.routing.route",)
# Modules with start-up hooks and no tasks, after the tasks' own start checks (signal
# handlers run in import order): tasks.operator.metrics (a router serves /metrics);
# tasks.broker.claim (every worker claims the fleet's broker database); then
# tasks.broker.quarantine counts the calls its predecessor died holding, and
# tasks.broker.presence records the worker, once it is sure the broker's calls are its
# fleet's. tasks.serving.tenants.quotas and .accounting free a tenant's running slots
# and count its usage as its calls end (`task_postrun`), wherever they end, and
# tasks.broker.run_log records each call that ran (`GPUFLEET_RUN_LOG`).
app.conf.include = (
    [
        "tasks.api",
        "tasks.serving.scaling",
        "tasks.serving.tenants.quotas",
        "tasks.serving.tenants.accounting",
        "tasks.broker.run_log",
    ]
    + (["tasks.serving.gpu"] if settings().role == "gpu" else [])
    + [
        "tasks.operator.metrics",
        "tasks.broker.claim",
        "tasks.broker.quarantine",
        "tasks.broker.presence",
    ]
)


@celeryd_init.connect
def _name_the_consumer(sender: str, conf: Any, **_: Any) -> None:
    """A worker takes its messages through in-flight lists named after its node
    (`tasks.broker.transport`): its successor of the same name puts back what it took."""
    if conf is not app.conf:
        return  # a worker of another app in this process
    conf.broker_transport_options = {**conf.broker_transport_options, "consumer_name": sender}


@worker_init.connect
def _consume_internal_queue(sender: Any = None, **_: Any) -> None:
    """A router also takes the fleet's internal queue, whatever its `-Q` says: calls routed
    again, its own retries and scaling decisions arrive there (`tasks.config`). Connected
    here, before `tasks.broker.presence` records the queues this worker consumes."""
    if settings().role == "router" and sender is not None and sender.app is app:
        sender.app.amqp.queues.select_add(INTERNAL_QUEUE)


@worker_shutdown.connect
def _exit_without_a_last_collection(**_: Any) -> None:
    """A stopped worker's heap (torch and transformers, in a GPU worker) is left out of
    the interpreter's collections at exit (`gc.freeze`): they walked every object for
    over a second on the test machine, delaying every stop, to free memory the process
    is about to give back whole. Atexit handlers and stream flushes still run."""
    gc.freeze()
