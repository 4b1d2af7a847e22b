"""Request traces: (arrival time, model) pairs, synthetic or replayed from Azure.

Four workloads, all seeded so a run replays exactly:

- `zipf`: Zipf(alpha) popularity over the catalog, Poisson arrivals at `rate`.
- `bursty`: on/off arrivals. ON periods (exponential length) send requests at a
  high rate, mostly to a small *hot set* of models drawn for that burst; OFF periods
  send a trickle of background Zipf traffic. The working set moves from burst to burst,
  which is what punishes a policy that keeps the wrong models.
- `azure-conv`, `azure-code`: the real arrival times of the Azure LLM inference trace
  2023 (Splitwise, ISCA 2024; CC-BY 4.0). The trace has no model ids, so each request
  is mapped to a model by a seeded Zipf(alpha) draw. When more requests are asked for
  than the trace holds, the trace is tiled end to end (each copy shifted by the
  trace's length plus its mean gap), which keeps its burst structure.

Popularity ranks are a seeded permutation of the catalog, so popularity does not
follow model size or name.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from placement.config import Settings
from placement.errors import ConfigError

WORKLOADS = ("zipf", "bursty", "hotspot", "azure-conv", "azure-code")

#: Where the Azure CSVs live: $GPUFLEET_SIM_DATA, else ../shared/data beside the repository.
DATA_ENV = "GPUFLEET_SIM_DATA"
AZURE_FILES = {
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
}


@dataclass(frozen=True)
class Trace:
    """A request trace: `times[i]` (seconds from the start, non-decreasing) asks for
    model index `models[i]` of the fleet's catalog."""

    name: str
    times: Sequence[float]
    models: Sequence[int]
    params: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.times) != len(self.models):
            raise ConfigError("a trace needs one model per arrival time")
        if any(b < a for a, b in itertools.pairwise(self.times)):
            raise ConfigError("trace arrival times must not decrease")

    def __len__(self) -> int:
        return len(self.times)

    @property
    def duration(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.times[-1] - self.times[0] if self.times else 0.0

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary for reports."""
        return {
            "name": self.name,
            "requests": len(self),
            "duration_s": round(self.duration, 3),
            "models_used": len(set(self.models)),
            **self.params,
        }


def zipf_cum_weights(n: int, alpha: float) -> list[float]:
    """Cumulative Zipf weights of ranks 1..n (`1 / rank**alpha`), for `random.choices`."""
    if n < 1:
        raise ConfigError("a workload needs at least one model")
    if alpha < 0:
        raise ConfigError("the Zipf exponent alpha must be >= 0")
    return list(itertools.accumulate(1.0 / (rank**alpha) for rank in range(1, n + 1)))


def zipf_draw(n_models: int, count: int, alpha: float, rng: random.Random) -> list[int]:
    """`count` model indices with Zipf(alpha) popularity over a seeded rank permutation."""
    ranks = list(range(n_models))
    rng.shuffle(ranks)  # rank r is model ranks[r]
    drawn = rng.choices(range(n_models), cum_weights=zipf_cum_weights(n_models, alpha), k=count)
    return [ranks[r] for r in drawn]


def _poisson_times(count: int, rate: float, rng: random.Random, start: float = 0.0) -> list[float]:
    if rate <= 0:
        raise ConfigError("an arrival rate must be > 0")
    gaps = (rng.expovariate(rate) for _ in range(count))
    return list(itertools.accumulate(gaps, initial=start))[1:]


def zipf_poisson(
    n_models: int, requests: int, *, alpha: float = 1.0, rate: float = 5.0, seed: int = 0
) -> Trace:
    """Zipf(alpha) popularity with Poisson arrivals at `rate` requests per second."""
    rng = random.Random(f"zipf:{seed}")
    models = zipf_draw(n_models, requests, alpha, rng)
    times = _poisson_times(requests, rate, rng)
    return Trace("zipf", times, models, {"alpha": alpha, "rate_per_s": rate, "seed": seed})


def bursty(
    n_models: int,
    requests: int,
    *,
    alpha: float = 1.0,
    seed: int = 0,
    rate_on: float = 20.0,
    rate_off: float = 1.0,
    mean_on_s: float = 30.0,
    mean_off_s: float = 90.0,
    hot_set: int = 5,
    hot_share: float = 0.8,
) -> Trace:
    """On/off arrivals with a moving hot set.

    Periods alternate ON (length ~ Exp(mean_on_s), Poisson at `rate_on`) and OFF
    (~ Exp(mean_off_s), Poisson at `rate_off`). Each ON period draws `hot_set` models
    by Zipf(alpha) popularity; `hot_share` of its requests go uniformly to them and the
    rest follow the background Zipf(alpha). OFF requests are all background.
    """
    if not 0 <= hot_share <= 1:
        raise ConfigError("hot_share must be in [0, 1]")
    rng = random.Random(f"bursty:{seed}")
    ranks = list(range(n_models))
    rng.shuffle(ranks)
    cum = zipf_cum_weights(n_models, alpha)
    total = cum[-1]

    def background() -> int:
        return ranks[bisect.bisect_left(cum, rng.random() * total)]

    times: list[float] = []
    models: list[int] = []
    now, on = 0.0, True
    while len(times) < requests:
        end = now + rng.expovariate(1.0 / (mean_on_s if on else mean_off_s))
        hot = [background() for _ in range(hot_set)] if on and hot_set > 0 else []
        rate = rate_on if on else rate_off
        t = now + rng.expovariate(rate)
        while t < end and len(times) < requests:
            times.append(t)
            models.append(rng.choice(hot) if hot and rng.random() < hot_share else background())
            t += rng.expovariate(rate)
        now, on = end, not on
    params: dict[str, object] = {
        "alpha": alpha,
        "seed": seed,
        "rate_on_per_s": rate_on,
        "rate_off_per_s": rate_off,
        "mean_on_s": mean_on_s,
        "mean_off_s": mean_off_s,
        "hot_set": hot_set,
        "hot_share": hot_share,
    }
    return Trace("bursty", times, models, params)


def hotspot(
    n_models: int,
    requests: int,
    *,
    alpha: float = 1.0,
    seed: int = 0,
    rate: float = 5.0,
    rate_hot: float = 25.0,
    mean_on_s: float = 20.0,
    mean_off_s: float = 60.0,
) -> Trace:
    """One model's bursts exceed what one replica serves, over a Zipf(alpha) background.

    Background requests arrive as `zipf` does (Poisson at `rate`). One model, drawn by
    popularity, also gets bursts: ON periods (~ Exp(mean_on_s)) of Poisson arrivals at
    `rate_hot`, more than one replica at 100 ms a call can serve (10 per second), apart
    by OFF periods (~ Exp(mean_off_s)) without them.
    """
    rng = random.Random(f"hotspot:{seed}")
    background = zipf_poisson(n_models, requests, alpha=alpha, rate=rate, seed=seed)
    hot = zipf_draw(n_models, 1, alpha, rng)[0]
    end = background.times[-1]
    bursts: list[float] = []
    now, on = rng.expovariate(1.0 / mean_off_s), True
    while now < end:
        stop = now + rng.expovariate(1.0 / (mean_on_s if on else mean_off_s))
        if on:
            t = now + rng.expovariate(rate_hot)
            while t < min(stop, end):
                bursts.append(t)
                t += rng.expovariate(rate_hot)
        now, on = stop, not on
    merged = sorted(
        [(t, m) for t, m in zip(background.times, background.models, strict=True)]
        + [(t, hot) for t in bursts]
    )[:requests]
    params: dict[str, object] = {
        "alpha": alpha,
        "seed": seed,
        "rate_per_s": rate,
        "hot_model": hot,
        "rate_hot_per_s": rate_hot,
        "mean_on_s": mean_on_s,
        "mean_off_s": mean_off_s,
    }
    return Trace("hotspot", [t for t, _ in merged], [m for _, m in merged], params)


def default_data_dir() -> Path:
    """$GPUFLEET_SIM_DATA, else `../shared/data` beside the repository root."""
    configured = Settings.from_env().sim_data
    if configured is not None:
        return configured
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _parse_timestamp(text: str) -> float:
    """Seconds since the epoch of "2023-11-16 18:17:03.9799600" (7 fractional digits)."""
    whole, _, frac = text.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float(f"0.{frac}") if frac else 0.0)


def load_azure_times(path: Path) -> list[float]:
    """Arrival times (seconds from the first request, sorted) of an Azure LLM trace CSV.

    The file has a `TIMESTAMP` column; the token columns are ignored.
    """
    if not path.is_file():
        raise ConfigError(
            f"Azure trace {path} not found: pass --data-dir (or set ${DATA_ENV}) to the folder "
            f"holding {', '.join(AZURE_FILES.values())}"
        )
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames is None or "TIMESTAMP" not in reader.fieldnames:
            raise ConfigError(f"{path} has no TIMESTAMP column")
        stamps = sorted(_parse_timestamp(row["TIMESTAMP"]) for row in reader if row["TIMESTAMP"])
    if not stamps:
        raise ConfigError(f"{path} holds no requests")
    first = stamps[0]
    return [s - first for s in stamps]


def tile(times: Sequence[float], count: int) -> list[float]:
    """`count` arrival times: `times` repeated end to end, each copy shifted by the
    trace's span plus its mean gap (so copies never overlap)."""
    if not times:
        raise ConfigError("cannot tile an empty trace")
    span = times[-1] - times[0]
    gap = span / (len(times) - 1) if len(times) > 1 else 1.0
    out: list[float] = []
    copy = 0
    while len(out) < count:
        shift = copy * (span + gap)
        out.extend(t + shift for t in times[: count - len(out)])
        copy += 1
    return out


def azure(
    kind: str,
    n_models: int,
    requests: int | None = None,
    *,
    alpha: float = 1.0,
    seed: int = 0,
    data_dir: Path | None = None,
    path: Path | None = None,
) -> Trace:
    """The Azure trace `kind` ("azure-conv" or "azure-code"), its requests mapped to
    models by a seeded Zipf(alpha) draw. `requests=None` replays the trace once."""
    if kind not in AZURE_FILES:
        raise ConfigError(f"unknown Azure trace {kind!r}: use one of {', '.join(AZURE_FILES)}")
    source = path or (data_dir or default_data_dir()) / AZURE_FILES[kind]
    base = load_azure_times(source)
    count = len(base) if requests is None else requests
    times = tile(base, count)
    models = zipf_draw(n_models, count, alpha, random.Random(f"{kind}:{seed}"))
    params: dict[str, object] = {
        "alpha": alpha,
        "seed": seed,
        "source": source.name,
        "trace_requests": len(base),
        "tiled": count > len(base),
    }
    return Trace(kind, times, models, params)


def make_workload(
    name: str,
    n_models: int,
    requests: int | None = None,
    *,
    alpha: float = 1.0,
    seed: int = 0,
    data_dir: Path | None = None,
) -> Trace:
    """Build workload `name` (one of `WORKLOADS`) over `n_models` models.

    `requests=None` means the workload's natural length: 100,000 requests for the
    synthetic ones, one pass over the trace for Azure.
    """
    if requests is not None and requests < 1:
        raise ConfigError("--requests must be >= 1")
    if name == "zipf":
        return zipf_poisson(n_models, requests or 100_000, alpha=alpha, seed=seed)
    if name == "bursty":
        return bursty(n_models, requests or 100_000, alpha=alpha, seed=seed)
    if name == "hotspot":
        return hotspot(n_models, requests or 100_000, alpha=alpha, seed=seed)
    if name in AZURE_FILES:
        return azure(name, n_models, requests, alpha=alpha, seed=seed, data_dir=data_dir)
    raise ConfigError(f"unknown workload {name!r}: use one of {', '.join(WORKLOADS)}")
