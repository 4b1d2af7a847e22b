"""What a replay measured: counters, latencies, utilisation over time, JSON and a PNG plot.

Definitions (every rate is per request of the trace):

- **hit**: the model had a HOT replica when the request arrived; it costs compute time.
- **queued**: the model was LOADING (another request started the load); the request
  waits for the load to finish. Neither a hit nor a load.
- **warm restore** / **cold load**: the request started a load, from the host's CPU
  warm cache or from disk. `first_loads` are a model's first load of the run
  (compulsory); every later load is a **reload**. `reload_rate = reloads / requests`.
- **rejected**: the policy could never place the model (`NeverFitsError`).
- **queueing time**: arrival until the model is ready (0 for hits); latency adds the
  compute time. With service time (`serving.py`) a hit may also wait behind the calls
  its replica runs first, and that wait counts as queueing too. Queue depth is the
  number of requests waiting at once; its time average is total queueing time /
  duration (Little's law).
- **scale outs / ins**: replicas the scaling rule placed and offloaded (`serving.py`);
  `memory_gib_s` is the GPU memory reserved, integrated over the trace's span.
- **utilisation**: GPU bytes reserved in the ledger / total GPU bytes, averaged over
  the trace's span (first to last arrival). `peak_utilization` counts instead the
  true peak of the models on GPU: what the GPUs would really hold. The gap between the
  two is memory reserved on a guess and never used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q`-th percentile (0-100) of sorted `values`; 0.0 when empty."""
    if not values:
        return 0.0
    rank = max(1, min(len(values), -(-len(values) * q // 100)))
    return float(values[int(rank) - 1])


@dataclass
class Recorder:
    """Counts events during a replay; `result` freezes them into a `RunResult`."""

    start: float
    end: float
    gpu_bytes: int
    buckets: int = 100
    hits: int = 0
    queued: int = 0
    warm_restores: int = 0
    cold_loads: int = 0
    first_loads: int = 0
    evictions_to_warm: int = 0
    evictions_to_cold: int = 0
    warm_drops: int = 0
    rejected: int = 0
    scale_outs: int = 0  # replicas placed or dropped by the scaling rule (serving.py)
    scale_ins: int = 0
    plans: int = 0
    plan_s: float = 0.0
    depth: int = 0
    max_depth: int = 0
    latencies: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # requests that waited at all
    b_requests: list[int] = field(default_factory=list)
    b_hits: list[int] = field(default_factory=list)
    b_area: list[float] = field(default_factory=list)
    b_peak_area: list[float] = field(default_factory=list)
    b_latencies: list[list[float]] = field(default_factory=list)
    _reserved: int = 0
    _peak: int = 0  # true peak bytes of the models on GPU
    _peak_area: float = 0.0
    _t: float = 0.0
    _area: float = 0.0

    def __post_init__(self) -> None:
        self.buckets = max(1, self.buckets)
        self.b_requests = [0] * self.buckets
        self.b_hits = [0] * self.buckets
        self.b_area = [0.0] * self.buckets
        self.b_peak_area = [0.0] * self.buckets
        self.b_latencies = [[] for _ in range(self.buckets)]
        self._t = self.start
        self._width = (self.end - self.start) / self.buckets or 1.0

    def bucket(self, t: float) -> int:
        """The timeline bucket of time `t` (clamped to the trace's span)."""
        return min(self.buckets - 1, max(0, int((t - self.start) / self._width)))

    def hit(self, t: float, compute: float, wait: float = 0.0) -> None:
        """A request served by a ready replica, after `wait` seconds behind other calls."""
        self.hits += 1
        self.latencies.append(wait + compute)
        if wait > 0:
            self.waits.append(wait)
        b = self.bucket(t)
        self.b_latencies[b].append(wait + compute)
        self.b_requests[b] += 1
        self.b_hits[b] += 1

    def waited(self, arrived: float, wait: float, compute: float) -> None:
        """A request that waited `wait` seconds for its model, then computed."""
        self.latencies.append(wait + compute)
        self.waits.append(wait)
        self.b_requests[self.bucket(arrived)] += 1
        self.b_latencies[self.bucket(arrived)].append(wait + compute)

    def reserve(self, t: float, delta: int, peak_delta: int = 0) -> None:
        """The ledger's reserved bytes change by `delta` at `t` (and the true peak bytes
        of the models on GPU by `peak_delta`); integrate up to `t`."""
        t = min(max(t, self._t), self.end)
        if t > self._t:
            self._area += self._reserved * (t - self._t)
            self._peak_area += self._peak * (t - self._t)
            first, last = self.bucket(self._t), self.bucket(t)
            for b in range(first, last + 1):
                lo = max(self._t, self.start + b * self._width)
                hi = min(t, self.start + (b + 1) * self._width) if b < self.buckets - 1 else t
                if hi > lo:
                    self.b_area[b] += self._reserved * (hi - lo)
                    self.b_peak_area[b] += self._peak * (hi - lo)
            self._t = t
        self._reserved += delta
        self._peak += peak_delta

    def enqueue(self) -> None:
        self.depth += 1
        self.max_depth = max(self.max_depth, self.depth)

    def result(self, policy: str, wall_s: float, requests: int) -> RunResult:
        """Close the books at the end of the trace."""
        self.reserve(self.end, 0)
        span = self.end - self.start
        self.latencies.sort()
        self.waits.sort()
        return RunResult(self, policy, wall_s, requests, span)


class RunResult:
    """The outcome of one policy on one trace."""

    def __init__(
        self, rec: Recorder, policy: str, wall_s: float, requests: int, span: float
    ) -> None:
        self.policy = policy
        self.rec = rec
        self.wall_s = wall_s
        self.requests = requests
        self.span = span

    @property
    def reloads(self) -> int:
        r = self.rec
        return r.warm_restores + r.cold_loads - r.first_loads

    @property
    def hit_rate(self) -> float:
        return self.rec.hits / self.requests if self.requests else 0.0

    @property
    def utilization(self) -> float:
        if self.span <= 0 or not self.rec.gpu_bytes:
            return 0.0
        return self.rec._area / (self.span * self.rec.gpu_bytes)

    @property
    def peak_utilization(self) -> float:
        if self.span <= 0 or not self.rec.gpu_bytes:
            return 0.0
        return self.rec._peak_area / (self.span * self.rec.gpu_bytes)

    def counts(self) -> dict[str, int]:
        """The event counters the hand-computed tests check."""
        r = self.rec
        return {
            "hits": r.hits,
            "queued": r.queued,
            "warm_restores": r.warm_restores,
            "cold_loads": r.cold_loads,
            "evictions": r.evictions_to_warm + r.evictions_to_cold,
            "rejected": r.rejected,
        }

    def summary(self) -> dict[str, Any]:
        """The JSON object of this run (see the module docstring for definitions)."""
        r = self.rec
        n = self.requests or 1
        lat = [x * 1000 for x in r.latencies]
        # Hits waited 0: pad the sorted non-zero waits with them for the percentiles.
        zeros = len(r.latencies) - len(r.waits)
        waits = [0.0] * zeros + [w * 1000 for w in r.waits]
        total_wait = sum(r.waits)
        return {
            "requests": self.requests,
            "hits": r.hits,
            "hit_rate": round(self.hit_rate, 6),
            "queued": r.queued,
            "warm_restores": r.warm_restores,
            "cold_loads": r.cold_loads,
            "first_loads": r.first_loads,
            "reloads": self.reloads,
            "reload_rate": round(self.reloads / n, 6),
            "evictions": r.evictions_to_warm + r.evictions_to_cold,
            "evictions_to_warm": r.evictions_to_warm,
            "evictions_to_cold": r.evictions_to_cold,
            "warm_drops": r.warm_drops,
            "rejected": r.rejected,
            "scale_outs": r.scale_outs,
            "scale_ins": r.scale_ins,
            "utilization": round(self.utilization, 6),
            "memory_gib_s": round(r._area / 2**30, 1),  # GPU memory reserved x time
            "peak_utilization": round(self.peak_utilization, 6),
            "p50_ms": round(percentile(lat, 50), 3),
            "p95_ms": round(percentile(lat, 95), 3),
            "p99_ms": round(percentile(lat, 99), 3),
            "mean_ms": round(sum(lat) / len(lat), 3) if lat else 0.0,
            "queue_mean_ms": round(1000 * total_wait / len(lat), 3) if lat else 0.0,
            "queue_p95_ms": round(percentile(waits, 95), 3),
            "queue_p99_ms": round(percentile(waits, 99), 3),
            "queue_depth_mean": round(total_wait / self.span, 4) if self.span > 0 else 0.0,
            "queue_depth_max": r.max_depth,
            "plans": r.plans,
            "plan_us_mean": round(1e6 * r.plan_s / r.plans, 1) if r.plans else 0.0,
            "wall_s": round(self.wall_s, 3),
        }

    def timeline(self) -> dict[str, list[float]]:
        """Per-bucket time (s from start), hit rate and utilisation, for the plot."""
        r = self.rec
        width = r._width
        return {
            "t_s": [(b + 0.5) * width for b in range(r.buckets)],
            "hit_rate": [
                h / q if q else float("nan") for h, q in zip(r.b_hits, r.b_requests, strict=True)
            ],
            "utilization": [a / (width * r.gpu_bytes) for a in r.b_area],
            "peak_utilization": [a / (width * r.gpu_bytes) for a in r.b_peak_area],
            "p95_ms": [
                1000 * percentile(sorted(b), 95) if b else float("nan") for b in r.b_latencies
            ],
        }


def plot(
    results: Mapping[str, RunResult], path: Path, title: str = "", latency: bool = False
) -> Path:
    """Write a PNG of hit rate and GPU memory utilisation over time, one colour per policy.

    The memory panel draws reserved bytes solid and the true peak of the models on GPU
    dashed: the gap is memory reserved on a guess. With `latency`, a last panel draws
    each bucket's p95 latency (log scale).

        matplotlib is imported here only (the `sim` extra), so the simulator runs without it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from placement.errors import ConfigError

        raise ConfigError("plotting needs matplotlib: pip install 'gpufleet[sim]'") from exc
    rows = 3 if latency else 2
    fig, axes = plt.subplots(rows, 1, sharex=True, figsize=(9, 3.25 * rows))
    top, bottom = axes[0], axes[1]
    for name, result in results.items():
        line = result.timeline()
        hours = [t / 3600 for t in line["t_s"]]
        top.plot(hours, line["hit_rate"], label=name, linewidth=1.2)
        (drawn,) = bottom.plot(hours, line["utilization"], label=name, linewidth=1.2)
        bottom.plot(
            hours, line["peak_utilization"], color=drawn.get_color(), linestyle="--", linewidth=1
        )
        if latency:
            axes[2].plot(hours, line["p95_ms"], label=name, linewidth=1.2)
    if latency:
        axes[2].set_yscale("log")
        axes[2].set_ylabel("p95 latency (ms)")
        axes[2].grid(alpha=0.3)
    top.set_ylabel("hit rate")
    top.set_ylim(0, 1.02)
    top.grid(alpha=0.3)
    top.legend(loc="lower right", ncol=3, fontsize=8)
    bottom.set_ylabel("GPU memory / total\n(reserved solid, true peak dashed)")
    bottom.set_ylim(0, 1.02)
    axes[-1].set_xlabel("time (hours)")
    bottom.grid(alpha=0.3)
    if title:
        top.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
