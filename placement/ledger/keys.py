"""Redis key names of one fleet.

Every key carries the fleet name as its hash tag (`gpufleet:{fleet}:...`), so a
whole fleet lives in one Redis Cluster slot and every Lua script may touch any of
its keys. Names are built here and only here; Lua scripts receive them in KEYS.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from placement.errors import ConfigError

#: The broker database's claim (tasks/broker/claim.py): which fleet's calls it carries. Not a
#: fleet's key: one database carries one fleet.
BROKER_CLAIM = "gpufleet:broker-fleet"
#: The broker database's Celery workers (tasks/broker/presence.py): node name -> record JSON.
CONSUMERS = "gpufleet:consumers"
#: The broker database's count of worker deaths per call (tasks/broker/quarantine.py): task id ->
#: how many consumers died while handling it.
DEATHS = "gpufleet:deaths"
#: The messages of calls that stopped their consumer twice, newest first
#: (tasks/broker/quarantine.py).
QUARANTINE = "gpufleet:quarantine"


def unacked_of(node: str) -> str:
    """The broker's set of the delivery tags Celery worker `node` holds unacknowledged."""
    return f"gpufleet:unacked:{node}"


@dataclass(frozen=True)
class Keys:
    """Key names for the fleet `fleet`."""

    fleet: str

    def __post_init__(self) -> None:
        if not self.fleet or any(c in self.fleet for c in "{}: \t\n"):
            raise ConfigError(
                f"fleet name {self.fleet!r} is invalid: use letters, digits, '-', '_' or '.'"
            )

    @cached_property
    def prefix(self) -> str:
        return f"gpufleet:{{{self.fleet}}}"

    # Index sets, one per kind of record.
    @property
    def gpus(self) -> str:
        return f"{self.prefix}:gpus"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def deployments(self) -> str:
        return f"{self.prefix}:deps"

    @property
    def hosts(self) -> str:
        return f"{self.prefix}:hosts"

    @property
    def learned(self) -> str:
        """Hash: model -> measured peak bytes."""
        return f"{self.prefix}:learned"

    @property
    def active(self) -> str:
        """Hash: model -> replicas on GPU (HOT, LOADING or DRAINING)."""
        return f"{self.prefix}:active"

    @property
    def changes(self) -> str:
        """Hash: model -> how many times its placed replicas changed (one placed or one
        leaving); a scale-out names the count its decision saw (commit.lua)."""
        return f"{self.prefix}:changes"

    @property
    def counted(self) -> str:
        """Set of models whose outcomes the router counted (hits need a replica record)."""
        return f"{self.prefix}:counted"

    @property
    def generating(self) -> str:
        """Set of models whose generating calls were recorded (`figures.generation`)."""
        return f"{self.prefix}:generating"

    @property
    def events(self) -> str:
        """Stream of placement changes."""
        return f"{self.prefix}:events"

    @property
    def tenants(self) -> str:
        """Hash: tenant name -> its record (`placement.ledger.tenancy.tenants`)."""
        return f"{self.prefix}:tenants"

    # Records.
    def tenant_running(self, name: str) -> str:
        """Sorted set: the calls of tenant `name` let past its quota, not answered yet ->
        when (ms; `placement.ledger.tenancy.quotas`)."""
        return f"{self.prefix}:tenant-running:{name}"

    def tenant_parked(self, name: str) -> str:
        """List: the messages of tenant `name`'s calls waiting for one of its running
        slots, oldest last (`placement.ledger.tenancy.quotas`)."""
        return f"{self.prefix}:tenant-parked:{name}"

    def tenant_handed_back(self, name: str) -> str:
        """String: the message of tenant `name` last handed back from its parked list to its
        public queue, behind which the next goes (`placement.ledger.tenancy.quotas`)."""
        return f"{self.prefix}:tenant-handed-back:{name}"

    def tenant_usage(self, name: str) -> str:
        """Hash: what tenant `name`'s calls used (`placement.ledger.tenancy.usage`)."""
        return f"{self.prefix}:tenant-usage:{name}"

    def gpu(self, gpu_id: str) -> str:
        return f"{self.prefix}:gpu:{gpu_id}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def worker_deployments(self, worker_id: str) -> str:
        """Set of replicas a worker holds on GPU or in CPU memory."""
        return f"{self.prefix}:worker:{worker_id}:deps"

    def control(self, worker_id: str) -> str:
        """List of replica ids a worker's keeper must look at now (docs/worker.md)."""
        return f"{self.prefix}:worker:{worker_id}:control"

    def deployment(self, replica: str) -> str:
        return f"{self.prefix}:dep:{replica}"

    def leases(self, replica: str) -> str:
        """Sorted set of request leases on a replica, scored by deadline (ms)."""
        return f"{self.prefix}:dep:{replica}:leases"

    def batch(self, replica: str) -> str:
        """How many calls the pass its worker runs now holds (absent: at most one)."""
        return f"{self.prefix}:dep:{replica}:batch"

    def kv_held(self, replica: str) -> str:
        """KV-cache tokens the generating batch on a replica holds now (absent: none)."""
        return f"{self.prefix}:dep:{replica}:kv"

    def generation(self, model: str) -> str:
        """Hash: a model's generating calls, tokens, and latency histogram buckets."""
        return f"{self.prefix}:model:{model}:generation"

    def model_cache(self, model: str) -> str:
        """Hash: a model's cache figures, histograms of its loads, restores, misses' waits
        and replicas' ages at eviction (`placement.ledger.figures.cache`)."""
        return f"{self.prefix}:model:{model}:cache"

    def model_replicas(self, model: str) -> str:
        return f"{self.prefix}:model:{model}:replicas"

    def model_stats(self, model: str) -> str:
        """Hash: request outcome (hit, queued, warm, cold, rejected, busy) -> count."""
        return f"{self.prefix}:model:{model}:stats"

    def prefixes(self, model: str) -> str:
        """Hash: a prompt prefix's digest -> the replica of the model it was last sent to
        (`placement.rules.prefixes`)."""
        return f"{self.prefix}:model:{model}:prefixes"

    def model_routing(self, model: str) -> str:
        """Sorted set of calls a router holds for a model, scored by deadline (ms)."""
        return f"{self.prefix}:model:{model}:routing"

    def host(self, host: str) -> str:
        return f"{self.prefix}:host:{host}"

    def host_warm(self, host: str) -> str:
        """Set of the WARM replicas in a host's CPU cache."""
        return f"{self.prefix}:host:{host}:warm"


class KeyList:
    """KEYS for one script call: each name once, referred to by its 1-based index.

    Scripts whose key set depends on the plan take a JSON argument that refers to
    keys by these indices, so the script never builds a key name itself.
    """

    def __init__(self, *fixed: str) -> None:
        self._index: dict[str, int] = {}
        for name in fixed:
            self.add(name)

    def add(self, name: str) -> int:
        """`name`'s index in KEYS, adding it the first time."""
        return self._index.setdefault(name, len(self._index) + 1)

    @property
    def names(self) -> list[str]:
        """KEYS, in index order."""
        return list(self._index)
