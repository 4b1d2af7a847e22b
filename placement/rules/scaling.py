"""When a model gets another replica, and when one of its replicas goes: the scaling rule.

Pure: it reads what the fleet's load looks like now and returns decisions; the routers
carry them out (`tasks/serving/scaling.py`) through the registry's atomic scripts, and the
simulator replays the same rule. Seed 003's rule, per model:
- **out**: calls waiting per ready replica at or above `threshold` (default 2) for
  `window` in a row, below the model's `ceiling`, and no replica still on its way;
- **in**: a ready replica idle (no call in flight) for the model's `keep_alive`, above its
  `floor`, while the model is under its threshold; the one idle longest goes first.
Calls *waiting* are those leased to a replica beyond the ones it runs (one call, or the
calls of the batch its worker runs now), plus those the router holds for the model (a
miss being placed, a busy retry).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from placement.policy.state import Level

DEFAULT_THRESHOLD = 2.0
DEFAULT_WINDOW_MS = 2_000
DEFAULT_KEEP_ALIVE_MS = 300_000  # Ollama's 5 minutes


@dataclass(frozen=True)
class Autoscale:
    """A model whose replica count follows its load, from `floor` to `ceiling` replicas.

    `keep_alive_ms` is how long a replica may sit idle before it goes (None: the fleet's
    setting). A floor of 0 lets the model leave the GPUs entirely.
    """

    floor: int
    ceiling: int
    keep_alive_ms: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.ceiling or self.ceiling < 1:
            raise ValueError(f"need 0 <= min <= max and max >= 1, got {self.floor}..{self.ceiling}")


@dataclass(frozen=True)
class ReplicaLoad:
    """One placed replica (HOT, LOADING, WAITING or DRAINING) as the rule sees it."""

    replica: str
    level: Level
    in_flight: int  # live request leases: calls sent to it, queued or running
    idle_ms: int  # since its last call ended (0 while one is in flight)
    worker: str = ""
    epoch: int = 0  # the placement it is in (a scale-in names it)
    batch: int = 0  # calls in the pass its worker runs now, when that is a batch

    @property
    def ready(self) -> bool:
        """HOT: it takes calls now."""
        return self.level is Level.HOT

    @property
    def arriving(self) -> bool:
        """Placed and on its way to HOT: it takes load soon."""
        return self.level in (Level.LOADING, Level.WAITING)

    @property
    def running(self) -> int:
        """Calls in the pass its worker runs now: a batch's, or one."""
        return min(self.in_flight, max(self.batch, 1))

    @property
    def waiting(self) -> int:
        """Calls queued behind those it runs, batched calls included until their pass."""
        return self.in_flight - self.running


@dataclass(frozen=True)
class ModelLoad:
    """A model's calls and replicas at one instant."""

    model: str
    replicas: Sequence[ReplicaLoad]  # placed (HOT, LOADING, WAITING, DRAINING)
    routing: int = 0  # calls the router holds for it: misses being placed, busy retries
    changes: int | None = None  # times its placed replicas changed, as read

    @property
    def ready(self) -> int:
        return sum(r.ready for r in self.replicas)

    @property
    def running(self) -> int:
        return sum(r.running for r in self.replicas if r.ready)

    @property
    def waiting(self) -> int:
        queued = sum(r.waiting if r.ready else r.in_flight for r in self.replicas)
        return queued + self.routing

    @property
    def pressure(self) -> float:
        """Waiting calls per ready replica (all of them when none is ready)."""
        return self.waiting / max(self.ready, 1)


@dataclass(frozen=True)
class ScaleOut:
    model: str
    placed: int  # replicas placed now
    target: int  # replicas once this one is placed
    why: str
    changes: int | None = None  # the load's `changes`: any change since voids the decision


@dataclass(frozen=True)
class ScaleIn:
    model: str
    replica: str
    epoch: int
    placed: int
    target: int
    why: str
    changes: int | None = None  # as for ScaleOut


Decision = ScaleOut | ScaleIn


@dataclass
class Scaler:
    """The rule, with what it must remember between looks: since when each model has
    been under pressure. One per router; several routers may run it at once, since the
    registry refuses a placement past `target`, an eviction below the floor, and either
    once the model's replicas changed since the load was read."""

    threshold: float = DEFAULT_THRESHOLD
    window_ms: int = DEFAULT_WINDOW_MS
    keep_alive_ms: int = DEFAULT_KEEP_ALIVE_MS
    _pressed_since: dict[str, int] = field(default_factory=dict)

    def decide(
        self, now_ms: int, loads: Iterable[ModelLoad], rules: Mapping[str, Autoscale]
    ) -> list[Decision]:
        """At most one decision per model, for the models in `rules`."""
        decisions: list[Decision] = []
        for load in loads:
            rule = rules.get(load.model)
            if rule is None:
                continue
            found = self._one(now_ms, load, rule)
            if found is not None:
                decisions.append(found)
        return decisions

    def _one(self, now_ms: int, load: ModelLoad, rule: Autoscale) -> Decision | None:
        placed, ready = len(load.replicas), load.ready
        # A replica on its way takes load once HOT: measure afresh from then on. With none
        # ready, calls wait for a load, which another replica would not end sooner.
        arriving = any(r.arriving for r in load.replicas)
        pressed = load.pressure >= self.threshold and load.waiting > 0 and ready > 0
        if not pressed or arriving:
            self._pressed_since.pop(load.model, None)
        if pressed:
            since = self._pressed_since.setdefault(load.model, now_ms)
            if now_ms - since >= self.window_ms and placed < rule.ceiling and not arriving:
                self._pressed_since[load.model] = now_ms  # a fresh window for the next one
                why = (
                    f"scale out {load.model} {placed}\u2192{placed + 1}: {load.waiting} waiting "
                    f"on {ready} ready replica{'s' if ready != 1 else ''}"
                )
                return ScaleOut(load.model, placed, placed + 1, why, load.changes)
            return None
        keep = rule.keep_alive_ms if rule.keep_alive_ms is not None else self.keep_alive_ms
        idle = [r for r in load.replicas if r.ready and r.in_flight == 0 and r.idle_ms >= keep]
        leaving = any(r.level is Level.DRAINING for r in load.replicas)
        if placed > rule.floor and idle and not leaving:
            gone = max(idle, key=lambda r: (r.idle_ms, r.replica))
            why = (
                f"scale in {load.model} {placed}\u2192{placed - 1}: replica {gone.replica[:8]} "
                f"idle {gone.idle_ms / 1000:.0f} s (keep_alive {keep / 1000:g} s)"
            )
            return ScaleIn(
                load.model, gone.replica, gone.epoch, placed, placed - 1, why, load.changes
            )
        return None
