"""Kombu's Redis transport, without its windows for losing a message when Redis or a
GPU worker dies.

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
the same way. A GPU worker is the only consumer of its queue (`sole_consumer`), so it
takes with BLMOVE (Redis 6.2 or later) instead: Redis moves the message into the queue's
in-flight list (`<queue>.inflight`) in the same step, and recording it as unacked removes
it from there. A consumer that starts on the queue puts back what its predecessor left
in flight (`Channel.basic_consume`). It takes from the queue's base list only: calls
that ask for a message priority do not take the fast path (`tasks.routing`), so none
lands in the queue's priority lists. The router's queue may have several consumers and
keeps BRPOP.

What remains: Redis killed after it ran the BRPOP but before its reply left the server
(microseconds, against a Python round trip here), and a router killed as it takes a call.
"""

from __future__ import annotations

import logging
import time
from queue import Empty
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

#: How long a consumer waits for Redis to come back to give a message back.
GIVE_BACK_S = 30.0

log = logging.getLogger(__name__)


class QoS(kombu_redis.QoS):
    """Unacknowledged-message bookkeeping that gives back what it could not record."""

    def append(self, message: Any, delivery_tag: str) -> None:
        taken, self.channel.taken = self.channel.taken, None
        info = message.delivery_info
        record = dumps([message._raw, info["exchange"], info["routing_key"]])  # type: ignore[no-untyped-call]
        try:
            with self.pipe_or_acquire() as pipe:
                pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()})
                pipe.hset(self.unacked_key, delivery_tag, record)
                if taken is not None:  # recorded: out of the in-flight list in the same step
                    pipe.lrem(inflight(taken[0]), 1, taken[1])
                pipe.execute()
        except self.channel.connection_errors:
            if taken is None:  # a taken message waits in the in-flight list instead
                give_back(self.channel, message)
            raise  # the consumer reconnects, and puts back what is in flight
        virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]


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
                channel._do_restore_message(
                    message._raw, info["exchange"], info["routing_key"], pipe, leftmost=False
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


def inflight(queue: str) -> str:
    """The list a sole consumer's messages pass through between taken and recorded."""
    return f"{queue}.inflight"


class Channel(kombu_redis.Channel):
    """kombu's Redis channel; with the transport option `sole_consumer` (GPU workers), a
    consumer of one queue takes its messages through the queue's in-flight list."""

    QoS = QoS
    from_transport_options = (*kombu_redis.Channel.from_transport_options, "sole_consumer")  # type: ignore[assignment]
    sole_consumer = False
    taken: tuple[str, bytes] | None = None  # (queue, message) taken and not yet recorded
    _taking: str | None = None  # the queue of the BLMOVE in flight

    @property
    def _takes_in_flight(self) -> bool:
        # kombu prefixes only the commands it sends itself: BLMOVE, LMOVE and LREM would
        # miss a `global_keyprefix`, so such a channel keeps BRPOP.
        return bool(self.sole_consumer and not self.global_keyprefix)

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        if self._takes_in_flight and queue not in self._fanout_queues:
            self._put_back_in_flight(queue)
        return super().basic_consume(queue, *args, **kwargs)  # type: ignore[no-untyped-call]

    def _put_back_in_flight(self, queue: str) -> None:
        """Return to the head of `queue` what a consumer before this one took and did
        not record (it died in between), oldest first in line."""
        restored = 0
        with self.conn_or_acquire() as client:
            while client.lmove(inflight(queue), queue, "LEFT", "RIGHT") is not None:
                restored += 1
        if restored:
            log.warning("put back %d message(s) a dead consumer had taken from %s", restored, queue)

    def _sole_queue(self) -> str | None:
        queues = list(self.active_queues)
        return queues[0] if self._takes_in_flight and len(queues) == 1 else None

    def _brpop_start(self, timeout: float | None = None) -> None:
        queue = self._sole_queue()
        if queue is None:
            super()._brpop_start(timeout)  # type: ignore[no-untyped-call]
            return
        if timeout is None:
            timeout = self.brpop_timeout
        self._taking = queue
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()  # type: ignore[assignment]
        self.client.connection.send_command(
            "BLMOVE", queue, inflight(queue), "RIGHT", "LEFT", timeout or 0
        )

    def _brpop_read(self, **options: Any) -> bool:
        queue, self._taking = self._taking, None
        if queue is None:
            return bool(super()._brpop_read(**options))  # type: ignore[no-untyped-call]
        try:
            try:
                item = self.client.parse_response(self.client.connection, "BLMOVE", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            if item is None:
                raise Empty()
            self.taken = (queue, item)  # QoS.append records it and clears this
            self.connection._deliver(loads(bytes_to_str(item)), queue)  # type: ignore[no-untyped-call]
            if self.taken is not None:  # a consumer that acknowledges nothing: no record
                self.client.lrem(inflight(queue), 1, item)
                self.taken = None
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._flush_brpop_reauth()  # type: ignore[no-untyped-call]


class Poller(kombu_redis.MultiChannelPoller):
    """Reads every BRPOP reply as it arrives: a message Redis has popped is safe once
    recorded as unacked, not while it waits in a socket buffer."""

    def _pause_brpop(self, channel: Any, fileno: int) -> None:
        return  # kombu would stop reading a reply that may hold a popped message

    def on_readable(self, fileno: int) -> None:
        found = self._fd_to_chan.get(fileno)
        if found is not None and found[1] == "BRPOP" and found[0]._in_poll:
            found[0].handlers["BRPOP"]()  # even without credit: see the module docstring
            return
        super().on_readable(fileno)  # type: ignore[no-untyped-call]


class Transport(kombu_redis.Transport):
    """`redis://` and `rediss://` as kombu serves them, with `QoS` and `Poller` above."""

    Channel = Channel

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self.cycle = Poller()  # type: ignore[no-untyped-call,assignment]
