"""Kombu's Redis transport, without its windows for losing a message when Redis dies.

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

What remains: Redis killed after it ran the BRPOP but before its reply left the server
(microseconds, against a Python round trip here).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kombu.transport import redis as kombu_redis

#: How long a consumer waits for Redis to come back to give a message back.
GIVE_BACK_S = 30.0

log = logging.getLogger(__name__)


class QoS(kombu_redis.QoS):
    """Unacknowledged-message bookkeeping that gives back what it could not record."""

    def append(self, message: Any, delivery_tag: str) -> None:
        try:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
        except self.channel.connection_errors:
            give_back(self.channel, message)
            raise  # the consumer reconnects as it would have


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


class Channel(kombu_redis.Channel):
    QoS = QoS


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
