"""Kombu's Redis transport, without its windows for losing a message when Redis or a
worker dies.

Kombu takes a message with BRPOP and records it as unacknowledged in a second round
trip. Two gaps lie between, and a Redis crash (SIGKILL, the OOM killer) in either loses
the message, which is then in neither place:

- the unacked record fails: only the consumer holds the message, and drops it as it
  reconnects. Here it puts the message back at the head of its queue once Redis answers
  again (`QoS.append`);
- the BRPOP reply arrives when the consumer has no prefetch credit left (Celery lowers
  the prefetch count as countdown tasks run): kombu leaves the reply unread in the
  socket until credit returns, and a reconnect throws it away. Here the reply is read at
  once, one message past the prefetch count, and recorded as unacked (`Poller`).

So a broker crash costs a redelivery, never a call. Every gpufleet process uses this
transport (`broker_transport` in `tasks.config`); clients need nothing.

The consumer dying between the two steps (SIGKILL, the OOM killer) loses the message
the same way, and a busy consumer widens that window: Redis pops the message as soon as
it arrives, while the reply may wait in the socket until the process reads it. So every
gpufleet worker takes through in-flight lists instead (transport option
`consumer_name`, its Celery node name, set as the worker starts):
- while messages wait, `placement/ledger/lua/take.lua` moves the first one, in BRPOP's order
  (each queue by priority), into that list's in-flight list for this consumer,
  `<list>.inflight.<node name>`, and returns it;
- when none waits, BLMOVE blocks on one list (Redis 6.2 or later: the first; with
  several tenants' queues, the one it last took from) for at most `IDLE_POLL_S`
  (`IDLE_POLL_MANY_S` with several tenants), then the script looks at every list again,
  so a message in another list waits at most that long on an idle worker (with several
  tenants' queues, a message pushed onto another list is taken at once where Redis
  publishes list events, beside the wait: `tasks.broker.waking`; such a consumer, which
  would hear a push onto any other list, waits again at once after its wait hands it a
  message, without the script's look first, unless its last look is `IDLE_POLL_MANY_S`
  old);
- recording the message as unacked removes it from the in-flight list in the same step
  (`QoS.append`);
- a consumer that starts on a queue puts back what its predecessor of the same node name
  left in flight, first in line, and every message recorded as unacknowledged under its
  name that its process neither holds in an open channel, nor runs, nor acknowledged
  while Redis was away (`Channel.basic_consume`: a reconnect after a Redis restart or a
  failover, docs/deploy.md "Redis Sentinel").

A worker that never starts again under its node name (a lost host, a container
replaced under a new hostname) has what it held, in flight or unacknowledged, given back
by a router's sweep once its record lapses (`tasks.broker.presence`).
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from queue import Empty
from typing import Any

import redis
import redis.sentinel
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from placement.ledger import endpoint, scripts
from placement.ledger.hot import Handover
from placement.ledger.keys import unacked_of
from placement.ledger.scripts import scripts_for
from placement.rules.fairness import FairTurns
from tasks.broker import intake, quarantine, waking

#: How long a consumer waits for Redis to come back to give a message back.
GIVE_BACK_S = 30.0
#: The longest an idle consumer blocks on its first list before looking at the others.
IDLE_POLL_S = 0.25
#: The same for a consumer of several tenants' queues, which blocks on the list it last
#: took from: how long a call of another tenant may wait on an idle worker. Costs an idle
#: consumer one take script per period.
IDLE_POLL_MANY_S = 0.05
#: How long a consumer waits after Redis refused a take (a full Redis) before the next.
REFUSED_TAKE_WAIT_S = 0.5
#: How often a consumer looks in its own in-flight lists between two takes
#: (`Channel._put_back_strays`): the longest a take whose reply was lost strands its call.
STRAY_CHECK_S = 5.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Onward:
    """Where a consumer sends a message it takes instead of keeping it (`Channel.divert`):
    the queue, the message's new headers, and what undoes the decision if the move fails."""

    queue: str
    headers: dict[str, Any]
    undo: Callable[[], None]


@dataclass(frozen=True)
class Pick:
    """A divert whose queue is picked by the step that moves the message
    (`placement.ledger.hot.HotPath.forward`): the message's new headers, but for `header`,
    whose value that step writes, and the step itself. `move` pushes the message a
    `Handover` describes and says None (nowhere to go, nothing changed: keep it), or that
    the message is not ours now (moved out of the in-flight list, or given back by a
    sweep) and whether the lists the consumer takes from were all empty then (True: its
    next take blocks at once, `Handover.watched`)."""

    headers: dict[str, Any]
    header: str
    move: Callable[[Handover], bool | None]
    tenant: str = ""  # whose call: it goes to its tenant's queue of the worker (`Handover`)
    tenants: tuple[str, ...] = ()  # every tenant whose queue of a worker may hold calls


class Moved:
    """A divert that moved the message itself, out of the in-flight list it was taken into
    (a tenant's call parked until one of its running slots frees:
    `placement.ledger.tenancy.quotas`): counted delivered and acknowledged, as a message
    moved on is."""


MOVED = Moved()


class QoS(kombu_redis.QoS):
    """Unacknowledged-message bookkeeping that gives back what it could not record, and
    that says which worker holds each message (`placement.ledger.keys.unacked_of`), so a dead
    one's messages go back without waiting for the visibility timeout (tasks/broker/presence.py).
    A message its channel diverts is moved on instead, never recorded."""

    def append(self, message: Any, delivery_tag: str) -> None:
        channel = self.channel
        diverting = channel.divert is not None and channel.taken is not None
        if diverting and self._diverted(message, delivery_tag):
            return
        taken, channel.taken = channel.taken, None
        info = message.delivery_info
        routing_key = info["routing_key"]
        sent = intake.as_sent(message._raw, routing_key)  # what a restore pushes back
        record = dumps([sent, info["exchange"], routing_key])  # type: ignore[no-untyped-call]
        holder = channel.consumer_name
        try:
            with self.pipe_or_acquire() as pipe:
                pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()})
                pipe.hset(self.unacked_key, delivery_tag, record)
                if holder:
                    pipe.sadd(unacked_of(holder), delivery_tag)
                if taken is not None:  # recorded: out of the in-flight list in the same step
                    pipe.lrem(taken[0], 1, taken[1])
                done = pipe.execute()
            if taken is not None and not done[-1]:
                # No longer in flight: a sweep gave it back to its queue while this process
                # was stopped between the take and the record, so it is not ours to run
                # (as move.lua and forward.lua say of it): the copy there goes on.
                log.warning("message %s was given back before it was recorded; not run here",
                            delivery_tag)  # fmt: skip
                virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]
                self.ack(delivery_tag)  # its record goes, or later if Redis cannot take it now
                message._state = "ACK"
                return
        except channel.connection_errors:
            if taken is None:  # a taken message waits in the in-flight list instead
                give_back(channel, message)
            raise  # the consumer reconnects, and puts back what is in flight
        except ResponseError as exc:  # Redis refused the record (its memory cap reached)
            if taken is None:
                raise
            # Still in flight: reconnect, which puts it back first in line once Redis takes
            # writes again, rather than hold it here unrecorded.
            raise RedisConnectionError(f"could not record a taken call: {exc}") from exc
        virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]

    def _diverted(self, message: Any, delivery_tag: str) -> bool:
        """Whether the channel's `divert` sent `message` on (see `_move` and `_pick`); a
        divert that fails keeps the message, as if it had said no."""
        try:
            onward = self.channel.divert(message)
        except Exception:
            log.exception("could not tell where message %s goes; keeping it", delivery_tag)
            return False
        if isinstance(onward, Pick):
            return self._pick(message, delivery_tag, onward)
        if isinstance(onward, Moved):
            self._gone(message, delivery_tag)
            return True
        return onward is not None and self._move(message, delivery_tag, onward)

    def _pick(self, message: Any, delivery_tag: str, pick: Pick) -> bool:
        """Hand `message`, taken into an in-flight list, to `pick.move`, which chooses its
        queue and moves it there in one step; count it delivered and acknowledged unless
        it stays. A move that raised is looked for in the in-flight list: there, it stays;
        gone, it moved (or a sweep gave it back); when Redis cannot say, the consumer
        reconnects, which puts back what is in flight."""
        channel = self.channel
        inflight, taken = channel.taken
        mark = uuid.uuid4().hex
        lease, queue = f"gpufleet-lease-{mark}", f"gpufleet-queue-{mark}"  # placeholders
        try:
            payload, priority = self._onward(message, {**pick.headers, pick.header: lease}, queue)
            text = intake.dump(payload, taken)
            head, rest = text.split(f'"{lease}"')  # a ValueError unless each is there once:
            middle, tail = rest.split(f'"{queue}"')  # headers come before properties
            handover = Handover(
                inflight,
                taken,
                (head, middle, tail),
                channel._q_for_pri("", priority),
                tuple(channel._taken_from()),
                pick.tenant,
                pick.tenants,
                tuple(channel._q_for_pri("", p) for p in channel.priority_steps),
            )
        except Exception:
            log.exception("could not prepare message %s to move on; keeping it", delivery_tag)
            return False
        try:
            moved = pick.move(handover)
        except Exception as exc:
            moved = self._after_failed_move(inflight, taken, delivery_tag, exc)
        if moved is None:
            return False
        self._gone(message, delivery_tag)
        channel._idle = moved  # nothing else waits: block for the next call (`_brpop_start`)
        if moved:  # the script looked at every list of the channel's (`_brpop_read`)
            channel._looked_at = time.monotonic()
        return True

    def _gone(self, message: Any, delivery_tag: str) -> None:
        """Count `message`, moved out of its in-flight list, delivered and acknowledged."""
        self.channel.taken = None
        virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]
        message._state = "ACK"

    def _after_failed_move(
        self, inflight: str, taken: bytes, delivery_tag: str, exc: Exception
    ) -> bool | None:
        """`Pick.move`'s answer for a move that raised `exc`: None while the message is
        still in flight (it stays), False once it is not (moved in one step, or given back
        by a sweep: not ours either way); a connection error when Redis cannot say."""
        try:
            still = self._in_flight(inflight, taken)
        except Exception as lost:
            raise RedisConnectionError(
                f"could not tell whether message {delivery_tag} moved on ({exc}): {lost}"
            ) from exc
        if still:
            log.warning("could not move message %s on (%s); keeping it", delivery_tag, exc)
            return None
        return False

    def _onward(
        self, message: Any, headers: dict[str, Any], queue: str
    ) -> tuple[dict[str, Any], int]:
        """`message`'s payload with `headers`, routed to `queue` under a new delivery tag
        (its headers before its properties), and its priority. The copy moved on is a
        hand-off, not a message given back: it carries no such mark, so that a given-back
        twin of its call yields to it whatever its new tag (seen.lua)."""
        channel = self.channel
        raw = message._raw
        payload = {k: v for k, v in raw.items() if k not in ("headers", "properties")}
        payload["headers"] = {k: v for k, v in headers.items() if k != "redelivered"}
        properties = payload["properties"] = dict(raw["properties"])
        properties["delivery_info"] = {"exchange": "", "routing_key": queue}
        properties["delivery_tag"] = channel._next_delivery_tag()
        return payload, channel._get_message_priority(payload, False)

    def _move(self, message: Any, delivery_tag: str, onward: Onward) -> bool:
        """Publish `message`, taken into an in-flight list, with `onward`'s headers to its
        queue, out of the in-flight list in the same step (`move.lua`), and count it
        delivered and acknowledged at once. A move that did not happen ends what `onward`
        began: on a lost connection the message waits in flight, which the reconnecting
        consumer puts back first in line; on any other error it is kept (False)."""
        channel = self.channel
        inflight, taken = channel.taken
        try:
            payload, priority = self._onward(message, onward.headers, onward.queue)
            message_json = intake.dump(payload, taken)
            moved = scripts_for(channel._create_client())(
                "move",
                [channel._q_for_pri(onward.queue, priority), inflight],
                [message_json, taken],
            )
        except channel.connection_errors:
            if self._still_in_flight(inflight, taken):  # else the move ran: keep its lease
                _undo(onward)
            raise
        except Exception:
            _undo(onward)
            log.exception("could not move message %s on; keeping it", delivery_tag)
            return False
        channel.taken = None
        if not moved:  # gone from the in-flight list (a sweep gave it back): not ours now
            _undo(onward)
        virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]
        message._state = "ACK"
        return True

    def _still_in_flight(self, inflight: str, taken: bytes) -> bool:
        """Whether a move whose reply was lost did not happen; False when Redis cannot say
        (the lease then lapses at its deadline rather than leave a moved call unpinned)."""
        try:
            return self._in_flight(inflight, taken)
        except Exception:
            return False

    def _in_flight(self, inflight: str, taken: bytes) -> bool:
        """Whether message `taken` is still in list `inflight` (raises when Redis cannot say)."""
        return self.channel._create_client().lpos(inflight, taken) is not None

    def ack(self, delivery_tag: str) -> None:
        """kombu's; an acknowledgement Redis could not take (its channel closed as Redis
        went away, or the write failed: a failover, a restart) is kept for this
        consumer's next channel (`_settle_later`), which drops the message's record rather
        than give it back: it ran here."""
        channel = self.channel
        if not channel.consumer_name:
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]
            return
        if not channel.closed:
            try:
                super().ack(delivery_tag)  # type: ignore[no-untyped-call]
                return
            except channel.connection_errors:
                log.warning("Redis did not take acknowledgement %s; it is kept", delivery_tag)
        _settle_later(channel, delivery_tag, requeue=False)
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        """kombu's, kept for later as `ack` is when Redis cannot take it (a call whose
        child died, given back after a failover, would otherwise stay recorded)."""
        channel = self.channel
        if not channel.consumer_name:
            super().reject(delivery_tag, requeue)  # type: ignore[no-untyped-call]
            return
        if not channel.closed:
            try:
                super().reject(delivery_tag, requeue)  # type: ignore[no-untyped-call]
                return
            except channel.connection_errors:
                log.warning("Redis did not take rejection %s; it is kept", delivery_tag)
        _settle_later(channel, delivery_tag, requeue=requeue)
        virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]

    def restore_unacked(self, client: Any = None) -> Any:
        """kombu's give-back as its channel closes, less the messages this process still
        runs (`Channel.running`): their acknowledgements drop their records (`ack`)."""
        for tag in self.channel.running_tags() & set(self._delivered):
            del self._delivered[tag]
        return super().restore_unacked(client)  # type: ignore[no-untyped-call]

    def ack_all(self, messages: list[Any]) -> None:
        """Acknowledge `messages` in one round trip, each as `ack` would (a router settles
        the cancels it took together: `tasks.serving.cancelling`)."""
        self.drop_records([message.delivery_tag for message in messages])
        for message in messages:
            virtual.QoS.ack(self, message.delivery_tag)  # type: ignore[no-untyped-call]
            message._state = "ACK"

    def drop_records(self, tags: Iterable[str]) -> None:
        """Remove the unacknowledged records of `tags` in one round trip, as their
        acknowledgements would."""
        with self.pipe_or_acquire() as pipe:
            for tag in tags:
                self._remove_from_indices(tag, pipe)
            pipe.execute()

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        with self.pipe_or_acquire(pipe) as batch:
            batch.zrem(self.unacked_index_key, delivery_tag).hdel(self.unacked_key, delivery_tag)
            if self.channel.consumer_name:
                batch.srem(unacked_of(self.channel.consumer_name), delivery_tag)
            return batch


#: The channels of this process that may still consume (`Channel._give_back_unheld`).
_open_channels: weakref.WeakSet[Channel] = weakref.WeakSet()
#: Per consumer name, the acknowledgements (False) and rejections with requeue (True)
#: Redis could not take, by delivery tag (`QoS.ack`, `QoS.reject`).
_due: dict[str, dict[str, bool]] = {}


def _settle_later(failed: Channel, delivery_tag: str, *, requeue: bool) -> None:
    """Settle `delivery_tag` (drop its record, or with `requeue` give it back), which
    Redis could not take on channel `failed`, through another open channel of its
    consumer; while none can (Redis still away), keep it for the next channel's start
    (`Channel._give_back_unheld`)."""
    consumer = failed.consumer_name
    assert consumer is not None
    pending = _due.setdefault(consumer, {})
    pending[delivery_tag] = requeue
    for channel in list(_open_channels):
        if channel is failed or channel.consumer_name != consumer:
            continue
        if channel.closed or not channel._consumers:
            continue
        try:
            channel.settle(pending)
        except channel.connection_errors:
            return  # still due: the next channel's start settles it
        pending.clear()
        return


def _undo(onward: Onward) -> None:
    """End what a divert began for a message that did not move; never fail the consumer."""
    try:
        onward.undo()
    except Exception:
        log.warning("could not undo the divert of a message; it lapses", exc_info=True)


def give_back(channel: Any, message: Any) -> bool:
    """Put `message` back at the head of its queue, waiting up to `GIVE_BACK_S` for Redis;
    False (logged) when Redis did not come back in time."""
    info = message.delivery_info
    deadline = time.monotonic() + GIVE_BACK_S
    delay = 0.1
    while True:
        try:
            with channel.conn_or_acquire() as client, client.pipeline() as pipe:
                # BRPOP takes from the right: rpush puts it first in line again
                sent = intake.as_sent(message._raw, info["routing_key"])
                channel._do_restore_message(
                    sent, info["exchange"], info["routing_key"], pipe, leftmost=False
                )
                pipe.execute()
        except channel.connection_errors as exc:
            if time.monotonic() + delay > deadline:
                log.error(
                    "message %s, taken as Redis died, is lost: Redis was not back in %.0f s (%s)",
                    message.delivery_tag,
                    GIVE_BACK_S,
                    exc,
                )
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        log.warning("gave back message %s taken as Redis died", message.delivery_tag)
        return True


def _given_back(client: Any, inflight: str, key: str) -> int:
    """Move every message of list `inflight` to the head of list `key` (BRPOP takes from
    the right), oldest first in line, in one transaction; how many. Each is marked
    delivered again, as kombu marks what it restores: a take whose reply was lost may have
    reached its worker all the same, and run there (its record was what failed), so its
    worker's consumer looks for its answer before running it again
    (`tasks.serving.consumer`), as the pool child does once more as it starts
    (`tasks.serving.batch_jobs.ran_before`). Moved unmarked, such a call ran twice, 5 s
    apart, in a 20 s stop of the primary."""
    with client.pipeline() as pipe:
        while True:
            try:
                pipe.watch(inflight)
                taken = pipe.lrange(inflight, 0, -1)
                if not taken:
                    return 0
                pipe.multi()
                for raw in taken:
                    pipe.rpush(key, _marked_again(raw))
                pipe.delete(inflight)
                pipe.execute()
                return len(taken)
            except redis.WatchError:  # the list changed meanwhile: read it again
                continue


def _marked_again(raw: bytes) -> Any:
    """A message's payload marked delivered again (as it is, if it is no JSON message)."""
    try:
        payload = loads(bytes_to_str(raw))  # type: ignore[no-untyped-call]
    except (ValueError, TypeError):
        return raw
    if not isinstance(payload, dict):
        return raw
    intake.mark_redelivered(payload)
    return dumps(payload)  # type: ignore[no-untyped-call]


def repair_queue_keys(client: Any, keys: list[str]) -> list[str]:
    """Delete those of `keys` (a queue's lists) that hold something other than a list, and
    return them. On Redis 6.2 a caller's user, which may SADD to declare the queue `celery`,
    can also SADD to `celery` itself while it is empty (placement.server.acl): every take and send
    would then fail with WRONGTYPE. No call is lost: a call is only ever a list's item."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.type(key)
    kinds = [bytes_to_str(kind) for kind in pipe.execute()]  # type: ignore[no-untyped-call]
    broken = [key for key, kind in zip(keys, kinds, strict=True) if kind not in ("list", "none")]
    for key in broken:
        client.delete(key)
        log.error("queue key %r held a %s, not a list: deleted it", key, kinds[keys.index(key)])
    return broken


def inflight(key: str, consumer: str) -> str:
    """The list `consumer`'s messages from list `key` pass through between taken and
    recorded."""
    return f"{key}.inflight.{consumer}"


class Channel(kombu_redis.Channel):
    """kombu's Redis channel; with the transport option `consumer_name` (every gpufleet
    worker), a consumer takes its messages through in-flight lists."""

    QoS = QoS
    from_transport_options = (*kombu_redis.Channel.from_transport_options, "consumer_name")  # type: ignore[assignment]
    consumer_name: str | None = None
    taken: tuple[str, bytes] | None = None  # (in-flight list, message) not yet recorded
    _taking: tuple[str, list[str]] | None = None  # the take in flight: its kind, its lists
    _idle = False  # the last take found every list empty: block next
    _ears: waking.Ears | None = None  # hears pushes onto several tenants' lists
    _ears_failed = False  # Redis refused them: not tried again on this channel
    _ears_retry_at = 0.0  # after a lost connection, not opened again before this
    _ears_missed = False  # the last try to open them failed (warned once)
    _pushed = False  # the ears heard a push since the last take was sent: do not block
    _looked_at = 0.0  # when a take last found every list empty (time.monotonic())
    _last_list = ""  # the list it last took a message from (an idle take blocks there)
    _sync_client: Any = None  # see `_create_client`
    _refused_take_logged = 0.0  # when a refused take was last logged (`_refused_take`)
    #: Leave a server that is no longer the primary (`endpoint.ServerConnection`): at an
    #: address that moves to a promoted replica, the next connection reaches it.
    connection_class: Any = endpoint.ServerConnection
    connection_class_ssl: Any = endpoint.TlsServerConnection
    _strays_checked = 0.0  # when its in-flight lists were last looked in (`_put_back_strays`)
    #: Asked of each message this channel takes, before it is recorded as unacknowledged:
    #: where to send it on instead, or None (a router's hot calls: tasks/serving/forwarding.py).
    divert: Callable[[Any], Onward | Pick | Moved | None] | None = None
    #: Answers a message this channel refuses as it takes it (`tasks.broker.intake.envelope`):
    #: the consumer stores its error as the call's result.
    refuse: Callable[[intake.Refused], None] | None = None
    #: The delivery tags of the messages this process runs now (`running_tags`): never
    #: given back by it, since their acknowledgements settle them (`QoS.ack`).
    running: Callable[[], set[str]] | None = None

    def take_turns(
        self, tenant_of: Callable[[str], str], weight_of: Callable[[str], float]
    ) -> None:
        """Take from this channel's queues in turns by the weights of their tenants
        (`placement.rules.fairness.FairTurns`), rather than kombu's round-robin cycle,
        which queues of one tenant keep."""
        turns = FairTurns(tenant_of, weight_of)
        turns.update(self._queue_cycle.items)
        self._queue_cycle = turns

    def _create_client(self, asynchronous: bool = False) -> Any:
        """Kombu builds a new Redis client, about 0.2 ms of CPU, for every publish, ack and
        delivery. The synchronous one is built once per connection pool here: it takes a
        connection from the pool for each command, so it is as safe to share as the pool."""
        built = self._async_pool if asynchronous else self._pool
        if built is None and getattr(self.connection, "client", None) is None:
            # Celery collected the connection after Redis went away, then closes this
            # channel, whose close restores its unacked messages: with no connection to
            # build a pool from, kombu's `_connparams` raised AttributeError, out of Celery's
            # connection-error handler, and the worker died (issue 43). A connection error
            # is what this is; the messages stay recorded in Redis, and a consumer's sweep
            # puts them back (`tasks.broker.presence`).
            raise RedisConnectionError("the broker connection is closed")
        if asynchronous:
            return super()._create_client(asynchronous=True)  # type: ignore[no-untyped-call]
        pool = self.pool
        client = self._sync_client
        if client is None or client.connection_pool is not pool:
            client = self._sync_client = super()._create_client()  # type: ignore[no-untyped-call]
        return client

    def _size(self, queue: str) -> int:
        """kombu's count of `queue`'s messages (its declaration asks for it), after
        repairing its keys when a caller broke one (`repair_queue_keys`)."""
        try:
            return int(super()._size(queue))  # type: ignore[no-untyped-call]
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            repair_queue_keys(self._create_client(), self._lists([queue]))
            return int(super()._size(queue))  # type: ignore[no-untyped-call]

    @property
    def _takes_in_flight(self) -> bool:
        # kombu prefixes only the commands it sends itself: the script, BLMOVE, LMOVE and
        # LREM would miss a `global_keyprefix`, so such a channel keeps BRPOP.
        return bool(self.consumer_name and not self.global_keyprefix)

    def _take(self, item: bytes, queue: str) -> None:
        """Hand `item`, taken from `queue`, to the consumer, or refuse it: a message that
        fails `tasks.broker.intake.envelope`, or whose delivery raises before it is recorded, is
        answered through `refuse` and left for `_brpop_read` to drop. Nothing a message
        holds may stop the consumer (`tasks.broker.intake`)."""
        if self.connection is None:  # closed meanwhile: it stays in flight, to be put back
            raise RedisConnectionError("the channel closed before it could hand on a message")
        try:
            payload = intake.envelope(item, queue)
        except intake.Refused as exc:
            self._refused(exc)
            return
        task_id = payload["headers"].get("id")
        if quarantine.holds(task_id):  # it stopped its worker twice
            quarantine.put_aside(item, task_id)
            self._refused(intake.Refused(quarantine.QUARANTINED, task_id))
            return
        try:
            with quarantine.in_hand([task_id] if task_id else []):
                self.connection._deliver(payload, queue)
        except self.connection_errors:
            raise
        except Exception as exc:
            if self.taken is None:  # recorded: it goes back when this worker starts again
                log.exception("could not deliver a message taken from %s", queue)
                return
            why = f"gpufleet could not take this call ({type(exc).__name__})"
            log.warning("refused a message taken from %s: %s", queue, why, exc_info=True)
            self._refused(intake.Refused(why, task_id))

    def _refused_take(self, exc: Exception) -> None:
        """Redis refused a take (its memory cap reached, a key of another type it could not
        repair): say so at most every 10 s, and wait a little before taking again, rather
        than stop the worker. No message moved: `take.lua` moves in one step."""
        now = time.monotonic()
        if now - self._refused_take_logged > 10.0:
            self._refused_take_logged = now
            log.error("Redis refused to hand this worker its next call (%s); trying again", exc)
        time.sleep(REFUSED_TAKE_WAIT_S)

    def _refused(self, refusal: intake.Refused) -> None:
        if self.refuse is None:
            log.warning("dropped a message: %s", refusal.why)
            return
        try:
            self.refuse(refusal)
        except self.connection_errors:
            raise
        except Exception:
            log.exception("could not answer a refused call; dropping it")

    def _inflight(self, key: str) -> str:
        assert self.consumer_name is not None
        return inflight(key, self.consumer_name)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        _open_channels.add(self)

    def running_tags(self) -> set[str]:
        """The delivery tags of the messages this process runs now, whichever channel
        delivered them (`running`, which the worker's consumer sets)."""
        return self.running() if self.running is not None else set()

    def settle(self, due: dict[str, bool]) -> None:
        """What other channels of this consumer could not: drop the records of the tags
        `due` maps to False (acknowledged), give back those it maps to True (rejected
        with requeue), as kombu's reject does."""
        self.qos.drop_records(tag for tag, requeue in due.items() if not requeue)
        for tag in [tag for tag, requeue in due.items() if requeue]:
            self.qos.restore_by_tag(tag, leftmost=True)

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        if self._takes_in_flight and queue not in self._fanout_queues:
            self._put_back_in_flight(queue)
            self._give_back_unheld()
            self._looked_at = 0.0  # no look covered this queue yet (`_brpop_read`)
        return super().basic_consume(queue, *args, **kwargs)  # type: ignore[no-untyped-call]

    def _give_back_unheld(self) -> None:
        """Put back, first in line, every message recorded as unacknowledged by this
        consumer that this process neither holds (in an open channel), nor runs, nor
        acknowledged: a channel that closed as Redis went away could not give back what
        it held (kombu restores it on close), and after a failover the new primary may lack
        the last acknowledgements, whose messages nobody holds any more (docs/deploy.md,
        "Redis Sentinel"). What this process acknowledged while Redis was away has its
        record dropped here; what it still runs stays recorded until it is acknowledged."""
        assert self.consumer_name is not None
        due = _due.pop(self.consumer_name, {})
        acked = {tag for tag, requeue in due.items() if not requeue}
        try:
            with self.conn_or_acquire() as client:
                tags = client.smembers(unacked_of(self.consumer_name))
            recorded = {bytes_to_str(t) for t in tags}  # type: ignore[no-untyped-call]
            if recorded & acked:
                self.qos.drop_records(recorded & acked)
        except self.connection_errors:
            _due.setdefault(self.consumer_name, {}).update(due)
            raise
        held = self.running_tags() | {
            tag
            for channel in list(_open_channels)
            if channel.consumer_name == self.consumer_name and not channel.closed
            for tag in channel.qos._delivered
        }
        lost = sorted(recorded - held - acked)
        for tag in lost:
            self.qos.restore_by_tag(tag)
        if lost:
            log.warning("put back %d message(s) recorded as held here but not held", len(lost))

    def _put_back_strays(self, keys: list[str]) -> None:
        """Between two takes this consumer's in-flight lists are empty: each message it
        takes is recorded, moved on or dropped, out of its list in the same step, before
        the next take. One found there is a take whose reply never arrived (its connection
        dropped as a failover or a stopped primary's return went on, and a server kept the
        move): put back first in line. One LLEN per list, every `STRAY_CHECK_S`."""
        now = time.monotonic()
        if now - self._strays_checked < STRAY_CHECK_S:
            return
        self._strays_checked = now
        client = self._create_client()
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.llen(self._inflight(key))
            counts = pipe.execute()
        stranded = {key.rsplit(self.sep, 1)[0] for key, n in zip(keys, counts, strict=True) if n}
        for queue in sorted(stranded):
            self._put_back_in_flight(queue)

    def _put_back_in_flight(self, queue: str) -> None:
        """Return to the head of `queue`'s lists what this consumer's predecessor took and
        did not record (it died in between), or a take of its own left (`_put_back_strays`),
        oldest first in line, each marked delivered again (`_given_back`)."""
        restored = 0
        with self.conn_or_acquire() as client:
            for key in self._lists([queue]):
                try:
                    restored += _given_back(client, self._inflight(key), key)
                except ResponseError as exc:  # a full Redis: they stay in flight, safe
                    log.error("could not put back what %s left in flight (%s)", key, exc)
        if restored:
            log.warning("put back %d message(s) taken from %s and never recorded", restored, queue)

    def _lists(self, queues: list[str]) -> list[str]:
        """The lists BRPOP would take from for `queues`, in its order."""
        return [self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]  # type: ignore[no-untyped-call]

    def _taken_from(self) -> list[str]:
        """The lists this channel's next take reads, in order (none: it consumes nothing)."""
        return self._lists(self._queue_cycle.consume(len(self.active_queues)))

    def _ears_of(self, keys: list[str]) -> None:
        """Hear pushes onto `keys` and no others (`waking.Ears`, opened on first use; not
        again for `waking.RETRY_S` after a lost connection, nor ever after Redis refused
        them)."""
        if self._ears is None:
            if self._ears_failed or time.monotonic() < self._ears_retry_at:
                return
            try:
                db = int(self.pool.connection_kwargs.get("db") or 0)
                self._ears = waking.Ears(self.pool, db, self._unhear)
            except Exception as exc:  # none: calls on other lists wait for the next look
                say = log.debug if self._ears_missed else log.warning  # once, not each try
                say("could not listen for calls on other lists (%s); trying again", exc)
                self._ears_missed = True
                self._ears_retry_at = time.monotonic() + waking.RETRY_S
                return
            self._ears_missed = False
        try:
            self._ears.watch(keys)
        except redis.RedisError as exc:
            self._lost_ears(exc)

    def _lost_ears(self, exc: Exception) -> None:
        """Close the ears after `exc`: open them again later, or never if Redis refused."""
        if isinstance(exc, ResponseError):  # no rights to the events, SUBSCRIBE renamed...
            log.warning("Redis refused the keyspace events (%s); looking every %.0f ms "
                        "instead", exc, IDLE_POLL_MANY_S * 1000)  # fmt: skip
            self._ears_failed = True
        else:
            log.debug("lost the keyspace events (%s); listening again", exc)
            self._ears_retry_at = time.monotonic() + waking.RETRY_S
        self._close_ears()

    def _close_ears(self) -> None:
        ears, self._ears = self._ears, None
        if ears is not None:
            try:
                ears.close()  # `_unhear` first
            except Exception as exc:  # a connection already gone: nothing to close
                log.debug("closing the keyspace events: %s", exc)

    def _unhear(self, sock: Any) -> None:
        """The ears' socket is about to close: the poller lets go of it now, while it is
        open (`waking._told_before_closing`)."""
        cycle = getattr(self.connection, "cycle", None)
        if cycle is None:
            return
        for ident, registered in list(cycle._chan_to_sock.items()):
            if ident[0] is self and ident[2] == HEARD and registered is sock:
                del cycle._chan_to_sock[ident]
                fd = sock.fileno()
                if cycle._fd_to_chan.get(fd) == (self, HEARD):
                    del cycle._fd_to_chan[fd]
                with contextlib.suppress(Exception):  # never registered with this poll
                    cycle._unregister_from_poll(fd)

    def _heard(self) -> None:
        """Read what the ears heard. While this channel waits on one list and calls were
        pushed onto others, take them now, over all its lists, on a pooled connection
        (the wait holds the channel's own, and goes on): one take per push heard, until
        one finds nothing or the channel has no credit left."""
        if self._ears is None:
            return
        try:
            pushed = self._ears.pushed()
        except redis.RedisError as exc:
            self._lost_ears(exc)
            return
        taking = self._taking
        if taking is None or taking[0] != "BLMOVE":  # no wait to go around
            self._pushed = self._pushed or bool(pushed)  # so the next take may not block
            return
        elsewhere = sum(n for name, n in pushed.items() if name != taking[1][0])
        client = self._create_client()
        for _ in range(elsewhere):  # a push onto the list waited on is its wait's
            if self.closed or self._closing:
                return  # a delivery closed the channel: take nothing more
            if self._taking is not taking or not self.qos.can_consume():
                self._pushed = True  # its wait was read, or no credit: the next take looks
                return
            keys = self._taken_from()
            try:
                reply = client.evalsha(
                    scripts.sha("take"), 2 * len(keys), *keys, *map(self._inflight, keys)
                )
            except NoScriptError:
                client.script_load(scripts.source("take"))
                self._pushed = True
                return  # found by the take after this wait
            except ResponseError as exc:  # nothing moved; the takes after the wait go on
                log.debug("a heard take was refused: %s", exc)
                self._pushed = True
                return
            if reply is None:
                return
            self._took(bytes_to_str(reply[0]), reply[1])  # type: ignore[no-untyped-call]

    def _poll_error(self, type: str, **options: Any) -> Any:
        if type == HEARD:  # an error event on the ears' socket: reading it says what
            self._heard()
            return None
        return super()._poll_error(type, **options)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._close_ears()
        super().close()  # type: ignore[no-untyped-call]

    def _after_fork(self) -> None:
        ears, self._ears = self._ears, None  # a forked child takes nothing
        if ears is not None:
            ears.forget()  # its copy of the parent's socket, closed here alone
        super()._after_fork()  # type: ignore[no-untyped-call]

    def _brpop_start(self, timeout: float | None = None) -> None:
        if not self._takes_in_flight:
            super()._brpop_start(timeout)  # type: ignore[no-untyped-call]
            return
        keys = self._taken_from()
        if not keys:
            return
        self._put_back_strays(keys)
        connection = self.client.connection
        idle, self._pushed = self._idle and not self._pushed, False
        if idle:
            # the list it last took from: where its next message most likely comes (the
            # queues take turns, so the first in their order is not that list)
            first = self._last_list if self._last_list in keys else keys[0]
            wait = IDLE_POLL_S if len(keys) > 1 else (timeout or self.brpop_timeout or 0)
            turns = self._queue_cycle
            if isinstance(turns, FairTurns) and turns.shared():  # queues of several tenants
                wait = IDLE_POLL_MANY_S
                # a call on another list is taken beside the wait; one on this list is the
                # wait's, and hearing it too would only wake the loop once more
                self._ears_of([key for key in keys if key != first])
            elif self._ears is not None:  # one tenant's queues now: nothing to hear
                self._close_ears()
            self._taking = ("BLMOVE", [first])
            connection.send_command("BLMOVE", first, self._inflight(first), "RIGHT", "LEFT", wait)
        else:
            self._taking = ("EVALSHA", keys)
            connection.send_command(
                "EVALSHA", scripts.sha("take"), 2 * len(keys), *keys, *map(self._inflight, keys)
            )
        self._in_poll = connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]

    def _brpop_read(self, **options: Any) -> bool:
        taking, self._taking = self._taking, None
        if taking is None:
            return bool(super()._brpop_read(**options))  # type: ignore[no-untyped-call]
        kind, keys = taking
        try:
            try:
                reply = self.client.parse_response(self.client.connection, kind, **options)
            except NoScriptError:  # first use, a Redis restart or SCRIPT FLUSH: take again
                self.client.script_load(scripts.source("take"))
                raise Empty() from None
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            except ResponseError as exc:  # never the consumer's end: nothing was taken
                if "WRONGTYPE" not in str(exc) or not repair_queue_keys(self.client, keys):
                    self._refused_take(exc)
                raise Empty() from None
            # The reply is read: a delivery that closes the channel finds no take to read.
            self._in_poll = None  # type: ignore[assignment]
            # Block at once next when nothing waits elsewhere: the script found every list
            # empty, or the wait took from its list while the ears heard the others (a push
            # onto one of them sets `_pushed`, and the next take looks at every list). The
            # ears can miss a push (before a subscription takes effect, on a Redis that
            # publishes no list events), so they stand for a look only `IDLE_POLL_MANY_S`
            # after the last: a call they missed waits no longer than without them.
            now = time.monotonic()
            if reply is None and kind == "EVALSHA":
                self._looked_at = now
            heard = (
                kind == "BLMOVE" and reply is not None and self._ears is not None
                and now - self._looked_at < IDLE_POLL_MANY_S
            )  # fmt: skip
            self._idle = not self._pushed and (heard or (reply is None and kind == "EVALSHA"))
            if reply is None:
                raise Empty()
            if kind == "BLMOVE":
                key, item = keys[0], reply
            else:  # the script's {list, message}
                key, item = bytes_to_str(reply[0]), reply[1]  # type: ignore[no-untyped-call]
            self._took(key, item)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._flush_brpop_reauth()  # type: ignore[no-untyped-call]

    def _took(self, key: str, item: bytes) -> None:
        """Hand on `item`, which a take just moved from list `key` into its in-flight list."""
        self._last_list = key
        self.taken = (self._inflight(key), item)  # QoS.append records it and clears this
        queue = key.rsplit(self.sep, 1)[0]  # kombu's name for a priority list's queue
        self._queue_cycle.rotate(queue)  # its queues take turns (`take_turns`)
        self._take(item, queue)
        if self.taken is not None:  # refused, or a consumer that acknowledges nothing
            # a pooled connection: a wait may hold the channel's own (`_heard`)
            self._create_client().lrem(self.taken[0], 1, item)
            self.taken = None


#: The poller's name for a channel's `waking.Ears` socket, beside kombu's BRPOP and LISTEN.
HEARD = "HEARD"


class Poller(kombu_redis.MultiChannelPoller):
    """Reads every BRPOP reply as it arrives: a message Redis has popped is safe once
    recorded as unacked, not while it waits in a socket buffer."""

    def _pause_brpop(self, channel: Any, fileno: int) -> None:
        return  # kombu would stop reading a reply that may hold a popped message

    def maybe_check_brpop_health(self) -> None:
        """A take whose reply is overdue (its own wait plus `health_check_interval`) has
        a primary that stopped answering: its channel is marked, and the next poll raises
        a connection error, so the consumer reconnects as after any lost connection, to
        the primary the Sentinels name by then. kombu drops the connection instead and
        takes again on one opened on the spot, which met the same stopped primary (the
        Sentinels had not failed it over yet) and hung there until it came back."""
        now = time.monotonic()
        for channel in self._channels:
            connection = channel._in_poll
            sent = channel._brpop_sent_at
            if not connection or sent is None or not channel.health_check_interval:
                continue
            if now - sent < (channel.brpop_timeout or 0) + channel.health_check_interval:
                continue
            sock = getattr(connection, "_sock", None)
            if sock is None or select.select([sock], [], [], 0)[0]:
                continue
            log.warning("Redis did not answer a take for %.0f s; reconnecting", now - sent)
            channel.stalled = True

    def on_poll_start(self) -> None:
        for channel in self._channels:
            if getattr(channel, "stalled", False):
                channel.stalled = False
                raise RedisConnectionError("Redis did not answer a take in time")
        super().on_poll_start()  # type: ignore[no-untyped-call]
        for channel in self._channels:  # ears' sockets, polled beside the takes (`waking`)
            ears = getattr(channel, "_ears", None)
            if ears is not None and ears.socket() is not None:
                ident = (channel, ears, HEARD)  # kombu's (channel, client, type)
                if self._chan_to_sock.get(ident) is not ears.socket():
                    self._register(*ident)  # type: ignore[no-untyped-call]

    def on_readable(self, fileno: int) -> None:
        found = self._fd_to_chan.get(fileno)
        if found is not None and found[1] == "BRPOP" and found[0]._in_poll:
            found[0].handlers["BRPOP"]()  # even without credit: see the module docstring
            return
        if found is not None and found[1] == HEARD:
            found[0]._heard()  # read even without credit: unread, the socket stays ready
            return
        super().on_readable(fileno)  # type: ignore[no-untyped-call]


class Transport(kombu_redis.Transport):
    """`redis://` and `rediss://` as kombu serves them, with `QoS` and `Poller` above."""

    Channel = Channel

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self.cycle = Poller()  # type: ignore[no-untyped-call,assignment]


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """`Channel` on a primary that Sentinels watch: its pools ask a Sentinel for the
    primary as each connection opens (kombu's `SentinelChannel`), so a consumer that lost
    its connection in a failover, or met a demoted primary (READONLY), connects to the new
    one as it reconnects."""

    from_transport_options = tuple(  # type: ignore[assignment]
        dict.fromkeys(
            (
                *Channel.from_transport_options,
                *kombu_redis.SentinelChannel.from_transport_options,
                "sentinels",
            )
        )
    )
    #: Leaves a server that refuses writes (`endpoint.PrimaryConnection`); over TLS,
    #: kombu's own (`Channel`'s plain-endpoint class takes no Sentinel pool).
    connection_class = endpoint.PrimaryConnection
    connection_class_ssl = kombu_redis.SentinelChannel.connection_class_ssl
    #: Every Sentinel, as (host, port) pairs: the transport option `tasks.config` sets.
    sentinels: Any = ()
    master_name: str | None = None

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        """kombu's push, then Redis's `WAIT` for a replica to hold it, on one connection:
        a call the primary took and lost before it replicated (a host lost whole) would
        be lost unseen, while a publish whose `WAIT` a dying primary cut short is sent
        again by kombu's retry (a twin its worker drops or answers once). A replica that
        does not answer within `endpoint.REPLICA_WAIT_MS` leaves it on the primary alone,
        as a Redis whose ACL lacks `WAIT` does (logged), unless the Sentinels no longer
        name its server the primary: then kombu's retry sends it there (`endpoint.kept`).
        Publish batches and queues with an expiry, which the fleet does not use, go as
        kombu sends them."""
        if kwargs.get("_publish_batch") is not None or (self._expires and queue in self._expires):
            super()._put(queue, message, **kwargs)  # type: ignore[no-untyped-call]
            return
        priority = self._get_message_priority(message, reverse=False)  # type: ignore[no-untyped-call]
        key = self._q_for_pri(queue, priority)  # type: ignore[no-untyped-call]
        with self.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            pipe.lpush(key, dumps(message))  # type: ignore[no-untyped-call]
            endpoint.kept(pipe, f"a message published to {queue}")

    def _sentinel_managed_pool(self, asynchronous: bool = False) -> Any:
        """The primary's pool, found through `sentinels`. kombu reads the Sentinels from
        the broker URL's alternates (`;`), but a connection with alternates switches to
        the next one's own transport, kombu's, on its first failed try: a worker then
        lost this transport's in-flight lists for the rest of its run. So the fleet's
        broker URL names one Sentinel, and this option all of them."""
        params = self._connparams(asynchronous)  # type: ignore[no-untyped-call]
        params.pop("host", None)
        params.pop("port", None)
        manager = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
            [(host, int(port)) for host, port in self.sentinels],
            min_other_sentinels=getattr(self, "min_other_sentinels", 0),
            sentinel_kwargs=getattr(self, "sentinel_kwargs", None),
            **params,
        )
        if asynchronous:  # closed with the channel (kombu's `_disconnect_pools`)
            self._async_sentinel_manager = manager
        else:
            self._sentinel_manager = manager
        sign_in = {k: params[k] for k in ("username", "password") if k in params}
        primary = manager.master_for(self.master_name, redis.Redis, **sign_in)  # type: ignore[no-untyped-call]
        return primary.connection_pool


class SentinelTransport(Transport):
    """`sentinel://` (`placement.ledger.endpoint`): `Transport` through Sentinels."""

    Channel = SentinelChannel
    default_port = endpoint.SENTINEL_PORT  # type: ignore[assignment]
