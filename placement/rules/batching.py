"""Which waiting calls share one forward pass: the batching limits and the rule that groups.

A GPU worker runs one pool job at a time. While it runs, the calls that reach its
queue wait in the worker's main process; when the job ends, the next job takes the
oldest waiting call and every other call for the same replica (and placement epoch)
behind it, up to `size` calls and `chars` characters of input in all, and no more than
its replica's last jobs say runs in `JOB_MS` (`JobCost`) when the caller asks for that
bound (a GPU worker while the fleet has tenants: `tasks.serving.batching`). That bound
is what a call arriving while a job runs waits for: without it, a tenant's burst of calls
of many inputs made jobs of 32 such calls (over a second of MiniLM on a CPU), and another
tenant's call waited for one and then shared the next. Where a job of 32 calls takes
less (a GPU's, reasoned, not measured), `size` and `chars` bind first. With `wait_ms`
above 0, a batch smaller than `size` waits up to that long after its oldest call
arrived for more to come (Triton's `max_queue_delay`, Ray Serve's
`batch_wait_timeout_s`); the default 0 never delays a lone call, and batches form from
the calls that queue while the GPU is busy, as in text-embeddings-inference.

Pure: the Celery side (`tasks.serving.batching`) keeps the queue and runs the jobs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from placement.errors import ConfigError
from placement.rules.costs import fit
from placement.units.durations import format_duration_ms, parse_duration_ms

DEFAULT_SIZE = 32
DEFAULT_CHARS = 32_768
DEFAULT_WAIT_MS = 0
UNBATCHED_TASKS = frozenset({"text-generation"})  # see docs/tasks.md, "Batched calls"
#: The longest a batch job should run while the fleet has tenants, as its replica's last
#: jobs predict it: what another tenant's call waits for behind a burst, before its own.
#: Tuned constant, on the 2-core test machine (docs/benchmarks.md, "Tenants' bursts of
#: calls of many inputs"): a burst of 100 MiniLM calls of 16 inputs drains in 3-4 s, and
#: at 50 ms it drained 46% slower than alone (jobs of one call), at 150 ms another
#: tenant's call waited 0.22 of it (issue 73 asks 0.1), at 100 ms 0.06 and 7-15% slower.
JOB_MS = 100.0
#: Jobs a replica's cost is fitted over (`JobCost`): enough to see jobs of several sizes,
#: few enough to follow a machine whose load changes. Not tuned (the engine's pace keeps
#: as many passes: `worker.generation.pacing.WINDOW`).
JOBS_FITTED = 32

_KEYS = ("size", "chars", "wait")

T = TypeVar("T")


@dataclass(frozen=True)
class BatchLimits:
    """How many calls (`size`) and input characters (`chars`) one batch may take, and how
    long (`wait_ms`) a batch that is not full waits for more. `size` 1 turns batching off."""

    size: int = DEFAULT_SIZE
    chars: int = DEFAULT_CHARS
    wait_ms: int = DEFAULT_WAIT_MS

    def __post_init__(self) -> None:
        if self.size < 1 or self.chars < 1 or self.wait_ms < 0:
            raise ValueError(
                f"batch limits need size >= 1, chars >= 1 and wait >= 0, got {self.size}, "
                f"{self.chars}, {self.wait_ms} ms"
            )

    @property
    def on(self) -> bool:
        return self.size > 1

    def describe(self) -> str:
        if not self.on:
            return "off"
        return f"{self.size} calls, {self.chars} chars, wait {format_duration_ms(self.wait_ms)}"


def parse_override(value: object) -> dict[str, int]:
    """A catalog entry's `batch` field: `false` (off), or a mapping of `size`, `chars` and
    `wait` (a duration), each optional. Returns the fields it sets; raises `ConfigError`."""
    if value is False:
        return {"size": 1}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"expected false or a mapping of {', '.join(_KEYS)}, e.g. {{size: 16, wait: 5ms}}, "
            f"got {value!r}"
        )
    unknown = sorted(map(str, set(value) - set(_KEYS)))
    if unknown:
        raise ConfigError(f"unknown keys {unknown}; a batch takes {', '.join(_KEYS)}")
    out: dict[str, int] = {}
    for key in ("size", "chars"):
        if key in value:
            number = value[key]
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ConfigError(f"{key} must be a whole number >= 1, got {number!r}")
            out[key] = number
    if "wait" in value:
        out["wait_ms"] = parse_duration_ms(value["wait"])
    return out


def limits_for(task: str, fleet: BatchLimits, override: Mapping[str, int] | None) -> BatchLimits:
    """A model's limits: the fleet's, changed by its catalog `batch` field; off for the
    tasks that are never batched."""
    if task in UNBATCHED_TASKS:
        return BatchLimits(1, fleet.chars, 0)
    fields: dict[str, Any] = {"size": fleet.size, "chars": fleet.chars, "wait_ms": fleet.wait_ms}
    fields.update(override or {})
    return BatchLimits(**fields)


@dataclass
class Waiting(Generic[T]):
    """One call waiting for a batch: what it is, the replica it goes to, its input size."""

    item: T
    group: Hashable  # calls share a batch only within one group: (replica, epoch)
    chars: int
    since_ms: float  # when it began to wait
    #: Its place in line: its start tag among tenants (`placement.rules.fairness`); -inf
    #: for a call that goes back to the head of the line.
    order: float = float("-inf")


class JobCost:
    """What one replica's batch jobs cost, in milliseconds from the child taking one to
    its end (its pass and every call's result): `fixed + a x calls + b x chars`, fitted
    over the last `JOBS_FITTED` (`placement.rules.costs.fit`). Per-call work (a result
    stored) and per-character work (the pass) both count, so it holds for tiny models,
    whose calls cost their results, and large ones, whose calls cost their tokens."""

    def __init__(self) -> None:
        self._jobs: deque[tuple[int, int, float]] = deque(maxlen=JOBS_FITTED)
        self._fit: tuple[float, float, float] | None = None
        self._trial = 0  # calls a job may hold whatever the fit says (`fits`)

    def ran(self, calls: int, chars: int, ms: float) -> None:
        """A job of `calls` calls and `chars` input characters took `ms`."""
        if calls > 0 and ms > 0:
            self._jobs.append((calls, chars, ms))
            points = [(n, c) for n, c, _ in self._jobs]
            self._fit = fit(points, [t for _, _, t in self._jobs])
            sizes = {n for n, _ in points}
            self._trial = calls + 1 if len(sizes) == 1 else 0

    def fits(self, calls: int, chars: int) -> bool:
        """Whether a job of `calls` and `chars` should end within `JOB_MS`; True until a
        job has run (nothing is known). While every job fitted held as many calls, n, the
        fit cannot tell a job's fixed part from its calls' (it charges all to the calls),
        so a job may hold n + 1: one that did shows the difference, where a replica whose
        jobs cost mostly their fixed part would otherwise keep to jobs of one call. (Not
        more: a window of equal jobs is also where a steady bound leaves it, and a job
        twice as long there made another tenant's call wait twice as long.)"""
        if self._fit is None or calls <= self._trial:
            return True
        fixed, per_call, per_char = self._fit
        return fixed + per_call * calls + per_char * chars <= JOB_MS


def take_batch(
    waiting: Sequence[Waiting[T]],
    limits_of: Callable[[Waiting[T]], BatchLimits],
    now_ms: float,
    cost_of: Callable[[Waiting[T]], JobCost | None] = lambda _: None,
) -> tuple[list[int], float | None]:
    """The positions in `waiting` (oldest first) of the next batch to run now, or none and
    the time at which to look again, because every batch may still grow.

    A batch is a group's oldest call and the calls of its group behind it, within its
    limits and within `JOB_MS` by its group's `cost_of` (None: no time bound); the group
    whose oldest call came first and whose batch is full or due goes first, so a model that
    waits for company never holds up another's calls. A call that alone passes `chars`
    runs as a batch of one, and a batch at its time bound is full.
    """
    heads: dict[Hashable, int] = {}
    for index, entry in enumerate(waiting):
        heads.setdefault(entry.group, index)
    wake: float | None = None
    for group, first in heads.items():
        head = waiting[first]
        limits, cost = limits_of(head), cost_of(head)
        chosen = [first]
        chars, full = head.chars, False
        for index in range(first + 1, len(waiting)):
            if len(chosen) >= limits.size:
                break
            other = waiting[index]
            if other.group != group or chars + other.chars > limits.chars:
                continue
            if cost is not None and not cost.fits(len(chosen) + 1, chars + other.chars):
                full = True
                break
            chosen.append(index)
            chars += other.chars
        due = head.since_ms + limits.wait_ms
        if full or len(chosen) >= limits.size or now_ms >= due:
            return chosen, None
        wake = due if wake is None else min(wake, due)
    return [], wake


def input_rows(inputs: object) -> int:
    """Rows a call's inputs take in a pass: a list's strings, else one (a string, or
    anything the worker refuses before batching)."""
    return len(inputs) if isinstance(inputs, list) and inputs else 1


def input_chars(inputs: object) -> int:
    """Characters of a call's inputs (a string or a list of strings); 0 for anything else,
    which the worker refuses before batching."""
    if isinstance(inputs, str):
        return len(inputs)
    if isinstance(inputs, list):
        return sum(len(text) for text in inputs if isinstance(text, str))
    return 0
