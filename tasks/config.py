"""The Celery side of the settings: the configuration every gpufleet process shares.

Every `GPUFLEET_*` variable is read by `placement.config.Settings`; this module only turns
those settings into Celery's configuration, and names the fleet's fixed queues and ports.
"""

from __future__ import annotations

import ssl
from typing import Any

from placement.config import Settings

ROUTER_QUEUE = "celery"  # Celery's default: a client that imports nothing reaches the router
#: The router's second queue, which only fleet processes write: calls a GPU worker routes
#: again, the router's own retries, calls given back from a dead GPU worker, and scaling
#: decisions. Every router consumes it (`tasks.app`).
INTERNAL_QUEUE = "gpufleet.router"
ROUTER_QUEUES = (ROUTER_QUEUE, INTERNAL_QUEUE)
#: The result backend every gpufleet process uses: Celery's Redis one, less the call's
#: arguments in each result.
RESULT_BACKEND = "tasks.broker.results:Backend"
#: The queues any caller may write (docs/deploy.md, "Security"): what is taken from them
#: is checked as a caller's (`tasks.broker.intake`).
PUBLIC_QUEUES = frozenset({ROUTER_QUEUE})
#: Publishing retries for about 10 s (Celery's default gives up after 0.6 s).
PUBLISH_RETRY_POLICY = {
    "max_retries": 25,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.5,
}


def celery_conf(settings: Settings) -> dict[str, Any]:
    """The Celery configuration every gpufleet process shares."""
    transport = {"visibility_timeout": settings.visibility_timeout}
    conf: dict[str, Any] = {
        "broker_url": settings.broker_url,
        "broker_transport": "tasks.broker.transport:Transport",  # redis(s):// that loses no message
        # Celery's `backend+url` form: this class (tasks/broker/results.py) for a redis(s):// URL.
        "result_backend": f"{RESULT_BACKEND}+{settings.result_backend}",
        # JSON only: pickle is refused on the way in and on the way out.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # A GPU task is acknowledged when it ends; a lost worker's task is redelivered.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        # One visibility timeout, the same for the broker and the result backend. A worker
        # adds its node name as it starts (`tasks.app`): it takes through in-flight lists.
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "task_default_queue": ROUTER_QUEUE,
        # Answers the calls it cannot read (pickle, broken JSON) instead of dropping them.
        "worker_consumer": "tasks.serving.consumer:Consumer",
        # Fleet processes tell Flower of the calls they send on; a client may hold a
        # caller's URL, whose user may not publish events (placement.server.acl).
        "task_send_sent_event": settings.role != "client",
        "worker_send_task_events": True,
        "broker_connection_retry_on_startup": True,
        "result_expires": 24 * 3600,
        # Name, queue and worker in stored results, never the call's arguments
        # (tasks.broker.results).
        "result_extended": True,
        # A result stored while Redis restarts is retried, not lost (about half a minute).
        # A broker restart (the launcher restarts its Redis in about a second) must not fail
        # the calls that publish meanwhile: routed calls are published from inside tasks.
        "task_publish_retry_policy": PUBLISH_RETRY_POLICY,
        "result_backend_always_retry": True,
        "result_backend_max_retries": 30,
        "result_backend_max_sleep_between_retries_ms": 2000,
    }
    if _tls(settings.broker_url):
        conf["broker_use_ssl"] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    if _tls(settings.result_backend):
        conf["redis_backend_use_ssl"] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    return conf


def _tls(url: str) -> bool:
    """rediss:// without its own ssl_cert_reqs gets certificate checks on (Celery needs it said)."""
    return url.startswith("rediss://") and "ssl_cert_reqs" not in url
