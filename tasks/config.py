"""The Celery side of the settings: the configuration every gpufleet process shares.

Every `GPUFLEET_*` variable is read by `placement.config.Settings`; this module only turns
those settings into Celery's configuration, and names the fleet's fixed queues, tasks and
ports.
"""

from __future__ import annotations

import ssl
from typing import Any

from placement.config import Settings
from placement.ledger import endpoint
from placement.ledger.tenancy import tenants

#: The tasks callers send by name (README, "Calling the fleet"), in the order refusals list
#: them.
INFER = "gpufleet.infer"
DEPLOY = "gpufleet.deploy"
EVICT = "gpufleet.evict"
STATUS = "gpufleet.status"
CANCEL = "gpufleet.cancel"
PUBLIC_TASKS = (INFER, DEPLOY, EVICT, STATUS, CANCEL)
#: The fleet's own hops, taken only from fleet queues: what a router hands a placed call on
#: to its GPU worker as, and a scaling decision.
RUN = "gpufleet.run"
SCALE = "gpufleet.scale"
#: The tasks a call runs as, under its own task id: `INFER` (routed by a router, or
#: forwarded as it is) and `RUN`. Their messages carry request leases.
CALL_TASKS = frozenset({INFER, RUN})

ROUTER_QUEUE = "celery"  # Celery's default: a client that imports nothing reaches the router
#: The router's second queue, which only fleet processes write: calls a GPU worker routes
#: again, the router's own retries, calls given back from a dead GPU worker, and scaling
#: decisions. Every router consumes it (`tasks.app`).
INTERNAL_QUEUE = "gpufleet.router"
ROUTER_QUEUES = (ROUTER_QUEUE, INTERNAL_QUEUE)
#: The result backend every gpufleet process uses: Celery's Redis one, less the call's
#: arguments in each result; and the same through Sentinels.
RESULT_BACKEND = "tasks.broker.results:Backend"
SENTINEL_BACKEND = "tasks.broker.results:SentinelBackend"
#: The queue any caller may write (docs/deploy.md, "Security"); each tenant has one more,
#: its own (`is_public`). What is taken from them is checked as a caller's
#: (`tasks.broker.intake`).
PUBLIC_QUEUES = frozenset({ROUTER_QUEUE})


def is_public(queue: object) -> bool:
    """Whether `queue` is one callers write: the router's `celery`, or a tenant's own."""
    return isinstance(queue, str) and (
        queue in PUBLIC_QUEUES or tenants.tenant_of(queue) is not None
    )


def is_routers(queue: str) -> bool:
    """Whether every live router serves `queue` (its own two, and every tenant's), so a
    router's death strands nothing there."""
    return queue in ROUTER_QUEUES or tenants.tenant_of(queue) is not None


#: Publishing retries for about 10 s (Celery's default gives up after 0.6 s).
PUBLISH_RETRY_POLICY = {
    "max_retries": 25,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.5,
}


def celery_conf(settings: Settings) -> dict[str, Any]:
    """The Celery configuration every gpufleet process shares."""
    conf: dict[str, Any] = {
        **redis_conf(settings.broker_url, settings.result_backend, settings.visibility_timeout),
        # JSON only: pickle is refused on the way in and on the way out.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # A GPU task is acknowledged when it ends; a lost worker's task is redelivered.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
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
    return conf


def redis_conf(broker_url: str, backend_url: str, visibility_timeout: int) -> dict[str, Any]:
    """A fleet process's broker and result backend at these URLs: `redis://`, `rediss://`
    or `sentinel://` (`placement.ledger.endpoint`), with the fleet's own transport
    (`tasks.broker.transport`, which loses no message) and backend (`tasks.broker.results`)."""
    broker, backend = endpoint.parse(broker_url), endpoint.parse(backend_url)
    transport = "SentinelTransport" if broker.watched else "Transport"
    conf: dict[str, Any] = {
        # One Sentinel's URL, all of them in the transport options (`SentinelChannel`)
        "broker_url": broker.parts()[0] if broker.watched else broker.url,
        "broker_transport": f"tasks.broker.transport:{transport}",
        # Celery's `backend+url` form: the class, then the URL
        "result_backend": f"{SENTINEL_BACKEND if backend.watched else RESULT_BACKEND}"
        f"+{_celery_url(backend)}",
        # One visibility timeout, the same for the broker and the result backend. A worker
        # adds its node name as it starts (`tasks.app`): it takes through in-flight lists.
        "broker_transport_options": {
            "visibility_timeout": visibility_timeout,
            **_sentinel_options(broker),
            **({"sentinels": [list(s) for s in broker.sentinels]} if broker.watched else {}),
        },
        "result_backend_transport_options": {
            "visibility_timeout": visibility_timeout,
            **_sentinel_options(backend),
        },
    }
    if _tls(broker_url):
        conf["broker_use_ssl"] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    if _tls(backend_url):
        conf["redis_backend_use_ssl"] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    if backend.watched:  # a primary that stops answering is left, as the broker's is
        conf["redis_socket_timeout"] = endpoint.FAILOVER_SOCKET_TIMEOUT_S
        conf["redis_socket_connect_timeout"] = endpoint.FAILOVER_SOCKET_TIMEOUT_S
    return conf


def caller_conf(url: str) -> dict[str, Any]:
    """What a plain Celery client passes to `app.conf.update(**conf)` to call the fleet
    whose caller URL is `url` (`gpufleet url --json`): Celery's own transport and backend,
    JSON, and retries that carry it through a Redis restart or a failover."""
    found = endpoint.parse(url)
    where = _celery_url(found)
    conf: dict[str, Any] = {
        "broker_url": where,
        "result_backend": where,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        "task_publish_retry_policy": _publish_retries(found),
        "result_backend_always_retry": True,
        "result_backend_max_retries": 30,
    }
    if found.watched:
        conf["broker_transport_options"] = _sentinel_options(found)
        conf["result_backend_transport_options"] = found.transport_options()
        conf["redis_socket_timeout"] = endpoint.FAILOVER_SOCKET_TIMEOUT_S
        conf["redis_socket_connect_timeout"] = endpoint.FAILOVER_SOCKET_TIMEOUT_S
    return conf


def _publish_retries(found: endpoint.Endpoint) -> dict[str, Any]:
    """`PUBLISH_RETRY_POLICY` for a plain client of `found`. Its connection to Sentinels
    cycles through their URLs (`;`) and kombu sleeps only once it has tried each
    (`Connection.completes_cycle`): the retries count per Sentinel, or three would cut
    the 10 s to 3, shorter than a failover."""
    policy = dict(PUBLISH_RETRY_POLICY)
    policy["max_retries"] *= max(1, len(found.sentinels))
    return policy


def _celery_url(found: endpoint.Endpoint) -> str:
    """The URL Celery's broker and backend read: as given, or Sentinels joined by `;`."""
    return ";".join(found.parts()) if found.watched else found.url


def _sentinel_options(found: endpoint.Endpoint) -> dict[str, Any]:
    """The broker's transport options that find a Sentinel-watched primary, and leave one
    that stops answering; none for one server."""
    if not found.watched:
        return {}
    return {
        **found.transport_options(),
        "socket_timeout": endpoint.FAILOVER_SOCKET_TIMEOUT_S,
        "socket_connect_timeout": endpoint.FAILOVER_SOCKET_TIMEOUT_S,
        # A consumer's blocking take whose reply is this late (past its own wait) has a
        # primary that stopped answering: kombu drops the connection, and the consumer
        # reconnects through the Sentinels. Also how long a pooled connection may idle
        # before it is PINGed first.
        "health_check_interval": endpoint.FAILOVER_CHECK_S,
    }


def _tls(url: str) -> bool:
    """rediss:// without its own ssl_cert_reqs gets certificate checks on (Celery needs it said)."""
    return url.startswith("rediss://") and "ssl_cert_reqs" not in url
