"""The worker lease against a real Redis: register, heartbeat, lose, recover, leave.

Leases that must lapse or renew last 300 ms (a heartbeat every 100 ms), so a lapse takes
a fraction of a second; the others last 3 s, so a loaded machine cannot lapse them.
Outages are simulated by a registry whose calls fail while `down` is set.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis

from placement.errors import ConfigError, GpuOwnedError, RegistryError
from placement.ledger.audit import audit
from placement.ledger.registry import Registry
from placement.policy.state import Demand, Gpu, Level
from worker import identity
from worker.devices import Device, simulated_devices
from worker.lifecycle import (
    EXIT_RESTART,
    WorkerLease,
    is_fatal_cuda_error,
    live_owner,
    make_worker_id,
)

GiB = 2**30
SHORT_MS = 300  # for tests about lapsing and renewing: a heartbeat every 100 ms
LONG_MS = 3000  # for tests about something else: no lapse even on a loaded machine
ROOT = Path(__file__).resolve().parent.parent


class FlakyRegistry(Registry):
    """A real registry whose worker calls fail, as if Redis were down, while `down` is set."""

    down = False
    refused = 0  # calls that failed while down

    def _check(self) -> None:
        if self.down:
            self.refused += 1
            raise RegistryError("registry unreachable: connection refused (simulated)")

    def heartbeat(self, *args: Any, **kwargs: Any) -> int:
        self._check()
        return super().heartbeat(*args, **kwargs)

    def register_worker(self, *args: Any, **kwargs: Any) -> int:
        self._check()
        return super().register_worker(*args, **kwargs)

    def reap(self, worker: str, *, force: bool = False) -> int | None:
        self._check()
        return super().reap(worker, force=force)


@pytest.fixture
def reg(redis_url: str, fleet: str) -> Iterator[FlakyRegistry]:
    registry = FlakyRegistry(redis.Redis.from_url(redis_url, decode_responses=True), fleet)
    yield registry
    registry.client.close()


@pytest.fixture(autouse=True)
def no_heartbeat_outlives_its_test() -> Iterator[None]:
    yield
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("gpufleet-lease")]
    )


class Losses:
    """An `on_lost` callback that counts its calls."""

    def __init__(self) -> None:
        self.count = 0
        self.called = threading.Event()

    def __call__(self) -> None:
        self.count += 1
        self.called.set()


def make_lease(
    reg: Registry,
    devices: Sequence[Device] | None = None,
    on_lost: Callable[[], None] | None = None,
    worker: str = "w0",
    lease_ms: int = LONG_MS,
) -> WorkerLease:
    return WorkerLease(
        reg,
        worker,
        "h0",
        "q-w0",
        simulated_devices("2x8GiB") if devices is None else devices,
        warm_budget=4 * GiB,
        lease_ms=lease_ms,
        on_lost=on_lost,
    )


def wait_until(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def kinds(reg: Registry, kind: str) -> list[dict[str, str]]:
    return [e for e in reg.events() if e["kind"] == kind]


def alive_gpus(reg: Registry, worker: str) -> list[str]:
    snap = reg.snapshot()
    return sorted(g.id for g in snap.gpus.values() if g.worker == worker and g.alive(snap.now_ms))


def place_hot(reg: Registry) -> str:
    plan = reg.place(Demand(model="m", size=GiB), rng=random.Random(0))
    assert reg.confirm(plan.replica, plan.worker, plan.epoch)
    return plan.replica


# --- names ------------------------------------------------------------------------------------


def test_a_worker_id_names_its_gpus_and_host_and_is_new_every_time() -> None:
    real = [Device(i, f"GPU-{i}", "NVIDIA H100", 80 * GiB, cuda_index=i) for i in (0, 1, 2, 3, 6)]
    first = make_worker_id("node-1.lab", real[:1])
    assert first.startswith("gpu0@node-1.lab-") and len(first) == len("gpu0@node-1.lab-") + 6
    assert make_worker_id("node-1.lab", real[:1]) != first
    assert make_worker_id("h", real).startswith("gpu0-3_6@h-")
    assert make_worker_id("h", simulated_devices("2x8GiB")).startswith("sim0_1@h-")


def test_a_worker_id_keeps_only_celery_node_name_characters() -> None:
    worker = make_worker_id("my host/{x}@y", simulated_devices("8GiB"))
    assert worker.startswith("sim0@my-host-x-y-")
    assert all(c.isascii() and (c.isalnum() or c in "._@-") for c in worker)


# --- registration and heartbeats ------------------------------------------------------------


def test_a_started_lease_registers_every_gpu_of_the_worker(reg: FlakyRegistry) -> None:
    with make_lease(reg) as lease:
        assert lease.registered
        assert lease.gpu_ids == ("h0:sim0", "h0:sim1")
        snap = reg.snapshot()
        assert {g: (v.worker, v.queue, v.host, v.total) for g, v in snap.gpus.items()} == {
            "h0:sim0": ("w0", "q-w0", "h0", 8 * GiB),
            "h0:sim1": ("w0", "q-w0", "h0", 8 * GiB),
        }
        assert snap.hosts["h0"].warm_budget == 4 * GiB
        assert lease.deadline_ms == snap.gpus["h0:sim0"].lease_deadline_ms


def test_heartbeats_keep_a_short_lease_alive_well_past_its_length(reg: FlakyRegistry) -> None:
    losses = Losses()
    # 600 ms: a heartbeat every 200 ms, so a thread held up to 400 ms (a full garbage
    # collection in a process that imported torch took 159 ms) still renews it in time
    lease_ms = 2 * SHORT_MS
    with make_lease(reg, on_lost=losses, lease_ms=lease_ms) as lease:
        first = lease.deadline_ms
        for _ in range(3):  # three lease lengths
            time.sleep(lease_ms / 1000)
            assert reg.reap_expired() == []  # a router finds nothing to reap
            assert alive_gpus(reg, "w0") == ["h0:sim0", "h0:sim1"]
        assert lease.deadline_ms >= first + 2 * lease_ms
    assert losses.count == 0


def test_a_gpu_owned_by_a_live_worker_stops_the_start(reg: FlakyRegistry) -> None:
    with make_lease(reg, worker="w0"):
        other = make_lease(reg, worker="w1")
        with pytest.raises(GpuOwnedError, match="owned by live worker w0"):
            other.start()
        assert not other.registered
        assert alive_gpus(reg, "w0") == ["h0:sim0", "h0:sim1"]


def test_a_live_owner_whose_processes_are_gone_is_taken_over_at_once_a_running_one_is_not(
    reg: FlakyRegistry,
) -> None:
    gpus = [d.to_gpu("h0") for d in simulated_devices("8GiB")]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        crashed = identity.describe([proc.pid])
    finally:
        proc.kill()
        proc.wait()
    reg.register_worker("crashed", "h0", "q0", gpus, lease_ms=60_000, process=crashed)
    replica = place_hot(reg)
    assert live_owner(reg, "h0:sim0") is None  # its lease runs for a minute more
    assert reg.owner("h0:sim0") is None  # reaped: its GPU is nobody's
    assert reg.snapshot().deployments[replica].level is Level.COLD  # what it held, handed back
    reg.register_worker("running", "h0", "q0", gpus, process=identity.current())
    owner = live_owner(reg, "h0:sim0")
    assert owner is not None and owner.worker == "running"
    assert f"process {os.getpid()} still runs" in owner.why
    assert reg.snapshot().gpus["h0:sim0"].worker == "running"


def test_a_lease_cannot_be_started_twice(reg: FlakyRegistry) -> None:
    with make_lease(reg) as lease, pytest.raises(RuntimeError, match="already started"):
        lease.start()


def test_a_lease_shorter_than_a_heartbeat_can_renew_is_refused(reg: FlakyRegistry) -> None:
    with pytest.raises(ConfigError, match="at least 30 ms"):
        WorkerLease(reg, "w0", "h0", "q", simulated_devices("8GiB"), warm_budget=0, lease_ms=10)


# --- leaving ------------------------------------------------------------------------------------


def test_stop_releases_every_gpu_and_replica_at_once(reg: FlakyRegistry) -> None:
    with make_lease(reg) as lease:
        replica = place_hot(reg)
        lease.stop()
    snap = reg.snapshot()
    assert snap.gpus == {}
    assert snap.deployments[replica].level is Level.COLD
    assert "w0" not in reg.client.smembers(reg.keys.workers)
    assert [(e["worker"], e["cause"]) for e in kinds(reg, "reaped")] == [("w0", "shutdown")]
    assert [e["replica"] for e in kinds(reg, "released")] == [replica]
    assert not lease.registered


def test_stop_is_idempotent_and_needs_no_start(reg: FlakyRegistry) -> None:
    lease = make_lease(reg).start()
    lease.stop()
    lease.stop()
    make_lease(reg, worker="never-started").stop()
    assert len(kinds(reg, "reaped")) == 1


def test_stop_without_a_registry_leaves_the_lease_to_lapse(reg: FlakyRegistry) -> None:
    lease = make_lease(reg, lease_ms=SHORT_MS).start()
    reg.down = True
    lease.stop()  # logs a warning, raises nothing
    reg.down = False
    time.sleep(SHORT_MS / 1000 + 0.05)
    assert reg.reap_expired() == ["w0"]


# --- losing the lease ---------------------------------------------------------------------------


def test_a_lease_the_registry_expired_calls_on_lost_once_then_registers_again(
    reg: FlakyRegistry,
) -> None:
    losses = Losses()
    with make_lease(reg, on_lost=losses, lease_ms=600) as lease:
        replica = place_hot(reg)
        reg.client.hset(reg.keys.worker("w0"), "lease_deadline", 0)  # as if it froze
        wait_until(lambda: len(kinds(reg, "registered")) == 2 and lease.registered)
        time.sleep(0.4)  # and it stays registered: one loss, one recovery
        assert (losses.count, lease.losses) == (1, 1)
        assert len(kinds(reg, "registered")) == 2
        assert alive_gpus(reg, "w0") == ["h0:sim0", "h0:sim1"]
        # The replica it held is released, not resurrected by the new lease.
        snap = reg.snapshot()
        assert snap.deployments[replica].level is Level.COLD
        assert all(g.reserved == 0 for g in snap.gpus.values())


def test_a_lease_a_router_reaped_calls_on_lost_once_then_registers_again(
    reg: FlakyRegistry,
) -> None:
    losses = Losses()
    with make_lease(reg, on_lost=losses, lease_ms=600) as lease:
        reg.client.hset(reg.keys.worker("w0"), "lease_deadline", 0)
        assert reg.reap_expired() == ["w0"]
        assert losses.called.wait(2)
        wait_until(lambda: lease.registered)
        assert alive_gpus(reg, "w0") == ["h0:sim0", "h0:sim1"]
        assert losses.count == 1


def test_a_lease_registering_again_declares_the_cuda_contexts_its_process_keeps_elsewhere(
    reg: FlakyRegistry,
) -> None:
    sim0, sim1 = (replace(d, context=GiB) for d in simulated_devices("2x8GiB"))
    opened: list[str] = []  # what the process's CUDA state would say: none until it loads

    def contexts() -> list[str]:
        return list(opened)

    other = WorkerLease(reg, "w1", "h0", "q-w1", [sim1], warm_budget=0, lease_ms=LONG_MS)
    mine = WorkerLease(
        reg, "w0", "h0", "q-w0", [sim0], warm_budget=0, lease_ms=600, contexts=contexts
    )
    with other, mine:
        assert reg.snapshot().gpus["h0:sim1"].contexts == {}
        opened += ["h0:sim0", "h0:sim1"]  # it loaded a shard onto w1's GPU
        reg.client.hset(reg.keys.worker("w0"), "lease_deadline", 0)
        assert reg.reap_expired() == ["w0"]
        wait_until(lambda: mine.losses == 1 and mine.registered)
        snap = reg.snapshot()
        assert snap.gpus["h0:sim1"].contexts == {"w0": GiB}  # its own GPU charges none
        assert (snap.gpus["h0:sim1"].reserved, snap.gpus["h0:sim0"].reserved) == (GiB, 0)
        assert audit(snap) == []
    assert reg.snapshot().gpus == {}  # both stopped: every charge given back


def test_a_failing_on_lost_does_not_stop_the_recovery(reg: FlakyRegistry) -> None:
    def on_lost() -> None:
        raise RuntimeError("the model manager broke")

    with make_lease(reg, on_lost=on_lost, lease_ms=600) as lease:
        reg.client.hset(reg.keys.worker("w0"), "lease_deadline", 0)
        wait_until(lambda: lease.losses == 1 and lease.registered)


def test_a_registry_outage_shorter_than_the_lease_loses_nothing(reg: FlakyRegistry) -> None:
    losses = Losses()
    with make_lease(reg, on_lost=losses, lease_ms=3000) as lease:
        began = time.monotonic()
        reg.down = True
        wait_until(lambda: reg.refused >= 1)  # a heartbeat missed (one is due every 1 s)
        reg.down = False
        assert time.monotonic() - began < 3.0  # the outage was shorter than the lease
        renewed = lease.deadline_ms
        wait_until(lambda: lease.deadline_ms > renewed)  # the next heartbeat renews it
        assert lease.registered
        assert losses.count == 0
        assert len(kinds(reg, "registered")) == 1


def test_a_registry_outage_longer_than_the_lease_loses_it_once_and_recovers(
    reg: FlakyRegistry,
) -> None:
    losses = Losses()
    with make_lease(reg, on_lost=losses, lease_ms=SHORT_MS) as lease:
        reg.down = True
        assert losses.called.wait(2)
        assert not lease.registered
        time.sleep(2 * SHORT_MS / 1000)  # still down: the loss is reported only once
        assert losses.count == 1
        reg.down = False
        wait_until(lambda: lease.registered)
        assert alive_gpus(reg, "w0") == ["h0:sim0", "h0:sim1"]
        assert losses.count == 1


# --- fatal CUDA errors ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch() -> Any:
    """torch, imported only by the tests that need its exception types (it is slow)."""
    return pytest.importorskip("torch")


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
        "reported at some other API call, so the stacktrace below might be incorrect.",
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: unspecified launch failure",
        "CUDA error: misaligned address",
        "CUDA error: an illegal instruction was encountered",
        "CUDA error: uncorrectable ECC error encountered",
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, ...)`",
    ],
)
def test_a_sticky_cuda_error_is_fatal(message: str, torch: Any) -> None:
    assert is_fatal_cuda_error(RuntimeError(message))
    assert is_fatal_cuda_error(torch.AcceleratorError(message))  # what torch >= 2.8 raises


def test_a_fatal_cuda_error_is_found_behind_the_exception_it_caused() -> None:
    try:
        try:
            raise RuntimeError("CUDA error: device-side assert triggered")
        except RuntimeError as exc:
            raise ValueError("inference failed") from exc
    except ValueError as outer:
        assert is_fatal_cuda_error(outer)


def test_out_of_memory_is_recoverable_not_fatal(torch: Any) -> None:
    assert not is_fatal_cuda_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    # Even when its text mentions a sticky error, an OOM is still an OOM.
    assert not is_fatal_cuda_error(torch.OutOfMemoryError("unspecified launch failure"))
    assert not is_fatal_cuda_error(RuntimeError("CUDA error: out of memory"))


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("Expected all tensors to be on the same device"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
        ValueError("device-side assert triggered"),  # not an error CUDA raises
        KeyError("model"),
    ],
)
def test_ordinary_errors_are_not_fatal(exc: BaseException) -> None:
    assert not is_fatal_cuda_error(exc)


_CHILD = """
import sys
from placement.ledger.registry import Registry
from worker.devices import simulated_devices
from worker.lifecycle import WorkerLease, exit_for_restart
reg = Registry.from_url(sys.argv[1], sys.argv[2])
WorkerLease(reg, "w0", "h0", "q", simulated_devices("8GiB"), warm_budget=0).start()
try:
    raise RuntimeError("CUDA error: device-side assert triggered")
except RuntimeError as exc:
    exit_for_restart(exc)
print("still alive")
"""


def test_exit_for_restart_ends_the_process_with_70_and_releases_its_lease(
    reg: FlakyRegistry, redis_url: str, fleet: str
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, redis_url, fleet],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == EXIT_RESTART == 70, proc.stderr
    assert "still alive" not in proc.stdout
    assert "device-side assert triggered" in proc.stderr  # the critical log, with traceback
    # The 15 s lease was released at once, so a replacement can take the GPU now.
    assert [(e["worker"], e["cause"]) for e in kinds(reg, "reaped")] == [("w0", "shutdown")]
    assert reg.snapshot().gpus == {}
    reg.register_worker("w1", "h0", "q", [Gpu("h0:sim0", "h0", 0, "Simulated 8 GiB", 8 * GiB)])
