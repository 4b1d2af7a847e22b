"""Replicas follow load: the routers' scaling loop, and `gpufleet.scale`, which acts on it.

Every router process looks at the load of each `replicas: {min, max}` model twice a
second (`placement.ledger.load`) and applies `placement.rules.scaling`'s rule. A decision is sent as
a `gpufleet.scale` task to the routers' internal queue (which only fleet processes
write: a caller's `gpufleet.scale` is refused), so Flower lists every scale-out and
scale-in with its reason; the task logs the same line and the registry's event says it
too (`why`). Several routers may decide the same thing at once: a scale-out places the
replica only while the model has fewer than its target (commit.lua), a scale-in evicts
only above the model's floor (evict.lua), and either acts only while the model's replicas
are as the decision saw them (its `changes` count), so the loser's task, or one that
arrives after the fleet moved on, changes nothing.

A scale-out prefers a warm copy, then free memory (the policy's order), on a GPU worker
that holds no replica of the model (a worker runs one call at a time, so a second
replica there would add no throughput), and never evicts a replica of a model that is
itself under pressure, nor a busy or dedicated one. A scale-in offloads the replica to
its host's warm cache when there is room, else drops it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from celery import Task
from celery.signals import worker_process_init

from placement.errors import GpufleetError, PayloadError, describe
from placement.ledger.load import placed_replicas, read_changes, read_loads
from placement.ledger.registry import Registry
from placement.policy.state import Candidate, Demand, Level, Plan
from placement.rules.scaling import Autoscale, ScaleIn, ScaleOut, Scaler
from tasks import context
from tasks.app import app
from tasks.broker.intake import is_count, is_name
from tasks.config import INTERNAL_QUEUE, SCALE

log = logging.getLogger(__name__)

LOOK_EVERY_S = 0.5


class ScalingLoop:
    """One router's look at the fleet's load, and the decisions it sends on."""

    def __init__(
        self,
        registry: Registry,
        rules: dict[str, Autoscale],
        scaler: Scaler,
        send: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.registry, self.rules, self.scaler = registry, rules, scaler
        self.send = send or _send_task

    def look(self) -> list[ScaleOut | ScaleIn]:
        """Read the load of every scaled model and send on what the rule decides, as the
        keyword arguments of `gpufleet.scale`."""
        if not self.rules:
            return []
        changes = read_changes(self.registry, self.rules)  # before the view it names
        with self.registry.follower.current() as snap:
            placed = placed_replicas(
                (d for model in self.rules for d in snap.replicas(model)), self.rules
            )
        loads = read_loads(self.registry, placed, changes)
        decisions = self.scaler.decide(int(time.monotonic() * 1000), loads, self.rules)
        pressed = sorted(m.model for m in loads if m.pressure >= self.scaler.threshold)
        by_model = {m.model: m for m in loads}
        for decision in decisions:
            kwargs: dict[str, Any] = {
                "model": decision.model,
                "why": decision.why,
                "changes": decision.changes,
            }
            if isinstance(decision, ScaleOut):
                kwargs |= {
                    "target": decision.target,
                    "avoid": sorted({r.worker for r in by_model[decision.model].replicas}),
                    "protect": pressed,
                }
            else:
                floor = self.rules[decision.model].floor
                kwargs |= {"replica": decision.replica, "epoch": decision.epoch, "floor": floor}
            self.send(kwargs)
        return decisions


def _send_task(kwargs: dict[str, Any]) -> None:
    app.send_task(SCALE, kwargs=kwargs, queue=INTERNAL_QUEUE)


def scale_out(
    registry: Registry,
    demand: Demand,
    avoid: frozenset[str],
    why: str,
    *,
    changes: int | None = None,
) -> tuple[Plan | None, str]:
    """Place one more replica of `demand.model`, up to `demand.replicas` placed, on none of
    `avoid`'s GPUs, while the model's `changes` count is still `changes` (None: any): the
    plan, or None and why nothing was placed."""
    try:
        plan = registry.place(demand, avoid_workers=avoid, why=why, changes_seen=changes)
    except GpufleetError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if plan.candidate is Candidate.DEPLOYED:
        return None, f"{demand.model} already has {demand.replicas} replicas placed"
    return plan, f"replica {plan.replica} on {', '.join(plan.gpus)}"


def scale_in(
    registry: Registry,
    replica: str,
    epoch: int,
    floor: int,
    why: str,
    *,
    changes: int | None = None,
) -> tuple[Level | None, str]:
    """Offload (or drop) `replica`, if still HOT and idle in placement `epoch`, while its
    model keeps `floor` others placed and its `changes` count is still `changes`
    (None: any): the level it went to, or None and why it stays."""
    try:
        level = registry.evict(replica, floor=floor, epoch=epoch, why=why, changes_seen=changes)
    except GpufleetError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return level, f"replica {replica} is {level.value}"


def _scale_intake(headers: dict[str, Any], a: dict[str, Any]) -> None:
    """Refuse a `gpufleet.scale` the scaling loop did not write (`tasks.broker.intake`)."""
    context.catalog().get(a["model"])
    fits = {
        "why": isinstance(a["why"], str),
        "replica": a["replica"] is None or is_name(a["replica"]),
        "target": a["target"] is None or (is_count(a["target"]) and a["target"] >= 1),
        "epoch": is_count(a["epoch"]),
        "floor": is_count(a["floor"]),
        "changes": a["changes"] is None or is_count(a["changes"]),
        **{
            name: a[name] is None or (isinstance(a[name], list) and all(map(is_name, a[name])))
            for name in ("avoid", "protect")
        },
    }
    for name, ok in fits.items():
        if not ok:
            raise PayloadError(f"gpufleet.scale: {name} is {describe(a[name])}")


@app.task(
    name=SCALE,
    bind=True,
    intake=staticmethod(_scale_intake),
)
def scale(
    self: Task,
    model: str,
    why: str,
    *,
    target: int | None = None,
    avoid: list[str] | None = None,
    protect: list[str] | None = None,
    replica: str | None = None,
    epoch: int = 0,
    floor: int = 0,
    changes: int | None = None,
) -> dict[str, Any]:
    """Carry out one scaling decision: place a replica (`target`), or evict one (`replica`)."""
    registry = context.registry()
    fields: dict[str, Any]
    if replica is not None:
        level, detail = scale_in(registry, replica, epoch, floor, why, changes=changes)
        fields = {"replica": replica, "level": level.value} if level is not None else {}
    else:
        spec = context.catalog().get(model)
        demand = replace(context.demand(spec, replicas=target), protect=frozenset(protect or ()))
        plan, detail = scale_out(registry, demand, frozenset(avoid or ()), why, changes=changes)
        fields = {"replica": plan.replica, "gpus": dict(plan.gpus)} if plan is not None else {}
    done = bool(fields)
    log.info("%s: %s%s", why, "" if done else "not done, ", detail)
    if done:
        _announce(self, model, why, **fields)
    return {"model": model, "why": why, "done": done, "detail": detail, **fields}


def _announce(task: Task, model: str, why: str, **fields: Any) -> None:
    """Tell Flower; never fail the decision over it."""
    try:
        task.send_event("task-scaled", model=model, why=why, **fields)
    except Exception:
        log.warning("could not announce: %s", why, exc_info=True)


def rules_of_catalog() -> dict[str, Autoscale]:
    """The catalog's models whose replica count follows load."""
    catalog = context.catalog()
    return {name: spec.autoscale for name in catalog if (spec := catalog[name]).autoscale}


@worker_process_init.connect
def _start_scaling(**_: Any) -> None:
    """Routers look at the load of scaled models in the background."""
    if context.role() != "router":
        return
    settings = context.settings()
    rules = rules_of_catalog()
    if not rules:
        return
    scaler = Scaler(settings.scale_threshold, settings.scale_window_ms, settings.keep_alive_ms)
    loop = ScalingLoop(context.registry(), rules, scaler)

    def run() -> None:
        while True:
            time.sleep(LOOK_EVERY_S)
            try:
                loop.look()
            except Exception:
                log.exception("scaling look failed; looking again")

    threading.Thread(target=run, name="gpufleet-scaling", daemon=True).start()
