"""One fleet per broker database: the claim that keeps two fleets' calls apart.

Every fleet consumes the same queue names: `celery`, the router's (so that a plain Celery
client reaches it with no configuration), and `gpufleet.<host>.gpu<N>`. Two fleets whose
broker is the same Redis database would take each other's calls: a router would place a
call on the other fleet's GPUs, or refuse a model only the other fleet's catalog has. One
Redis server holds many databases (`redis://host:6379/1`), so each fleet takes its own.

The claim is one key in the broker database, `CLAIM_KEY`, holding the fleet's name for
`CLAIM_TTL_S`. `gpufleet up` takes it before it starts anything, and every gpufleet
Celery worker takes it as it starts and renews it while it runs. A claim another fleet
holds refuses the start (`BrokerInUseError`), or, found while running, stops the worker
(warm shutdown). Workers of one fleet on many hosts share the claim. `gpufleet up`
releases it when it stops, unless the fleet still runs on other hosts; workers started
otherwise (compose, by hand) leave it to lapse, at most `CLAIM_TTL_S` after the last one
stops.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import redis
from celery.signals import worker_init

from placement.config import safe_url
from placement.errors import BrokerInUseError
from placement.ledger import endpoint
from placement.ledger.keys import BROKER_CLAIM
from placement.ledger.scripts import scripts_for
from tasks import context

log = logging.getLogger(__name__)

CLAIM_KEY = BROKER_CLAIM
CLAIM_TTL_S = 30
RENEW_EVERY_S = 10.0


class BrokerClaim:
    """`fleet`'s hold on the broker database at `url` (see the module)."""

    def __init__(self, url: str, fleet: str) -> None:
        self.url = url
        self.fleet = fleet
        self.client = endpoint.connect(
            url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> None:
        """Hold the database for the next `CLAIM_TTL_S`, or raise `BrokerInUseError`."""
        holder = scripts_for(self.client)("claim", [CLAIM_KEY], [self.fleet, CLAIM_TTL_S])
        if holder is not None:
            raise BrokerInUseError(
                f"the Celery broker {safe_url(self.url)} already carries the calls of fleet "
                f"{holder!r}, and two fleets on one Redis database take each other's calls. "
                f"Give fleet {self.fleet!r} a database of its own, GPUFLEET_REDIS_URL=redis://"
                f"<host>:<port>/1 say (and GPUFLEET_BROKER_URL, where it is set), or a Redis "
                f"of its own; or stop fleet {holder!r} (its claim, {CLAIM_KEY}, lapses "
                f"{CLAIM_TTL_S} s after it was last renewed)"
            )

    def release(self) -> None:
        """Give the database up, if this fleet still holds it."""
        try:
            with self.client.pipeline() as pipe:
                pipe.watch(CLAIM_KEY)  # type: ignore[no-untyped-call]
                if pipe.get(CLAIM_KEY) == self.fleet:
                    pipe.multi()
                    pipe.delete(CLAIM_KEY)
                    pipe.execute()
        except redis.RedisError as exc:  # WatchError included: someone else holds it now
            log.debug("broker claim not released: %s", exc)

    def keep(self, on_lost: Callable[[BrokerInUseError], object]) -> None:
        """Renew the claim in the background; call `on_lost(error)` if another fleet has it."""

        def renew() -> None:
            while not self._stop.wait(RENEW_EVERY_S):
                try:
                    self.take()
                except BrokerInUseError as exc:
                    on_lost(exc)
                    return
                except Exception as exc:  # the broker is down (Celery reports it too)
                    log.warning("broker claim not renewed (retrying): %s", exc)

        self._thread = threading.Thread(target=renew, name="gpufleet-broker-claim", daemon=True)
        self._thread.start()

    def close(self, release: bool = False) -> None:
        """Stop renewing, release the claim if asked (else it lapses), close the connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)  # a renewal under way must not outlive a release
        if release:
            self.release()
        self.client.close()


@worker_init.connect
def _claim(**_: Any) -> None:
    """A worker takes its fleet's broker database before it consumes anything, and keeps
    it while it runs. It never releases it: other processes of its fleet may still run."""
    settings = context.settings()
    claim = BrokerClaim(settings.broker_url, settings.fleet)
    try:
        claim.take()
    except BrokerInUseError as exc:
        # Celery logs and ignores exceptions of signal handlers; SystemExit stops it.
        raise SystemExit(f"gpufleet worker cannot start: {exc}") from exc
    except redis.RedisError as exc:
        log.warning("cannot claim the broker yet (%s); renewing will", exc)
    claim.keep(_lost)


def _lost(exc: BrokerInUseError) -> None:
    log.critical("stopping: %s", exc)
    os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown
