"""Kombu's Redis transport, without its window for losing a message when Redis dies.

Kombu takes a message with BRPOP and records it as unacknowledged in a second round
trip. When Redis dies between the two (a crash, SIGKILL, the OOM killer), the message is
in neither place: only the consumer holds it, and the consumer drops it as it reconnects.
Here the consumer puts such a message back at the head of its queue once Redis answers
again, so a broker crash costs a redelivery, never a call. Every gpufleet process uses
this transport (`broker_transport` in `tasks.config`); clients need nothing.

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


class Transport(kombu_redis.Transport):
    """`redis://` and `rediss://` as kombu serves them, with `QoS.append` above."""

    Channel = Channel
