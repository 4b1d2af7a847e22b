"""Workers in a registry: they own their GPUs under a heartbeat lease, and are told.

A GPU worker registers its GPUs (refused while a live worker of another lineage owns
one), renews its lease with heartbeats that carry what it holds, reads the replica ids
its keeper must look at from its control list, and is reaped (everything it held
released) when its lease lapses or it shuts down.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis

from placement.errors import GpuOwnedError, LeaseLostError, RegistryError
from placement.ledger import records
from placement.ledger.keys import KeyList
from placement.ledger.store import Store, unreachable
from placement.policy.state import Gpu, Holding

log = logging.getLogger(__name__)

#: A GPU worker's lease: a silent worker's reservations are released after it
#: (GPUFLEET_WORKER_LEASE_MS).
DEFAULT_WORKER_LEASE_MS = 15_000


class Membership(Store):
    """The workers' part of a registry."""

    def register_worker(
        self,
        worker: str,
        host: str,
        queue: str,
        gpus: Sequence[Gpu],
        *,
        warm_budget: int = 0,
        lease_ms: int = DEFAULT_WORKER_LEASE_MS,
        lineage: str = "",
        contexts: Sequence[str] = (),
        process: Mapping[str, Any] | None = None,
        domain: str = "",
    ) -> int:
        """Own `gpus` (their id, index, name, total and context are read) and return the
        lease deadline.

        A GPU still owned by a worker whose lease expired is reaped first, and so is a live
        owner of the same `lineage` (a predecessor this process replaces, such as a pool
        child that died). A live owner of another lineage raises `GpuOwnedError`.
        `contexts` are other workers' GPUs this process keeps a CUDA context on (it
        registers again after losing its lease): each is charged as commit.lua would.
        `process` is the worker's process identity, kept for `worker_process`. `domain`
        names the processes that may read this worker's warm copies (`Gpu.domain`).
        """
        for _ in range(3):
            k = self.keys
            keys = KeyList()
            payload = {
                "worker": worker,
                "host": host,
                "queue": queue,
                "lineage": lineage,
                "process": json.dumps(dict(process or {})),
                "domain": domain,
                "lease_ms": lease_ms,
                "warm_budget": warm_budget,
                "workers": keys.add(k.workers),
                "worker_key": keys.add(k.worker(worker)),
                "gpus_set": keys.add(k.gpus),
                "hosts": keys.add(k.hosts),
                "host_key": keys.add(k.host(host)),
                "events": keys.add(k.events),
                "gpus": [
                    {
                        "id": g.id,
                        "key": keys.add(k.gpu(g.id)),
                        "index": g.index,
                        "name": g.name,
                        "total": g.total,
                        "context": g.context,
                    }
                    for g in gpus
                ],
                "contexts": [{"id": g, "key": keys.add(k.gpu(g))} for g in contexts],
            }
            result = self._run_json("register", keys, payload)
            if result[0] == 1:
                return int(result[1])
            reason, gpu_id, owner = result[1], result[2], result[3]
            if reason == "OWNED":
                raise GpuOwnedError(
                    f"GPU {gpu_id} is owned by live worker {owner} of fleet {self.keys.fleet!r} "
                    f"on this Redis; stop that fleet first. To run a second fleet beside it, "
                    f"give it a Redis database of its own (GPUFLEET_REDIS_URL="
                    f"redis://<host>:<port>/<db>); with simulated GPUs, GPUFLEET_HOST=<name> "
                    f"adds a host to this fleet instead"
                )
            self.reap(owner, force=reason == "REPLACE")
        raise RegistryError(f"could not register worker {worker}: its GPUs keep changing owner")

    def worker_process(self, worker: str) -> dict[str, Any] | None:
        """The process identity `worker` recorded when it registered (None: none)."""
        raw = self._one("hget", self.keys.worker(worker), "process")
        try:
            found = json.loads(raw) if raw else None
        except ValueError:
            return None
        return found if isinstance(found, dict) and found else None

    def owner(self, gpu_id: str) -> tuple[str, str] | None:
        """The live worker that owns `gpu_id` and its lineage, or None when none does."""
        record = self.gpu(gpu_id)
        if record is None or not record.alive(self.now_ms()):
            return None
        lineage = self._one("hget", self.keys.gpu(gpu_id), "lineage") or ""
        return record.worker, lineage

    def heartbeat(
        self,
        worker: str,
        gpu_ids: Iterable[str],
        lease_ms: int = DEFAULT_WORKER_LEASE_MS,
        holdings: Sequence[Holding] | None = None,
        pinned: int | None = None,
    ) -> int:
        """Renew the worker's lease and store what it holds, and the host memory it keeps
        pinned (None: leave the last figures); raise `LeaseLostError` if the lease already
        expired."""
        keys = [self.keys.worker(worker), *(self.keys.gpu(g) for g in gpu_ids)]
        report = records.holdings_json(holdings) if holdings is not None else ""
        pinned_arg = "" if pinned is None else str(int(pinned))
        result = self._run("heartbeat", keys, [worker, lease_ms, report, pinned_arg])
        if result[0] != 1:
            raise LeaseLostError(
                f"worker {worker} missed its lease; its reservations are released. "
                f"Drop resident models and register again."
            )
        return int(result[1])

    def reap(self, worker: str, *, force: bool = False) -> int | None:
        """Release all of `worker`'s reservations if its lease expired (or `force`).

        Returns the number of deployments released, or None if the worker is alive
        (without `force`) or already gone.
        """
        k = self.keys
        for _ in range(10):
            replicas = self.replicas_of(worker)
            reads = [("hmget", k.deployment(r), "gpus", "host") for r in replicas]
            (own_raw, contexts_raw), *recs = self._read(
                [("hmget", k.worker(worker), "gpus", "contexts"), *reads]
            )
            keys = KeyList()
            deps = []
            for r, (gpus_raw, host) in zip(replicas, recs, strict=True):
                held = json.loads(gpus_raw or "{}")
                deps.append(
                    {
                        "replica": r,
                        "dep": keys.add(k.deployment(r)),
                        "leases": keys.add(k.leases(r)),
                        "active": keys.add(k.active),
                        "changes": keys.add(k.changes),
                        "host": keys.add(k.host(host or "")),
                        "host_warm": keys.add(k.host_warm(host or "")),
                        "gpus": [{"id": g, "key": keys.add(k.gpu(g))} for g in held],
                    }
                )
            payload = {
                "worker": worker,
                "force": force,
                "workers": keys.add(k.workers),
                "worker_key": keys.add(k.worker(worker)),
                "worker_deps": keys.add(k.worker_deployments(worker)),
                "control": keys.add(k.control(worker)),
                "gpus_set": keys.add(k.gpus),
                "events": keys.add(k.events),
                "own": [{"id": g, "key": keys.add(k.gpu(g))} for g in json.loads(own_raw or "[]")],
                "contexts": [
                    {"id": g, "key": keys.add(k.gpu(g))} for g in json.loads(contexts_raw or "[]")
                ],
                "deps": deps,
            }
            result = self._run_json("reap", keys, payload)
            if result[0] == 1:
                log.info("released worker %s (%d deployments)", worker, result[1])
                return int(result[1])
            if result[1] in ("ALIVE", "GONE"):
                return None
        raise RegistryError(f"could not reap worker {worker}: its deployments keep changing")

    def reap_expired(self) -> list[str]:
        """Reap every worker whose lease has expired; return their ids."""
        now = self.now_ms()
        workers = sorted(self._one("smembers", self.keys.workers))
        deadlines = self._read([("hget", self.keys.worker(w), "lease_deadline") for w in workers])
        expired = [w for w, d in zip(workers, deadlines, strict=True) if int(d or 0) <= now]
        return [w for w in expired if self.reap(w) is not None]

    def next_control(self, worker: str, timeout_s: float) -> str | None:
        """The next replica a worker's keeper was told to look at (commit.lua, evict.lua
        push them), oldest first, waiting up to `timeout_s`; None when none came.

        Oldest first matters: a placement's victims are pushed before the placement, so the
        keeper frees the device before it asks to admit what waits for it.
        """
        try:
            popped = self.client.brpop([self.keys.control(worker)], timeout=timeout_s)
        except redis.ConnectionError as exc:
            raise unreachable(exc) from exc
        return str(popped[1]) if popped else None

    def replicas_of(self, worker: str) -> list[str]:
        """The replicas the ledger gives `worker` (on GPU, pending or in its CPU memory)."""
        return sorted(self._one("smembers", self.keys.worker_deployments(worker)))
