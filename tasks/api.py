"""The public tasks: `gpufleet.infer`, `gpufleet.deploy`, `gpufleet.evict`, `gpufleet.status`.

`infer` runs in two places. Sent with a lease header by the fast path, it runs on the
GPU worker that holds the replica. Otherwise it runs on the router, which validates the
call, plans a place for the model when none is HOT, commits the plan atomically, tells
the workers of evicted replicas to offload them, and hands the call to the chosen GPU
worker with `Task.replace`, so the caller's AsyncResult yields the final answer.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import Task
from celery.signals import worker_process_init

from placement.errors import CantAccommodateError, GpufleetError, NeverFitsError
from placement.registry import Registry
from placement.state import Candidate, Level, Plan
from tasks import context, leases, metrics
from tasks.app import app
from tasks.calls import Call
from worker.handlers import validate

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 2.0
BUSY_RETRIES = 20  # a model blocked by busy replicas is retried about once a second


@app.task(name="gpufleet.infer", bind=True)
def infer(
    self: Task, model: str, inputs: Any, params: dict[str, Any] | None = None, _hops: int = 0
) -> dict[str, Any]:
    """Run `inputs` through `model`; returns outputs, the replica and GPUs used, and timings."""
    header: dict[str, Any] = getattr(self.request, leases.HEADER, None) or {}
    lease = leases.from_header(model, header)
    if lease is not None and context.role() == "gpu":
        from tasks.gpu import serve  # only GPU workers import torch

        sent = int(header.get("sent_ms", 0))
        call = Call(model, inputs, params, lease.replica, "hot", sent, hops=_hops)
        return serve(self, call.with_lease(lease))
    return dispatch(self, model, inputs, params, _hops)


def dispatch(
    task: Task, model: str, inputs: Any, params: dict[str, Any] | None, hops: int
) -> dict[str, Any]:
    """The router's half of `infer`: find or make a HOT replica, then hand the call over."""
    spec = context.catalog().get(model)
    validate(spec.task, inputs, params)  # a bad payload fails here, before any GPU work
    registry = context.registry()
    sent = int(time.time() * 1000)
    lease = registry.pick(model)
    if lease is not None:
        call = Call(model, inputs, params, lease.replica, "hot", sent, hops=hops)
        raise task.replace(call.with_lease(lease).to(lease.queue))
    try:
        plan = registry.place(context.demand(spec))
    except NeverFitsError:
        _count(registry, model, "rejected")
        raise
    except CantAccommodateError as exc:
        _count(registry, model, "busy")
        raise task.retry(exc=exc, countdown=1, max_retries=BUSY_RETRIES) from exc
    cache = "warm" if plan.reuse is Level.WARM else "cold"
    if plan.candidate is Candidate.DEPLOYED:  # a replica is loading: nothing moved
        _count(registry, model, "queued")
    else:
        _count(registry, model, cache)
        _announce(task, plan)
    raise task.replace(
        Call(model, inputs, params, plan.replica, cache, sent, hops=hops).to(plan.queue)
    )


def _count(registry: Registry, model: str, outcome: str) -> None:
    """Count a request's outcome for the operator numbers; never fail the call over it."""
    try:
        registry.count(model, outcome)
    except GpufleetError:
        log.warning("could not count a %s outcome for %s", outcome, model, exc_info=True)


def _announce(task: Task, plan: Plan) -> None:
    """Tell the workers of evicted replicas to sync with the ledger, and tell Flower."""
    for queue in sorted({e.queue for e in plan.evictions if e.queue}):
        app.send_task("gpufleet.sync", queue=queue)
    task.send_event(
        "task-placement",
        model=plan.model,
        replica=plan.replica,
        candidate=plan.candidate.name,
        gpus=dict(plan.gpus),
        evicted=[[e.replica, e.to.value] for e in plan.evictions],
    )


@app.task(name="gpufleet.deploy", bind=True)
def deploy(self: Task, model: str, replicas: int = 1, dedicated: bool = False) -> dict[str, Any]:
    """Place `replicas` replicas of `model` without inferring; workers load them now."""
    spec = context.catalog().get(model)
    demand = context.demand(spec, replicas=replicas, dedicated=dedicated)
    registry = context.registry()
    placements = []
    for _ in range(replicas):
        plan = registry.place(demand)
        if plan.candidate is Candidate.DEPLOYED:
            break
        _announce(self, plan)
        app.send_task("gpufleet.load", args=(plan.replica, model), queue=plan.queue)
        placements.append(
            {
                "replica": plan.replica,
                "gpus": dict(plan.gpus),
                "worker": plan.worker,
                "candidate": plan.candidate.name,
                "evicted": [[e.replica, e.to.value] for e in plan.evictions],
            }
        )
    snap = registry.snapshot()
    return {
        "model": model,
        "placed": placements,
        "replicas": [
            {
                "replica": d.replica,
                "level": d.level.value,
                "gpus": dict(d.gpus),
                "dedicated": d.dedicated,
            }
            for d in snap.replicas(model)
            if d.level is not Level.COLD
        ],
    }


@app.task(name="gpufleet.evict")
def evict(model: str, replica: str | None = None) -> dict[str, Any]:
    """Drain, then offload (or drop) one replica of `model`, or all of them."""
    context.catalog().get(model)
    registry = context.registry()
    snap = registry.snapshot()
    targets = [
        d
        for d in snap.replicas(model)
        if d.level is not Level.COLD and replica in (None, d.replica)
    ]
    results = []
    for dep in targets:
        level = registry.evict(dep.replica)
        if dep.queue:
            app.send_task("gpufleet.sync", queue=dep.queue)
        results.append({"replica": dep.replica, "level": level.value})
    return {"model": model, "evicted": results}


@app.task(name="gpufleet.status")
def status() -> dict[str, Any]:
    """The same object `gpufleet status --json` prints."""
    return metrics.full_status(context.registry(), context.settings().broker_url)


@worker_process_init.connect
def _start_sweeper(**_: Any) -> None:
    """Routers reap dead workers and settle lapsed drains in the background."""
    if context.role() != "router":
        return

    def sweep() -> None:
        while True:
            time.sleep(SWEEP_EVERY_S)
            try:
                swept = context.registry().sweep()
                if swept["reaped"] or swept["drained"]:
                    log.info("swept: %s", swept)
            except Exception:
                log.exception("sweep failed; retrying")

    threading.Thread(target=sweep, name="gpufleet-sweeper", daemon=True).start()
