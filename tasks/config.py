"""Settings of the Celery side, read from `GPUFLEET_*` environment variables.

URLs: `GPUFLEET_BROKER_URL`, then `GPUFLEET_RESULT_BACKEND`, then `GPUFLEET_REDIS_URL`
(the registry); each defaults to the one before it, and the broker defaults to
`GPUFLEET_REDIS_URL` when only that is set, so one URL configures a whole fleet.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from placement.errors import ConfigError

DEFAULT_URL = "redis://127.0.0.1:6379/0"
ROUTER_QUEUE = "celery"  # Celery's default: a client that imports nothing reaches the router
DEFAULT_METRICS_PORT = 9464  # Prometheus /metrics of `gpufleet up` and `gpufleet metrics`
VISIBILITY_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Settings:
    broker_url: str
    result_backend: str
    registry_url: str
    fleet: str
    models: str
    visibility_timeout: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        broker = env.get("GPUFLEET_BROKER_URL") or env.get("GPUFLEET_REDIS_URL") or DEFAULT_URL
        backend = env.get("GPUFLEET_RESULT_BACKEND") or broker
        registry = env.get("GPUFLEET_REDIS_URL") or backend
        for name, url in (("broker", broker), ("result backend", backend), ("registry", registry)):
            if urlparse(url).scheme not in ("redis", "rediss"):
                raise ConfigError(
                    f"the {name} URL {safe_url(url)!r} must start with redis:// or rediss://"
                )
        try:
            timeout = int(env.get("GPUFLEET_VISIBILITY_TIMEOUT", VISIBILITY_TIMEOUT_S))
        except ValueError as exc:
            raise ConfigError("GPUFLEET_VISIBILITY_TIMEOUT must be whole seconds") from exc
        return cls(
            broker_url=broker,
            result_backend=backend,
            registry_url=registry,
            fleet=env.get("GPUFLEET_FLEET", "default"),
            models=env.get("GPUFLEET_MODELS", "models.yaml"),
            visibility_timeout=timeout,
        )

    def celery(self) -> dict[str, Any]:
        """The Celery configuration every gpufleet process shares."""
        transport = {"visibility_timeout": self.visibility_timeout}
        conf: dict[str, Any] = {
            "broker_url": self.broker_url,
            "result_backend": self.result_backend,
            # JSON only: pickle is refused on the way in and on the way out.
            "task_serializer": "json",
            "result_serializer": "json",
            "accept_content": ["json"],
            "result_accept_content": ["json"],
            # A GPU task is acknowledged when it ends; a lost worker's task is redelivered.
            "task_acks_late": True,
            "task_reject_on_worker_lost": True,
            "worker_prefetch_multiplier": 1,
            # One visibility timeout, the same for the broker and the result backend.
            "broker_transport_options": transport,
            "result_backend_transport_options": transport,
            "task_default_queue": ROUTER_QUEUE,
            "task_send_sent_event": True,
            "worker_send_task_events": True,
            "broker_connection_retry_on_startup": True,
            "result_expires": 24 * 3600,
            "result_extended": True,
        }
        if _tls(self.broker_url):
            conf["broker_use_ssl"] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
        if _tls(self.result_backend):
            conf["redis_backend_use_ssl"] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
        return conf


def safe_url(url: str) -> str:
    """`url` with its password masked, for output and logs."""
    parts = urlparse(url)
    if not parts.password:
        return url
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{parts.hostname}:{parts.port}").geturl()


def _tls(url: str) -> bool:
    """rediss:// without its own ssl_cert_reqs gets certificate checks on (Celery needs it said)."""
    return url.startswith("rediss://") and "ssl_cert_reqs" not in url
