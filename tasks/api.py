"""The public tasks: `gpufleet.infer`, `gpufleet.deploy`, `gpufleet.evict`, `gpufleet.status`,
`gpufleet.cancel`; and `generate`, the project client's way to stream a generation.

`infer` runs in two places. Sent with a lease header by the fast path, it runs on the
GPU worker that holds the replica. Otherwise it runs on the router, which validates the
call, plans a place for the model when none is HOT, commits the plan atomically (which
tells the workers concerned, and pins the replica for this call), and hands the call to
the chosen GPU worker with `Task.replace`, so the caller's AsyncResult yields the final
answer.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Retry
from celery.signals import worker_process_init

from placement.catalog.catalog import ModelSpec
from placement.errors import (
    CantAccommodateError,
    GpufleetError,
    NeverFitsError,
    PayloadError,
    PlanRejectedError,
    SettlingError,
    UnknownReplicaError,
    describe,
)
from placement.ledger.hot import DEFAULT_REQUEST_LEASE_MS, Lease
from placement.ledger.registry import Registry
from placement.ledger.tenancy import tenants
from placement.policy.state import LEAVING, RESERVING, Candidate, Level, Plan
from tasks import context
from tasks.app import app
from tasks.broker import presence
from tasks.broker.intake import LEASE_HEADER, is_name, redelivered
from tasks.config import CANCEL, DEPLOY, EVICT, INFER, INTERNAL_QUEUE, STATUS
from tasks.serving import cancelling, leases, routed, streams
from tasks.serving.calls import (
    Call,
    counted_of,
    fast_call,
    hops_of,
    slot_of,
    tenant_of,
    time_limits_of,
)
from tasks.serving.routing import prefix_of
from tasks.serving.status import full_status
from tasks.serving.tenants import tenancy
from worker.handlers import validate

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 2.0
BUSY_RETRIES = 20  # a model blocked by busy replicas is retried about once a second
SETTLE_RETRIES = 120  # a copy still leaving its GPU, or a fleet moving under every plan:
# retried every 0.25 s, for about two worker leases
PLACE_ATTEMPTS = 3  # placements in a row that moved on before the call pinned one
EVICT_WAIT_S = 10.0  # how long `gpufleet.evict` waits for workers to settle their moves


def _infer_intake(headers: dict[str, Any], arguments: dict[str, Any]) -> None:
    """What the consumer checks of a `gpufleet.infer` before it runs (`tasks.broker.intake`): a
    catalog model, a payload its task takes, and a lease header the fleet wrote."""
    catalog = context.catalog()
    model, params = catalog.base_call(arguments["model"], arguments["params"])
    spec = catalog.get(model)
    validate(spec.task, arguments["inputs"], params)
    leases.from_header(spec.name, headers.get(LEASE_HEADER))


@app.task(name=INFER, bind=True, intake=staticmethod(_infer_intake))
def infer(
    self: Task, model: str, inputs: Any, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run `inputs` through `model`; returns outputs, the replica and GPUs used, and timings.
    `model` may name an adapter of a base model as `BASE:ADAPTER`."""
    hops = hops_of(self.request)
    model, params = context.catalog().base_call(model, params)
    if context.role() == "gpu":
        call = fast_call(model, inputs, params, getattr(self.request, LEASE_HEADER, None), hops)
        if call is not None:
            from tasks.serving.gpu import serve  # only GPU workers import torch

            return serve(self, call)
    return dispatch(self, model, inputs, params, hops)


def dispatch(
    task: Task, model: str, inputs: Any, params: dict[str, Any] | None, hops: int
) -> dict[str, Any]:
    """The router's half of `infer`: find or make a HOT replica, then hand the call over.

    A call is counted once (docs/metrics.md), by the routing that first pins or refuses
    it: a call whose message says it is counted already (handed to a GPU worker before,
    on the fast path or by a router) counts nothing here; a busy retry counts `busy`."""
    spec = context.catalog().get(model)
    validate(spec.task, inputs, params)  # a bad payload fails here, before any GPU work
    registry = context.registry()
    sent = int(time.time() * 1000)
    held = task.request.id or uuid.uuid4().hex
    if redelivered(task.request) and _on_its_way(task):
        routed.hold(registry, model, held, False)  # a dead router may have held it
        log.warning("call %s was handed on before its router died: not routing it again", held)
        raise Ignore()  # acknowledged, no result stored: the call's own answer comes
    prefix = prefix_of(model, inputs, params, known_tenant(task.request))
    lease = registry.pick(model, path="" if counted_of(task.request) else "router", prefix=prefix)
    if lease is not None:
        if task.request.retries or redelivered(task.request):  # an earlier attempt held it
            routed.hold(registry, model, held, False)  # (a dead router's too: no wait for its TTL)
        call = Call(model, inputs, params, lease.replica, "hot", sent, hops=hops)
        raise task.replace(
            call.with_lease(lease).to(
                lease.queue,
                time_limits_of(task.request),
                known_tenant(task.request),
                slot_of(task.request),
            )
        )
    routed.hold(registry, model, held, True)  # part of the model's load while the router has it
    try:
        _place_and_hand_on(task, registry, spec, inputs=inputs, params=params, sent=sent, hops=hops)
    except Retry:
        raise  # still held: the next attempt renews it
    except BaseException:
        routed.hold(registry, model, held, False)  # handed on (`replace` raises Ignore), or failed
        raise


def _place_and_hand_on(
    task: Task,
    registry: Registry,
    spec: ModelSpec,
    *,
    inputs: Any,
    params: dict[str, Any] | None,
    sent: int,
    hops: int,
) -> NoReturn:
    """Place the model (or find its replica being placed) and hand the call to it."""
    model = spec.name
    for _ in range(PLACE_ATTEMPTS):
        plan, pinned = _place(task, registry, spec, model)
        if pinned is None:  # the placed replica moved on before the call could pin it,
            registry.reap(plan.worker)  # or its worker died: let it go now, not at a sweep
            continue
        lease, cache = pinned
        call = Call(model, inputs, params, plan.replica, cache, sent, hops=hops)
        try:
            raise task.replace(
                call.with_lease(lease).to(
                    plan.queue,
                    time_limits_of(task.request),
                    known_tenant(task.request),
                    slot_of(task.request),
                )
            )
        finally:  # once the call is on its way: the figures are not on its critical path
            if plan.candidate is Candidate.DEPLOYED:  # placed already: nothing moved
                _count(task, registry, model, "queued")
            else:
                _count(task, registry, model, cache)
                _announce(task, plan)
    moving = PlanRejectedError(f"{model}: its replicas kept moving while the call was routed")
    raise _again(task, moving, 0.25, SETTLE_RETRIES)


def _place(
    task: Task, registry: Registry, spec: ModelSpec, model: str
) -> tuple[Plan, tuple[Lease, str] | None]:
    """A placed replica for the call, the request lease that pins it there, and where its
    copy comes from (hot, warm or cold)."""
    lease_id = registry.new_lease_id()
    try:
        plan = registry.place(context.demand(spec), lease_id=lease_id)
    except NeverFitsError as exc:
        _count(task, registry, model, "rejected", str(exc))
        raise
    except SettlingError as exc:  # a copy is still leaving: restore it once it has left
        raise _again(task, exc, 0.25, SETTLE_RETRIES) from exc
    except PlanRejectedError as exc:  # the fleet moved under every plan: try again shortly
        raise _again(task, exc, 0.25, SETTLE_RETRIES) from exc
    except CantAccommodateError as exc:
        told = "" if task.request.retries else str(exc)  # the map's feed: a call's first try
        _count(task, registry, model, "busy", told)
        raise _again(task, exc, 1, BUSY_RETRIES) from exc
    if plan.candidate is Candidate.DEPLOYED:
        return plan, registry.hold(plan.replica, plan.epoch, plan.worker)
    deadline = int(time.time() * 1000) + DEFAULT_REQUEST_LEASE_MS  # commit.lua took it
    lease = Lease(lease_id, model, plan.replica, plan.queue, plan.worker, {}, deadline, plan.epoch)
    # a restore, or a load that reads another worker's warm copy, comes from CPU memory
    warm = plan.reuse is Level.WARM or bool(plan.read_from)
    return plan, (lease, "warm" if warm else "cold")


def _again(task: Task, exc: Exception, countdown: float, max_retries: int) -> Retry:
    """Retry the call later, on the router's internal queue, where its headers (re-route
    count, counted) keep their meaning (a public queue takes them off: `tasks.broker.intake`)."""
    return task.retry(exc=exc, countdown=countdown, max_retries=max_retries, queue=INTERNAL_QUEUE)


def _on_its_way(task: Task) -> bool:
    """`elsewhere`, for the call `task` runs."""
    task_id = task.request.id
    tag = str((task.request.delivery_info or {}).get("delivery_tag") or "")
    return bool(task_id) and routed.elsewhere(task_id, tag)


def _count(task: Task, registry: Registry, model: str, outcome: str, why: str = "") -> None:
    """Count a call's outcome (and its `routed` path) for the operator numbers, unless its
    message says it is counted already (`busy`, per try, counts either way); never fail
    the call over it."""
    if outcome != "busy" and counted_of(task.request):
        return
    try:
        registry.count(model, outcome, why)
    except GpufleetError:
        log.warning("could not count a %s outcome for %s", outcome, model, exc_info=True)


def _announce(task: Task, plan: Plan) -> None:
    """Tell Flower (commit.lua already told the workers concerned); never fail the call
    over it, since the placement holds a lease for this call."""
    try:
        task.send_event(
            "task-placement",
            model=plan.model,
            replica=plan.replica,
            candidate=plan.candidate.name,
            gpus=dict(plan.gpus),
            evicted=[[e.replica, e.to.value] for e in plan.evictions],
        )
    except Exception:
        log.warning("could not announce the placement of %s", plan.replica, exc_info=True)


def _deploy_arguments(model: Any, replicas: Any, dedicated: Any) -> ModelSpec:
    """The model a `gpufleet.deploy` names, once its arguments are checked."""
    spec = context.catalog().get(model)
    cap = spec.max_replicas or context.settings().max_replicas
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= cap:
        raise PayloadError(
            f"replicas must be a whole number from 1 to {cap} for {model} (its max_replicas), "
            f"got {describe(replicas)}"
        )
    if dedicated is not None and not isinstance(dedicated, bool):
        raise PayloadError(
            f"dedicated must be true, false or null (the catalog's), got {describe(dedicated)}"
        )
    return spec


def _caller_deploy(model: str, dedicated: bool | None) -> None:
    """A caller may not override the catalog's `dedicated`: a dedicated replica is never
    evicted by pressure, so one caller's `deploy(m, 8, dedicated=True)` walled other
    callers' models off the GPUs, and `dedicated=False` would expose a model the operator
    protected. Setting it is the operator's right (docs/deploy.md, "Who may do what")."""
    spec = context.catalog().get(model)
    if dedicated is not None and dedicated != spec.dedicated:
        raise PayloadError(
            f"dedicated is the operator's to set: {model} is{'' if spec.dedicated else ' not'} "
            f"dedicated in the catalog. Send dedicated=null (the catalog's), or ask an "
            f"operator: `gpufleet deploy {model} --{'' if dedicated else 'not-'}dedicated` on "
            f"the fleet's host, or the catalog's `dedicated`"
        )


@app.task(
    name=DEPLOY,
    bind=True,
    intake=staticmethod(
        lambda headers, a: _deploy_arguments(a["model"], a["replicas"], a["dedicated"])
    ),
    caller_intake=staticmethod(lambda a: _caller_deploy(a["model"], a["dedicated"])),
)
def deploy(
    self: Task, model: str, replicas: int = 1, dedicated: bool | None = None
) -> dict[str, Any]:
    """Make `replicas` replicas of `model` placed, without a call; workers load them now.
    `dedicated` is the catalog's unless the fleet's own user says otherwise (a caller may
    not: `_caller_deploy`).

    Replicas are placed one by one. When the fleet runs out of room, the ones placed stay
    (and so do the evictions made for them) and the answer says how many are missing and
    why (`missing`, `refused`); nothing is evicted for a replica that is then not placed.
    """
    spec = _deploy_arguments(model, replicas, dedicated)
    demand = context.demand(spec, replicas=replicas, dedicated=dedicated)
    registry = context.registry()
    placements = []
    refused: GpufleetError | None = None
    for _ in range(replicas):
        try:
            plan = registry.place(demand)
        except (CantAccommodateError, SettlingError, PlanRejectedError) as exc:
            refused = exc  # what is placed stays placed; say what is missing below
            break
        if plan.candidate is Candidate.DEPLOYED:
            break
        _announce(self, plan)  # commit.lua told the worker: it loads the replica now
        placements.append(
            {
                "replica": plan.replica,
                "gpus": dict(plan.gpus),
                "worker": plan.worker,
                "candidate": plan.candidate.name,
                "evicted": [[e.replica, e.to.value] for e in plan.evictions],
            }
        )
    mine = registry.snapshot().replicas(model)
    placed = [d for d in mine if d.level in RESERVING]
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
            for d in mine
            if d.level is not Level.COLD
        ],
        "missing": max(0, replicas - len(placed)),
        "refused": f"{type(refused).__name__}: {refused}" if refused is not None else None,
    }


def _evict_arguments(model: Any, replica: Any) -> None:
    """Raise what is wrong with a `gpufleet.evict`'s arguments."""
    context.catalog().get(model)
    if replica is not None and not is_name(replica):
        raise PayloadError(
            f"replica must be a replica id (a string) or null, got {describe(replica)}"
        )


@app.task(
    name=EVICT,
    intake=staticmethod(lambda headers, a: _evict_arguments(a["model"], a["replica"])),
)
def evict(model: str, replica: str | None = None) -> dict[str, Any]:
    """Drain, then offload (or drop) one replica of `model`, or all of them.

    Each replica's level is reported once its worker settled the move (WARM or COLD), or
    DRAINING while calls still run on it; a move its worker has not settled within
    `EVICT_WAIT_S` is reported as it stands (OFFLOADING or DROPPING).
    """
    _evict_arguments(model, replica)
    registry = context.registry()
    mine = registry.snapshot().replicas(model)
    known = {d.replica for d in mine}
    if replica is not None and replica not in known:
        raise UnknownReplicaError(
            f"{model} has no replica {describe(replica, 40)}; its replicas are listed by "
            f"`gpufleet status` (there are {len(known)})"
        )
    targets = [d for d in mine if d.level is not Level.COLD and replica in (None, d.replica)]
    started = [(dep.replica, registry.evict(dep.replica)) for dep in targets]
    results = [
        {"replica": r, "level": registry.wait_settled(r, EVICT_WAIT_S).value}
        if level in LEAVING
        else {"replica": r, "level": level.value}
        for r, level in started
    ]
    return {"model": model, "evicted": results}


@app.task(name=STATUS)
def status() -> dict[str, Any]:
    """The same object `gpufleet status --json` prints."""
    return full_status(context.registry(), context.settings().broker_url)


def _cancel_arguments(task_id: Any) -> None:
    if not is_name(task_id):
        raise PayloadError(f"task_id must be a call's task id (a string), got {describe(task_id)}")


@app.task(
    name=CANCEL,
    intake=staticmethod(lambda headers, a: _cancel_arguments(a["task_id"])),
)
def cancel(task_id: str) -> bool:
    """Stop a call, sent on by the router (a caller's Redis user may not use Celery's remote
    control): a call still queued is discarded as a worker takes it, a running generation
    stops within a decode step, and either ends as revoked. True once sent; False for a
    call already answered. A router answers it in its consumer (`tasks.serving.cancelling`);
    this runs it anywhere else."""
    _cancel_arguments(task_id)
    target = tenants.call_id(task_id, tenant_of(cancel.request))  # its tenant's own call
    if routed.answered(target):
        return False
    cancelling.cancel_calls(app, [target])
    return True


class Generate:
    """The project client's generating calls: `generate(model, prompt, **params)` returns
    the whole result; `generate.stream(model, prompt, **params)` yields the text as the
    model writes it (`tasks.serving.streams`), and cancels the call if the caller stops
    reading before the end. `prompt` is a string or a chat (a list of role/content dicts);
    params are those of text-generation (docs/tasks.md)."""

    def __call__(
        self, model: str, prompt: Any, *, timeout: float = 300.0, **params: Any
    ) -> dict[str, Any]:
        result: dict[str, Any] = infer.delay(model, prompt, params).get(timeout=timeout)
        return result

    def stream(
        self, model: str, prompt: Any, *, timeout: float = 300.0, **params: Any
    ) -> Iterator[str]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], dict):
            raise PayloadError("stream takes one prompt (a string) or one chat; send it alone")
        call = infer.apply_async((model, prompt, {**params, "stream": True}))
        ended, given = False, ""
        try:
            for _, text in streams.read(app.backend.client, call.id, call.ready, timeout):
                given += text
                yield text
            ended = True
        finally:
            if not ended:
                cancel.delay(call.id)
        answer = call.get(timeout=timeout)  # the call's error, if it failed
        whole = answer["outputs"]["texts"][0]
        if whole.startswith(given) and len(whole) > len(given):
            yield whole[len(given) :]  # what the stream did not carry (it expired, say)


generate = Generate()


@worker_process_init.connect
def _start_sweeper(**_: Any) -> None:
    """Routers reap dead workers and settle lapsed drains in the background."""
    if context.role() != "router":
        return

    def sweep() -> None:
        broker = routed.broker()
        hearing = presence.Hearing(context.settings().worker_lease_ms / 1000)
        while True:
            time.sleep(SWEEP_EVERY_S)
            try:
                registry = context.registry()
                registry.now_ms()  # Redis answers: silence counts from a lease after that
                if not hearing.heard(time.monotonic()):
                    continue
                swept = registry.sweep()
                if swept["reaped"] or swept["drained"]:
                    log.info("swept: %s", swept)
                # after the reaping: a dead GPU worker's calls go back once its GPUs are free
                live = functools.partial(_live_gpu_queues, registry)
                names = tenants.records(registry)
                presence.sweep(broker, live, routed.answered, registry.end_leases_of, names)
            except Exception:
                hearing.lost()
                log.exception("sweep failed; retrying")

    threading.Thread(target=sweep, name="gpufleet-sweeper", daemon=True).start()


def known_tenant(request: Any) -> str:
    """The tenant of a call, if the fleet knows it (`tasks.serving.tenants.tenancy`)."""
    return tenancy.process.known(tenant_of(request))


def _live_gpu_queues(registry: Registry) -> frozenset[str]:
    """The queues of GPU workers whose ledger lease holds."""
    return registry.snapshot().live_queues
