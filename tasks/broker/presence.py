"""Which Celery workers are alive, and what becomes of the calls of those that are not.

Every gpufleet Celery worker (a router, a GPU worker) keeps a record in the broker
database (`placement.ledger.keys.CONSUMERS`): its node name, the queues it consumes, and a
deadline it pushes on every third of `GPUFLEET_WORKER_LEASE_MS`. The transport
(`tasks.broker.transport`) records which worker holds each unacknowledged message, and each
worker takes through in-flight lists named after it, so the calls a worker holds are
known by name. Then:

- a worker that starts under a dead one's node name (`gpufleet up` restarting it) first
  puts back, first in line, what its predecessor held (`Presence.arrive`);
- a router's sweep (`sweep`, every 2 s) does the same for a worker whose deadline passed
  (a lost host, a SIGSTOP, a worker that left with something unacknowledged) and keeps
  its record, marked gone, for a day;
- either of them ends the request leases the dead worker took (each lease id begins with
  its taker's record token, `placement.ledger.hot.new_lease_id`): a router killed
  between leasing a replica and sending the call would otherwise pin that replica, and
  keep its drain from ending, until the lease's deadline. A worker that stopped on its
  own (its record marked `left`) keeps them: its pool sent every call it took;
- a GPU worker's queue whose worker is gone and whose GPUs hold no live lease in the
  ledger is handed to the router: every call waiting there, or held by the dead worker,
  becomes a `gpufleet.infer` on the router's internal queue with the same task id, in order,
  first in line, and is placed again on a live GPU;
- a call whose answer is already stored (its worker died after storing it, before the
  acknowledgement) is dropped, not run again;
- a call given back to a router that is on its way in another message (its router died
  after handing it on) is not routed again (`on_its_way`);
- status counts the calls no live worker will take (`stranded`), and a bundled fleet
  that stops takes out the calls still waiting, to fail them (`take_waiting`).

Each message moves at most once (`redeliver.lua` checks it is still where the plan read
it), and only while the dead worker's record is the one the plan read: a worker that
comes back at that moment (its record renewed) keeps its queue. So a call is neither lost
nor doubled by a sweep; it can still run twice when a worker dies between running it
and storing its answer (docs/tasks.md, "A lost worker or host").
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import math
import re
import secrets
import threading
from bisect import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import redis
from celery.signals import worker_init, worker_shutdown
from kombu.transport.redis import Channel as KombuChannel

from placement.ledger import endpoint
from placement.ledger.keys import CONSUMERS, KeyList, unacked_of
from placement.ledger.scripts import scripts_for
from placement.ledger.tenancy.tenants import (
    DEFAULT,
    call_id,
    owner,
    queue_of,
    split_queue,
    tenant_of,
    worker_queue,
)
from tasks import context
from tasks.broker.intake import HOPS_HEADER, LEASE_HEADER, mark_redelivered
from tasks.broker.transport import inflight
from tasks.config import INFER, INTERNAL_QUEUE, ROUTER_QUEUES, RUN, is_public, is_routers

log = logging.getLogger(__name__)

#: How long a dead worker's record is kept, so calls sent to its queue late still go back.
KEEP_GONE_MS = 24 * 3600 * 1000
#: Attempts at one plan while the record it reads keeps changing.
PLAN_ATTEMPTS = 5

UNACKED = KombuChannel.unacked_key
UNACKED_INDEX = KombuChannel.unacked_index_key
PRIORITY_STEPS: list[int] = list(KombuChannel.priority_steps)

#: Ends the request leases a dead worker took, given its record's token; says how many.
Release = Callable[[str], int]


def lists(queue: str) -> list[str]:
    """A queue's lists in the order a consumer takes from them (kombu: one per priority)."""
    return [queue if not p else f"{queue}{KombuChannel.sep}{p}" for p in PRIORITY_STEPS]


def depth(client: redis.Redis, queue: str) -> int:
    """How many messages wait on `queue` (every list of it)."""
    pipe = client.pipeline(transaction=False)
    for name in lists(queue):
        pipe.llen(name)
    return sum(int(n) for n in pipe.execute())


def list_for(queue: str, payload: dict[str, Any]) -> str:
    """The list of `queue` that a message with `payload`'s priority is published to."""
    try:
        priority = max(0, min(int(payload["properties"]["priority"]), 9))
    except (KeyError, TypeError, ValueError):
        priority = 0
    step = PRIORITY_STEPS[bisect(PRIORITY_STEPS, priority) - 1]
    return queue if not step else f"{queue}{KombuChannel.sep}{step}"


@dataclass(frozen=True)
class Record:
    """One Celery worker as the broker knows it."""

    node: str
    raw: str  # the record as stored, which a plan must still find
    role: str
    queues: tuple[str, ...]
    deadline_ms: int
    gone_ms: int  # when a sweep found it dead (0: not yet)
    token: str = ""  # this run of the worker: its request leases' taker
    left: bool = False  # it stopped on its own (warm shutdown), not killed

    def alive(self, now_ms: int) -> bool:
        return not self.gone_ms and self.deadline_ms > now_ms

    @classmethod
    def parse(cls, node: str, raw: str) -> Record:
        data = json.loads(raw)
        queues = data.get("queues") or []  # cjson writes an empty list as {}
        return cls(
            node,
            raw,
            str(data.get("role", "")),
            tuple(queues) if isinstance(queues, list) else (),
            int(data.get("deadline", 0)),
            int(data.get("gone_ms", 0)),
            str(data.get("token", "")),
            bool(data.get("left", False)),
        )


def now_ms(client: redis.Redis) -> int:
    """The broker's clock, which the scripts use too."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def records(client: redis.Redis) -> dict[str, Record]:
    """Every worker with a record in the broker, by node name."""
    raw: dict[Any, Any] = client.hgetall(CONSUMERS)
    return {_text(k): Record.parse(_text(k), _text(v)) for k, v in raw.items()}


class Presence:
    """This worker's record: made as it starts, renewed while it runs, ended as it stops."""

    def __init__(
        self, client: redis.Redis, node: str, role: str, queues: Iterable[str], lease_ms: int
    ) -> None:
        self.client = client
        self.node = node
        self.role = role
        self.queues = tuple(sorted(queues))
        self.lease_ms = lease_ms
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._arrived = False

    def arrive(self, release: Release | None = None) -> int:
        """Put back what a predecessor of this node name held, then record this worker;
        return how many calls went back. `release` ends the request leases the
        predecessor took (given its token)."""
        raw = self.client.hget(CONSUMERS, self.node)
        if raw is not None and release is not None:
            _release(release, Record.parse(self.node, _text(raw)))
        moved = _redeliver(self.client, self.node, self._record(), _holdings)
        self._arrived = True
        if moved:
            log.warning("put back %d call(s) that %s held when it died", moved, self.node)
        return moved

    def keep(self) -> None:
        """Renew the record every third of the lease, from a daemon thread."""
        threading.Thread(target=self._renew, name="gpufleet-presence", daemon=True).start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_ms / 3000):
            try:
                if not self._arrived:  # Redis did not answer as it started
                    # It may hold calls of its own by now: record it, give nothing back (a
                    # predecessor's unacknowledged calls wait for the visibility timeout).
                    self._rejoin()
                    self._arrived = True
                    log.warning("%s recorded late: no predecessor's call put back", self.node)
                elif not self._renewed(leaving=False):
                    log.error(
                        "%s was silent for longer than its lease (%d ms): a sweep gave its "
                        "calls to other workers; recording it again",
                        self.node,
                        self.lease_ms,
                    )
                    self._rejoin()
            except redis.RedisError as exc:
                log.warning("could not renew %s's record (retrying): %s", self.node, exc)

    def _rejoin(self) -> None:
        _redeliver(self.client, self.node, self._record(), _nothing, rejoin=True)

    def consume(self, queues: Iterable[str]) -> None:
        """The worker now consumes `queues` (a router, as tenants come and go): record
        them, so that a sweep after its death looks in their in-flight lists too."""
        wanted, was = tuple(sorted(set(queues))), self.queues
        if wanted != was:
            self.queues = wanted
            try:
                self._rejoin()
            except BaseException:
                self.queues = was  # not recorded: the next call tries again
                raise

    def _record(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "role": self.role,
            "queues": list(self.queues),
            "lease_ms": self.lease_ms,
        }

    def leave(self) -> None:
        """Stop renewing and end the record: a sweep gives back what is left."""
        self._stop.set()
        try:
            self._renewed(leaving=True)
        except redis.RedisError as exc:
            log.warning("could not end %s's record; it lapses: %s", self.node, exc)

    def _renewed(self, leaving: bool) -> bool:
        reply = scripts_for(self.client)(
            "renew", [CONSUMERS], [self.node, self.token, "1" if leaving else "0"]
        )
        return bool(reply)


class Hearing:
    """Whether a sweeper may judge workers by their silence now. A worker renews its lease
    while it reaches Redis; so does any live one once Redis answers again after an outage,
    within one lease. So silence counts only over time the sweeper itself heard Redis:
    after a sweep that could not reach it, the next sweep waits until Redis has answered
    for a whole worker lease (`lease_s`). Sweeping at once gave back what every live worker
    held, after an outage longer than a lease, and ran it again elsewhere."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._since: float | None = -math.inf  # Redis answered from then on (None: not now)

    def lost(self) -> None:
        """A sweep could not reach Redis."""
        self._since = None

    def heard(self, now: float) -> bool:
        """Redis answered at `now` (`time.monotonic()`); whether silence may be judged."""
        if self._since is None:
            self._since = now
        return now - self._since >= self.lease_s


def sweep(
    client: redis.Redis,
    live_gpu_queues: Callable[[], AbstractSet[str]],
    answered: Callable[[str], bool],
    release: Release | None = None,
    tenant_names: Iterable[str] = (),
) -> dict[str, int]:
    """Give back what every dead worker held, and hand the router the calls waiting on
    GPU queues that nobody serves (each tenant's queue of them too: `tenant_names`, the
    fleet's tenants, removed ones still draining included); return how many moved per
    dead worker.

    `live_gpu_queues` names the queues of GPUs whose ledger lease holds (read after the
    records, so a GPU worker is handed over only once the ledger has let it go too);
    `answered(task_id)` says whether a call's answer is already stored; `release(token)`
    ends the request leases a dead worker took, once, in the sweep that marks its record
    gone (never those of a worker that stopped on its own).
    """
    found = records(client)
    now = now_ms(client)
    dead = [r for r in found.values() if not r.alive(now)]
    if not dead:
        return {}
    # a live worker takes its tenants' queues too (`tasks.serving.tenants.tenancy`)
    served = {split_queue(q)[0] for r in found.values() if r.alive(now) for q in r.queues}
    names = tuple(tenant_names)
    ledger: AbstractSet[str] | None = None  # read only when something is to move
    moved: dict[str, int] = {}
    for rec in dead:
        queues = with_tenants(rec.queues, names)
        unserved = {q for q in queues if not is_routers(q) and split_queue(q)[0] not in served}
        if rec.gone_ms and not _holds_anything(client, rec, unserved):
            if now - rec.gone_ms > KEEP_GONE_MS:
                _redeliver(client, rec.node, {"delete": True}, _nothing)
            continue
        if ledger is None:
            ledger = live_gpu_queues()
        orphaned = {q for q in unserved if split_queue(q)[0] not in ledger}
        count = _redeliver(
            client,
            rec.node,
            {"gone": True},
            functools.partial(_holdings, orphaned=orphaned, answered=answered),
            expect_dead=True,
        )
        if not rec.gone_ms and release is not None and _marked_gone(client, rec):
            _release(release, rec)  # once, by the sweep that found it dead, not one it fooled
        if count:
            moved[rec.node] = count
            where = f"the router ({', '.join(sorted(orphaned))})" if orphaned else "their queues"
            log.warning("gave %d call(s) of silent worker %s back to %s", count, rec.node, where)
    return moved


def stranded(
    client: redis.Redis, ledger_queues: Iterable[str], live_gpu_queues: Iterable[str] = ()
) -> dict[str, dict[str, Any]]:
    """The calls no live worker will take, by queue: those waiting on a queue with no live
    worker (no live record, nor a GPU of `live_gpu_queues` in the ledger), and those a
    dead worker held. Each entry says how many, and which worker last served the queue
    (None if none did). A sweep (every 2 s on a live router) moves them once the worker's
    record lapsed; what is left here has no router to go to, or waits for the ledger to
    let a GPU worker go."""
    found = records(client)
    now = now_ms(client)
    served = {q for r in found.values() if r.alive(now) for q in r.queues}
    served |= set(live_gpu_queues)
    queues = {*ROUTER_QUEUES, *ledger_queues} | {q for r in found.values() for q in r.queues}
    # a live worker takes its tenants' queues too, from its next look at the tenants on
    unserved = {q for q in queues - served if split_queue(q)[0] not in served}
    counts: dict[str, int] = dict.fromkeys(sorted(unserved), 0)
    pipe = client.pipeline(transaction=False)
    for queue in counts:
        for name in lists(queue):
            pipe.llen(name)
    dead = [r for r in found.values() if not r.alive(now)]
    for rec in dead:
        for queue in rec.queues:
            for name in lists(queue):
                pipe.llen(inflight(name, rec.node))
    replies = iter(pipe.execute())
    for queue in counts:
        counts[queue] += sum(next(replies) for _ in lists(queue))
    for rec in dead:
        for queue in rec.queues:
            held = sum(next(replies) for _ in lists(queue))
            counts[queue] = counts.get(queue, 0) + held
        for _, raw in _unacked(client, rec.node):
            try:
                queue = json.loads(raw)[2]
            except (ValueError, TypeError, IndexError):
                continue
            counts[queue] = counts.get(queue, 0) + 1
    last: dict[str, str] = {}
    for rec in sorted(found.values(), key=lambda r: r.deadline_ms):
        for queue in rec.queues:
            last[queue] = rec.node
    return {
        queue: {"calls": n, "last_worker": last.get(queue)}
        for queue, n in sorted(counts.items())
        if n
    }


def stranded_problems(found: dict[str, dict[str, Any]]) -> list[str]:
    """One line per queue of `stranded`, saying what happens to its calls."""
    lines = []
    for queue, entry in found.items():
        n, worker = entry["calls"], entry["last_worker"]
        if is_routers(queue):
            then = "start a router (`gpufleet up` on any host of this fleet) to place them"
        else:
            then = "a live router hands them over once the ledger lets the worker go"
        last = f" (last served by {worker})" if worker else ""
        lines.append(f"{n} call(s) wait on {queue}, which no live worker takes{last}: {then}")
    return lines


def on_its_way(
    client: redis.Redis,
    task_id: str,
    own_tag: str,
    queues: Iterable[str] = (),
    tenant_names: Iterable[str] = (),
) -> bool:
    """Whether call `task_id`, whose message (delivery tag `own_tag`) came back after its
    worker died, is on its way in another message that waits on a fleet queue (every
    worker's, each tenant's of them (`tenant_names`), the router's and `queues`), in a
    worker's in-flight list, or is held unacknowledged. A
    router that died between handing a call on and acknowledging it leaves exactly that;
    routing it again would run it twice. Of two given-back copies (a host lost with the
    router and the GPU worker the call went to), the one whose delivery tag sorts first
    goes on (`seen.lua`), so exactly one does. Its tenant's public queue holds it under the
    task id its caller gave (`tenants.call_id`); no other tenant's is searched."""
    found = records(client)
    names = {*ROUTER_QUEUES, *queues} | {q for r in found.values() for q in r.queues}
    names = set(with_tenants(names, tenant_names))
    sent_id, tenant = owner(task_id)  # its public queue holds it as its caller sent it
    public = queue_of(tenant)

    def with_inflight(queue: str) -> list[str]:
        takers = [r.node for r in found.values() if queue in r.queues]
        return lists(queue) + [inflight(name, node) for node in takers for name in lists(queue)]

    keys = [UNACKED]
    for queue in sorted(q for q in names if not is_public(q)):
        keys += with_inflight(queue)
    args = [task_id, own_tag, sent_id, len(keys) + 1, public]  # KEYS is 1-based
    keys += with_inflight(public)
    return bool(scripts_for(client)("seen", keys, args))


def take_waiting(client: redis.Redis, queues: Iterable[str], sent: Mapping[str, str]) -> list[str]:
    """Take out every call waiting on `queues` or held unacknowledged or in flight by any
    worker, and return the fleet's ids of them, oldest first. `sent` names the lists that
    hold callers' messages as they sent them, each with its tenant (a public queue, a
    tenant's parked calls): their ids are named as a router names them
    (`tenants.call_id`). Only for a broker about to go away with its fleet (`gpufleet
    up`'s own Redis): the caller fails them, so that no caller waits on a result store
    that is gone."""
    ids: list[str] = []
    for _, raw in _unacked(client, None):
        record = _json(raw)
        if not isinstance(record, list) or len(record) < 3 or not isinstance(record[2], str):
            continue  # no message of a call
        task_id, queue = _task_id(record[0]), record[2]  # a public queue's: as its caller sent it
        public = is_public(queue) and bool(task_id)
        ids.append(call_id(task_id, tenant_of(queue) or DEFAULT) if public else task_id)
    client.delete(UNACKED, UNACKED_INDEX)
    for queue in queues:
        name = re.sub(r"([*?\[\]\\])", r"\\\1", queue)
        # its list, its priority lists, and theirs in flight (`lists`, `inflight`); no
        # other queue's whose name it begins (gpu1 and gpu10, a tenant's and team-2's)
        patterns = (name, f"{name}\x06\x16*", f"{name}.inflight.*")
        tenant = sent.get(queue)
        found_keys = {k for p in patterns for k in client.scan_iter(match=p, _type="list")}
        for key in sorted(found_keys):
            found = [_task_id(_json(raw)) for raw in reversed(client.lrange(key, 0, -1))]
            ids += found if tenant is None else [call_id(i, tenant) for i in found if i]
            client.delete(key)
    return [i for i in ids if i]


def _json(raw: str | bytes) -> Any:
    """`raw` read as JSON; None for anything else (whatever was pushed, it is taken out)."""
    try:
        return json.loads(raw)
    except ValueError:  # JSONDecodeError, and bytes that are no UTF-8
        return None


def _task_id(payload: Any) -> str:
    headers = payload.get("headers") if isinstance(payload, dict) else None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return task_id if isinstance(task_id, str) else ""


def _holds_anything(client: redis.Redis, rec: Record, orphaned: set[str]) -> bool:
    """Whether a dead worker still holds a call, or one waits on its `orphaned` queues."""
    if client.scard(unacked_of(rec.node)):
        return True
    pipe = client.pipeline(transaction=False)
    for queue in rec.queues:
        for name in lists(queue):
            pipe.llen(inflight(name, rec.node))
    for queue in orphaned:
        for name in lists(queue):
            pipe.llen(name)
    return any(pipe.execute())


def with_tenants(queues: Iterable[str], tenant_names: Iterable[str]) -> tuple[str, ...]:
    """`queues` and each tenant's queue of every GPU worker's among them
    (`placement.ledger.tenancy.tenants.worker_queue`): calls may wait there before the worker
    first took from it."""
    own = [q for q in queues]
    names = list(tenant_names)
    bases = [q for q in own if not is_routers(q) and split_queue(q)[1] == DEFAULT]
    more = {worker_queue(q, name) for q in bases for name in names}
    return tuple(dict.fromkeys([*own, *sorted(more)]))


@dataclass(frozen=True)
class _Move:
    """One message to give back: where it is, what it is, where it goes."""

    source: str | None  # a list; None: kombu's unacked hash, under `tag`
    tag: str
    old: str
    destination: str
    new: str  # "" drops it


#: A plan: the moves to make, from the broker and the record they are made against.
Plan = Callable[[redis.Redis, Record | None], list[_Move]]


def _redeliver(
    client: redis.Redis,
    node: str,
    record: dict[str, Any],
    plan: Plan,
    *,
    expect_dead: bool = False,
    rejoin: bool = False,
) -> int:
    """Run `plan` against `node`'s current record and carry it out with `record` as the
    new one, planning again while the record changes under it. Returns calls moved."""
    for _ in range(PLAN_ATTEMPTS):
        raw = client.hget(CONSUMERS, node)
        current = Record.parse(node, _text(raw)) if raw is not None else None
        if expect_dead and (current is None or current.alive(now_ms(client))):
            return 0  # it came back (or another sweep forgot it): its queue is its own
        moves = plan(client, current)
        if not moves and current is not None and current.gone_ms and record.get("gone"):
            return 0  # a dead worker's record, already marked, with nothing to move
        keys = KeyList(CONSUMERS, UNACKED, UNACKED_INDEX, unacked_of(node))
        payload = {
            "node": node,
            "expect": _text(raw) if raw is not None else "",
            "record": record,
            "rejoin": rejoin,
            "moves": [_as_json(m, keys) for m in moves],
        }
        reply = scripts_for(client)("redeliver", keys.names, [json.dumps(payload)])
        if reply[0] == 1:
            dropped = int(reply[2])
            if dropped:
                log.warning("dropped %d call(s) of %s whose answers were stored", dropped, node)
            return int(reply[1])
    log.warning("the record of %s kept changing; its calls are given back by a later sweep", node)
    return 0


def _marked_gone(client: redis.Redis, rec: Record) -> bool:
    """Whether `rec`'s run is now marked gone (a worker that renewed meanwhile is not)."""
    raw = client.hget(CONSUMERS, rec.node)
    if raw is None:
        return False
    now = Record.parse(rec.node, _text(raw))
    return now.token == rec.token and now.gone_ms > 0


def _release(release: Release, rec: Record) -> None:
    """End the request leases `rec`'s worker took, unless it stopped on its own (its pool
    finished what it took: each call is on its way with its lease); never fail a sweep
    or a start over it (the leases lapse at their deadlines)."""
    if not rec.token or rec.left:
        return
    try:
        ended = release(rec.token)
    except Exception:
        log.warning("could not end the request leases of %s", rec.node, exc_info=True)
        return
    if ended:
        log.warning("ended %d request lease(s) that %s took before it died", ended, rec.node)


def _nothing(_client: redis.Redis, _record: Record | None) -> list[_Move]:
    """The plan that moves nothing: only the record changes."""
    return []


def _as_json(move: _Move, keys: KeyList) -> dict[str, Any]:
    out: dict[str, Any] = {"old": move.old, "to": keys.add(move.destination), "new": move.new}
    if move.source is None:
        out["tag"] = move.tag
    else:
        out["from"] = keys.add(move.source)
    return out


def _holdings(
    client: redis.Redis,
    rec: Record | None,
    orphaned: AbstractSet[str] = frozenset(),
    answered: Callable[[str], bool] | None = None,
) -> list[_Move]:
    """The moves that give back what the record's worker held, oldest first: its
    unacknowledged messages, its in-flight ones, then (for `orphaned` queues, handed to
    the router) every call waiting there."""
    if rec is None:
        return []

    def move(source: str | None, tag: str, old: str, queue: str = "") -> _Move | None:
        """Give back `old`, a message of `queue` (for the unacked hash: its record's)."""
        try:
            if source is None:
                payload, _, queue = json.loads(old)
            else:
                payload = json.loads(old)
        except (ValueError, TypeError):
            payload = None
        if not isinstance(payload, dict):
            log.warning("cannot read a message %s held; left where it is", rec.node)
            return None
        if answered is not None and _answered(payload, answered, queue):
            return _Move(source, tag, old, queue, "")
        if queue in orphaned:
            payload = for_router(payload)
            queue = INTERNAL_QUEUE
        mark_redelivered(payload)  # the router reads it: tasks/api.py
        return _Move(source, tag, old, list_for(queue, payload), json.dumps(payload))

    found = [move(None, tag, old) for tag, old in _unacked(client, rec.node)]
    for queue in rec.queues:
        for name in lists(queue):
            held = inflight(name, rec.node)
            found += [move(held, "", _text(m), queue) for m in reversed(client.lrange(held, 0, -1))]
    for queue in sorted(orphaned):
        for name in lists(queue):
            found += [move(name, "", _text(m), queue) for m in reversed(client.lrange(name, 0, -1))]
    return [m for m in found if m is not None]


def _unacked(client: redis.Redis, node: str | None) -> Iterator[tuple[str, str]]:
    """(delivery tag, kombu's unacked record) of what `node` holds (None: every worker),
    oldest first."""
    if node is None:
        tags = sorted(_text(t) for t in client.hkeys(UNACKED))
    else:
        tags = sorted(_text(t) for t in client.smembers(unacked_of(node)))
    if not tags:
        return
    raws = client.hmget(UNACKED, tags)
    scores = client.zmscore(UNACKED_INDEX, tags)
    held = sorted(
        (score or 0.0, tag, _text(raw))
        for tag, raw, score in zip(tags, raws, scores, strict=True)
        if raw is not None
    )
    for _, tag, raw in held:
        yield tag, raw


def _answered(payload: dict[str, Any], answered: Callable[[str], bool], queue: str) -> bool:
    """Whether the call of `payload`, a message of `queue`, is answered: a public queue's
    message says the task id its caller gave, which names the call by its tenant."""
    task_id = (payload.get("headers") or {}).get("id")
    if isinstance(task_id, str) and is_public(queue):
        task_id = call_id(task_id, tenant_of(queue) or DEFAULT)
    return isinstance(task_id, str) and answered(task_id)


def for_router(payload: dict[str, Any]) -> dict[str, Any]:
    """A message bound for a GPU worker, as a `gpufleet.infer` call for the router with
    the same task id, so its caller's AsyncResult still yields the answer.

    A `gpufleet.run` (a call the router handed on) becomes the `infer` it came from,
    keeping its re-route count; a fast-path `infer` loses its request lease, which the
    ledger released with the dead worker. Anything else only changes queue."""
    headers = payload.setdefault("headers", {})
    properties = payload.setdefault("properties", {})
    if headers.get("task") == RUN and properties.get("body_encoding") == "base64":
        try:
            args, _kwargs, embed = json.loads(base64.b64decode(payload["body"]))
            call = args[0]
            infer_args = [call["model"], call["inputs"], call.get("params")]
            hops = int(call.get("hops", 0))
        except (ValueError, TypeError, KeyError, IndexError):
            pass  # the router's consumer answers what it cannot read
        else:
            body = json.dumps([infer_args, {}, embed]).encode()
            payload["body"] = base64.b64encode(body).decode()
            headers.update(task=INFER, argsrepr=repr(infer_args)[:1024])
            headers[HOPS_HEADER] = hops
    headers.pop(LEASE_HEADER, None)
    properties["delivery_info"] = {"exchange": "", "routing_key": INTERNAL_QUEUE}
    return payload


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _This:
    """This process's record, when it is a gpufleet Celery worker."""

    presence: Presence | None = None


_this = _This()


@worker_init.connect
def _arrive(sender: Any, **_: Any) -> None:
    """A worker records itself, after putting back what a predecessor of its node name
    held, before it consumes anything (after `tasks.broker.claim`'s claim: another fleet's
    worker must not touch this broker's calls)."""
    settings = context.settings()
    client = endpoint.connect(settings.broker_url, socket_timeout=10, socket_connect_timeout=10)
    queues = list(sender.app.amqp.queues.consume_from or ())
    presence = Presence(client, sender.hostname, settings.role, queues, settings.worker_lease_ms)
    release: Release | None = None
    try:
        registry = context.registry()
        registry.taker = presence.token  # its pool's children, forked after this, take it too
        release = registry.end_leases_of
    except Exception:  # its leases then name no taker: they lapse at their deadlines
        log.warning("no registry for %s's request leases", presence.node, exc_info=True)
    try:
        presence.arrive(release)
    except redis.RedisError as exc:
        log.warning("could not record %s in the broker yet (%s); renewing will", presence.node, exc)
    presence.keep()
    _this.presence = presence


def consuming(queues: Iterable[str]) -> None:
    """This worker now consumes `queues`: its record says so (`Presence.consume`)."""
    if _this.presence is not None:
        _this.presence.consume(queues)


def waiting(queue: str) -> int | None:
    """How many messages wait on `queue`, through this worker's broker client; None
    before the worker recorded itself."""
    return depth(_this.presence.client, queue) if _this.presence is not None else None


@worker_shutdown.connect
def _leave(**_: Any) -> None:
    if _this.presence is not None:
        _this.presence.leave()
