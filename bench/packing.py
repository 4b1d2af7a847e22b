"""Packing at fleet scale: how much of a production-shaped fleet each policy fills.

Run as ``python -m bench.packing [--workload mixed] [--seed 1] [--hosts 1200] ...``, or
``python -m bench.packing --trace openb:NAME [--seed 1]`` to replay a real trace (below);
prints ONE JSON object.

The fleet and the requests are generated from the seed, shaped like a production
GPU-sharing cluster: hosts of 2, 4 or 8 GPUs of one type each, several types. Nothing
leaves and nothing may be evicted. Requests arrive until 130% of the fleet's GPUs have
been asked for. The workloads (``--workload``):

- ``mixed`` (the default): 45% shares of one GPU (0.1 to 0.75, eight sizes equally
  likely), 55% one whole GPU, 1% 2, 4 or 8 whole GPUs of one host; 30% name GPU types,
  a fifth of those two types;
- ``share-only``: every request a share of one GPU, sizes drawn from the GPU-sharing
  pods of Alibaba's cluster-trace-gpu-v2023 (FGD's "openb" trace, see `OPENB_SHARES`):
  0.11 to 0.81 of a GPU, a third of them 0.81, which only a 0.11 or 0.16 fits beside;
- ``typed-shares``: the same, a third of requests naming GPU types, half of those two
  (the trace's gpuspec33 variant: about 33% of its GPU pods name types);
- ``multi-heavy``: 40% trace shares, 35% whole GPUs, 25% 2, 4 or 8 GPUs of one host.

(The Azure LLM trace in ../shared/data has arrival times and token counts but no GPU
sizes, so no workload here uses it.)

``--trace openb:NAME`` replays Alibaba's cluster-trace-gpu-v2023 itself, as FGD's paper
does (../shared/data/openb, its README): the fleet is the trace's 1,213 hosts (6,212 GPUs,
typed by the trace's model names), the requests its pod list `openb_pod_list_NAME.csv`
(`default`, `gpushare20`..`80`, `multigpu20`..`40`, `gpuspec10`..`25`) in a seeded random
order, shuffled again each time the list runs out, until `--arrive` x the fleet's GPUs
were asked for; pods that need no GPU are left out, `gpu_spec` becomes the GPU types a pod
allows. Only GPUs are packed: the pods' CPU and memory, which FGD's simulator also
checks against each node, are not. Allocation is also read as arrivals reach 90%, 100%,
110% and 120% of the fleet. Mixes the lists do not hold are derived from them, for
held-out checks: ``--only KIND`` keeps some of a list's pods; ``--typed-share F
[--type-balance list|fleet|even]`` draws each arrival from its typed pods with
probability F, else from its untyped ones (`resampled`).

Every policy replays the same sequence:

- ``default``: gpufleet's shipped policy, `plan_replica` on a `LiveView` of the fleet;
- ``first-fit``: the first host, then the first GPU, in index order, that fits;
- ``best-fit``: node-aware best-fit, the host with the least free room that fits, then
  its GPU with the least free room that fits;
- ``fgd``: fragmentation gradient descent (Weng et al., "Beware of Fragmentation",
  USENIX ATC'23): the place that least increases the host's expected fragmentation
  under the request mix.
The baselines are written here, plainly, over integer milli-GPU units.

Reported per policy: the share of the fleet's GPU capacity allocated at the first
refusal, as arrivals reach 90% to 120% of it (`at_90`..`at_120`), and at the end
(capacity counts each GPU as 1, whatever its memory), and the milliseconds per decision,
refusals included; `default_vs_best_baseline` is the default minus the better of node
first-fit and node best-fit at each (issue 42's bar; FGD is reported beside them).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from placement.errors import PlacementError
from placement.policy.live import LiveView
from placement.policy.place import plan_replica
from placement.policy.state import Demand, Gpu, Host, Snapshot
from placement.units import accelerators
from placement.units.memory import GiB

UNIT = 1000  # milli-GPUs: the baselines' integer unit
TYPES = "NVIDIA A100-SXM4-80GB:80:3,NVIDIA A100-SXM4-40GB:40:2,Tesla V100-SXM2-32GB:32:2,"
TYPES += "Tesla V100-SXM2-16GB:16:2,NVIDIA A10:24:2,Tesla T4:16:1"
SHARES = "100,200,250,300,400,500,600,750"  # milli-GPUs, equally likely: `mixed`
# gpu_milli of GPU-sharing pods in Alibaba's cluster-trace-gpu-v2023 (the "openb" trace of
# FGD, Weng et al., USENIX ATC'23, github.com/alibaba/clusterdata): every value seen in
# about 460 rows (4355-4587 and 6826-7058) of openb_pod_list_gpushare100.csv, the trace's
# GPU-sharing pods, weighted by its approximate share (%) of those rows (a hand tally,
# not an exact count). The fleet's GPU types stay `TYPES`, not the trace's.
OPENB_SHARES = "110:1,160:3,220:1,230:6,320:13,330:0.5,350:0.5,370:2,460:5,470:21,480:1,"
OPENB_SHARES += "550:1.5,590:5,650:7.5,810:33"

OPENB = Path(__file__).resolve().parents[2] / "shared" / "data" / "openb"
#: GiB of the trace's GPU models (the packing counts GPUs, not bytes: any sizes would do;
#: G2 and G3 are undisclosed types).
OPENB_GIB = {"A10": 24, "P100": 16, "T4": 16, "V100M16": 16, "V100M32": 32}
CHECKPOINTS = (0.9, 1.0, 1.1, 1.2)  # arrivals, x the fleet's GPUs, where allocation is read

# name -> (kinds as kind:weight, share sizes, share of typed requests, share of those
# that name two types)
WORKLOADS: dict[str, tuple[str, str, float, float]] = {
    "mixed": ("share:45,whole:55,multi:1", SHARES, 0.3, 0.2),
    "share-only": ("share:1", OPENB_SHARES, 0.0, 0.0),
    "typed-shares": ("share:1", OPENB_SHARES, 1 / 3, 0.5),
    "multi-heavy": ("share:40,whole:35,multi:25", OPENB_SHARES, 0.3, 0.2),
}


@dataclass(frozen=True)
class Request:
    gpus: int  # whole GPUs of one host; 0 for a share
    share: int  # milli-GPUs of one GPU when `gpus` is 0
    accelerator: str | tuple[str, ...] | None

    @property
    def amount(self) -> int:
        """Milli-GPUs asked for."""
        return self.gpus * UNIT or self.share


@dataclass
class Machine:
    """One host as the baselines see it: its type and each GPU's free milli-GPUs."""

    name: str
    type: str  # the GPUs' NVML name
    gib: int  # each GPU's memory
    free: list[int] = field(default_factory=list)


def _weighted(text: str) -> list[tuple[list[str], float]]:
    out = []
    for part in text.split(","):
        *values, weight = part.split(":")
        out.append((values, float(weight)))
    return out


def _draw(rng: random.Random, weighted: list[tuple[list[str], float]]) -> list[str]:
    return rng.choices([v for v, _ in weighted], weights=[w for _, w in weighted])[0]


def make_fleet(rng: random.Random, hosts: int, sizes: str, types: str) -> list[Machine]:
    size_w, type_w = _weighted(sizes), _weighted(types)
    machines = []
    for h in range(hosts):
        (n,), (name, gib) = _draw(rng, size_w), _draw(rng, type_w)
        machines.append(Machine(f"host-{h:05d}", name, int(gib), [UNIT] * int(n)))
    return machines


def make_requests(
    rng: random.Random,
    fleet: Sequence[Machine],
    workload: tuple[str, str, float, float],
    arrive: float,
) -> list[Request]:
    """Requests until `arrive` x the fleet's GPUs were asked for. A typed request names one
    GPU type, drawn in proportion to the type's GPUs, or that type or another."""
    mix, sizes, typed, pair = workload
    kinds = _weighted(mix)
    shares = [int(v) for v in sizes.split(",")] if ":" not in sizes else []
    weighted_shares = _weighted(sizes) if not shares else []
    gpus_by_type: dict[str, int] = {}
    for m in fleet:
        gpus_by_type[m.type] = gpus_by_type.get(m.type, 0) + len(m.free)
    names = sorted(gpus_by_type)
    capacity = sum(gpus_by_type.values()) * UNIT
    requests: list[Request] = []
    asked = 0
    while asked < arrive * capacity:
        (kind,) = _draw(rng, kinds)
        accelerator: str | tuple[str, ...] | None = None
        if rng.random() < typed:
            picked = rng.choices(names, weights=[gpus_by_type[n] for n in names])[0]
            accelerator = _short(picked)
            if rng.random() < pair:
                accelerator = (accelerator, _short(rng.choice(names)))
        if kind == "share":
            share = rng.choice(shares) if shares else int(_draw(rng, weighted_shares)[0])
            req = Request(0, share, accelerator)
        elif kind == "whole":
            req = Request(1, 0, accelerator)
        else:
            req = Request(rng.choice((2, 4, 8)), 0, accelerator)
        requests.append(req)
        asked += req.amount
    return requests


def openb_fleet(directory: Path) -> list[Machine]:
    """The trace's hosts with GPUs, each GPU free."""
    with (directory / "openb_node_list_gpu_node.csv").open() as f:
        return [
            Machine(row["sn"], row["model"], OPENB_GIB.get(row["model"], 32), [UNIT] * n)
            for row in csv.DictReader(f)
            if (n := int(row["gpu"])) > 0
        ]


def openb_pods(directory: Path, name: str) -> list[Request]:
    """The GPU pods of `openb_pod_list_<name>.csv`, in file order: a share of one GPU
    (`gpu_milli` < 1000), else `num_gpu` whole GPUs of one host; `gpu_spec` as types."""
    pods = []
    with (directory / f"openb_pod_list_{name}.csv").open() as f:
        for row in csv.DictReader(f):
            gpus, milli = int(row["num_gpu"]), int(row["gpu_milli"])
            if gpus == 0:
                continue
            types = tuple(dict.fromkeys(t for t in (row.get("gpu_spec") or "").split("|") if t))
            allowed = None if not types else types[0] if len(types) == 1 else types
            if gpus == 1 and milli < UNIT:
                pods.append(Request(0, milli, allowed))
            else:
                pods.append(Request(gpus, 0, allowed))
    return pods


#: The pods a derived mix keeps (`--only`): mixes of the trace's own pods that no rule was
#: tuned on, for a held-out check (issue 60).
ONLY: dict[str, Callable[[Request], bool]] = {
    "share": lambda r: not r.gpus,
    "whole": lambda r: bool(r.gpus),
    "multi": lambda r: r.gpus > 1,
    "typed": lambda r: r.accelerator is not None,
    "untyped": lambda r: r.accelerator is None,
}


#: How a derived mix draws its typed pods (`--type-balance`): each GPU-type constraint as
#: often as the list has it, in proportion to the GPUs it allows, or all alike.
BALANCES = ("list", "fleet", "even")


def resampled(
    rng: random.Random,
    pods: Sequence[Request],
    fleet: Sequence[Machine],
    *,
    typed_share: float,
    balance: str,
    capacity: int,
    arrive: float,
) -> list[Request]:
    """A mix derived from `pods` (`--typed-share`): each arrival a typed pod with probability
    `typed_share`, else an untyped one, each drawn at random from the list's own, until
    `arrive` x `capacity` milli-GPUs were asked for. Typed pods are drawn by their
    constraint first, weighted as `balance` says (`BALANCES`), then uniformly among the
    list's pods with that constraint, so shapes stay the list's and only how often each
    type is named moves."""
    typed: dict[str | tuple[str, ...], list[Request]] = {}
    untyped = [p for p in pods if p.accelerator is None]
    for p in pods:
        if p.accelerator is not None:
            typed.setdefault(p.accelerator, []).append(p)
    if (typed_share > 0 and not typed) or (typed_share < 1 and not untyped):
        raise SystemExit("the pod list has no typed or no untyped pod to draw from")
    constraints = list(typed)
    if balance == "list":
        weights = [float(len(typed[c])) for c in constraints]
    elif balance == "fleet":
        weights = [
            float(sum(len(m.free) for m in fleet if accelerators.matches(m.type, c)))
            for c in constraints
        ]
    else:
        weights = [1.0] * len(constraints)
    if typed_share > 0 and not any(weights):
        raise SystemExit("no GPU of the fleet is of a type the list's typed pods name")
    out: list[Request] = []
    asked = 0
    while asked < arrive * capacity:
        if rng.random() < typed_share:
            r = rng.choice(typed[rng.choices(constraints, weights=weights)[0]])
        else:
            r = rng.choice(untyped)
        out.append(r)
        asked += r.amount
    return out


def arrivals(
    rng: random.Random, pods: Sequence[Request], capacity: int, arrive: float
) -> list[Request]:
    """`pods` in seeded random orders, one after another, until `arrive` x `capacity`
    milli-GPUs were asked for."""
    if not pods:
        raise SystemExit("the pod list holds no pod that needs a GPU")
    out: list[Request] = []
    asked = 0
    while asked < arrive * capacity:
        order = list(pods)
        rng.shuffle(order)
        for r in order:
            out.append(r)
            asked += r.amount
            if asked >= arrive * capacity:
                break
    return out


def _short(name: str) -> str:
    """The pattern a user writes for a GPU type: "Tesla V100-SXM2-16GB" -> "V100-16GB"."""
    model = name.rsplit(maxsplit=1)[-1]
    parts = model.split("-")
    return "-".join([parts[0], parts[-1]]) if len(parts) > 2 else model


# --- the baselines ----------------------------------------------------------------

Choice = tuple[Machine, list[int]] | None  # a host and the indexes of its GPUs


def _fits(m: Machine, r: Request) -> list[int]:
    """The GPUs of `m` that could take (a part of) `r`."""
    need = UNIT if r.gpus else r.share
    return [i for i, f in enumerate(m.free) if f >= need]


def first_fit(machines: Sequence[Machine], r: Request) -> Choice:
    for m in machines:
        fits = _fits(m, r)
        if len(fits) >= max(r.gpus, 1):
            return m, fits[: max(r.gpus, 1)]
    return None


def best_fit(machines: Sequence[Machine], r: Request) -> Choice:
    best: Choice = None
    best_key: tuple[int, int] | None = None
    for m in machines:
        fits = _fits(m, r)
        if len(fits) < max(r.gpus, 1):
            continue
        if r.gpus:
            key, chosen = (sum(m.free), 0), fits[: r.gpus]
        else:
            i = min(fits, key=lambda i: m.free[i])
            key, chosen = (sum(m.free), m.free[i]), [i]
        if best_key is None or key < best_key:
            best, best_key = (m, chosen), key
    return best


class Fgd:
    """Fragmentation gradient descent over a request mix of (share, count) shapes."""

    def __init__(self, requests: Sequence[Request]) -> None:
        shapes: dict[tuple[int, int], int] = {}
        for r in requests:
            key = (r.gpus, r.share)
            shapes[key] = shapes.get(key, 0) + 1
        self.mix = [(g, s, n / len(requests)) for (g, s), n in shapes.items()]
        self.cache: dict[tuple[int, ...], float] = {}

    def frag(self, free: tuple[int, ...]) -> float:
        """A host's expected fragmentation: free milli-GPUs no request of the mix could use."""
        found = self.cache.get(free)
        if found is None:
            found = 0.0
            total = sum(free)
            for gpus, share, p in self.mix:
                if gpus:
                    whole = sum(1 for f in free if f == UNIT)
                    lost = total if whole < gpus else total - whole * UNIT
                else:
                    lost = sum(f for f in free if f < share)
                found += p * lost
            self.cache[free] = found
        return found

    def __call__(self, machines: Sequence[Machine], r: Request) -> Choice:
        best: Choice = None
        best_delta = 0.0
        for m in machines:
            fits = _fits(m, r)
            if len(fits) < max(r.gpus, 1):
                continue
            before = self.frag(tuple(sorted(m.free)))
            seen: set[int] = set()
            options = [fits[: r.gpus]] if r.gpus else [[i] for i in fits]
            for chosen in options:
                if not r.gpus and m.free[chosen[0]] in seen:
                    continue  # GPUs with equal free room place alike
                seen.add(m.free[chosen[0]])
                after = list(m.free)
                for i in chosen:
                    after[i] -= UNIT if r.gpus else r.share
                delta = self.frag(tuple(sorted(after))) - before
                if best is None or delta < best_delta:
                    best, best_delta = (m, chosen), delta
        return best


# --- replay -------------------------------------------------------------------------


@dataclass
class Tally:
    """What a replay allocated: at its first refusal, as arrivals pass each of
    `CHECKPOINTS`, and at the end; and how long each decision took."""

    capacity: int
    allocated: int = 0
    asked: int = 0
    first_refusal: int | None = None
    at: dict[float, int] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)

    def arrived(self, r: Request, placed: bool, ms: float) -> None:
        self.asked += r.amount
        self.times.append(ms)
        if placed:
            self.allocated += r.amount
        elif self.first_refusal is None:
            self.first_refusal = self.allocated
        for c in CHECKPOINTS:
            if c not in self.at and self.asked >= c * self.capacity:
                self.at[c] = self.allocated

    def figures(self) -> dict[str, float | None]:
        cuts = statistics.quantiles(self.times, n=100)
        refused = self.allocated if self.first_refusal is None else self.first_refusal
        at = {f"at_{round(c * 100)}": self.at.get(c) for c in CHECKPOINTS}
        return {
            "first_refusal_alloc": round(refused / self.capacity, 4),
            **{k: None if v is None else round(v / self.capacity, 4) for k, v in at.items()},
            "end_alloc": round(self.allocated / self.capacity, 4),
            "plan_p50_ms": round(statistics.median(self.times), 4),
            "plan_p99_ms": round(cuts[98], 4),
            "decisions": len(self.times),
        }


def replay_baseline(
    machines: list[Machine],
    requests: Sequence[Request],
    choose: Callable[[Sequence[Machine], Request], Choice],
) -> dict[str, float | None]:
    tally = Tally(sum(len(m.free) for m in machines) * UNIT)
    by_family: dict[object, list[Machine]] = {}
    for r in requests:
        allowed = by_family.get(r.accelerator)
        if allowed is None:
            allowed = by_family[r.accelerator] = [
                m for m in machines if accelerators.matches(m.type, r.accelerator)
            ]
        start = time.perf_counter()
        choice = choose(allowed, r)
        ms = (time.perf_counter() - start) * 1000
        if choice is not None:
            m, chosen = choice
            for i in chosen:
                m.free[i] -= UNIT if r.gpus else r.share
                assert m.free[i] >= 0
        tally.arrived(r, choice is not None, ms)
    return tally.figures()


def replay_default(
    machines: Sequence[Machine], requests: Sequence[Request]
) -> dict[str, float | None]:
    gpus: dict[str, Gpu] = {}
    for m in machines:
        for i in range(len(m.free)):
            gpu_id, worker = f"{m.name}/{i}", f"w-{m.name}"
            gpus[gpu_id] = Gpu(gpu_id, m.name, i, m.type, m.gib * GiB, 0, worker, worker, 2**62)
    hosts = {m.name: Host(m.name) for m in machines}
    view = LiveView(Snapshot(gpus=gpus, deployments={}, hosts=hosts, now_ms=1))
    tally = Tally(len(gpus) * UNIT)
    rng = random.Random(0)
    for n, r in enumerate(requests):
        demand = Demand(
            f"m{n}",
            gpus=float(r.gpus) if r.gpus else r.share / UNIT,
            accelerator=r.accelerator,
            dedicated=True,
        )
        start = time.perf_counter()
        try:
            plan = plan_replica(demand, view.snap, rng=rng)
        except PlacementError:
            tally.arrived(r, False, (time.perf_counter() - start) * 1000)
            continue
        tally.arrived(r, True, (time.perf_counter() - start) * 1000)
        view.apply(plan)
    return tally.figures()


def _mix_name(args: argparse.Namespace) -> str:
    """The replayed list and how its mix was derived, e.g. "openb:gpuspec25/typed=0.5,fleet"."""
    name = args.trace + (f"/{args.only}" if args.only else "")
    if args.typed_share is not None:
        name += f"/typed={args.typed_share:g},{args.type_balance}"
    return name


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--host-sizes", default="2:30,4:25,8:45", help="GPUs:weight,...")
    parser.add_argument("--types", default=TYPES, help="NVML name:GiB:weight,...")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed")
    parser.add_argument("--mix", help="kind:weight,... (overrides the workload's)")
    parser.add_argument("--typed", type=float, help="share of typed requests (likewise)")
    parser.add_argument("--arrive", type=float, default=1.3, help="capacity asked for, x fleet")
    parser.add_argument("--policies", default="default,first-fit,best-fit,fgd")
    parser.add_argument("--trace", help="openb:NAME replays the trace's pod list NAME")
    parser.add_argument("--data", type=Path, default=OPENB, help="the openb trace's folder")
    parser.add_argument(
        "--only", choices=sorted(ONLY), help="with --trace: keep only these pods (a derived mix)"
    )
    parser.add_argument(
        "--typed-share",
        type=float,
        help="with --trace: derive a mix, each pod typed with this probability (resampled)",
    )
    parser.add_argument(
        "--type-balance",
        choices=BALANCES,
        default="list",
        help="with --typed-share: how often each GPU-type constraint is drawn",
    )
    args = parser.parse_args(argv)
    if args.typed_share is not None and not (args.trace and 0 <= args.typed_share <= 1):
        parser.error("--typed-share takes a share from 0 to 1, with --trace")

    rng = random.Random(args.seed)
    if args.trace:
        kind, _, name = args.trace.partition(":")
        if kind != "openb" or not name:
            parser.error("--trace takes openb:NAME, e.g. openb:default")
        fleet = openb_fleet(args.data)
        capacity = sum(len(m.free) for m in fleet) * UNIT
        pods = openb_pods(args.data, name)
        if args.only:
            pods = [p for p in pods if ONLY[args.only](p)]
        if args.typed_share is None:
            requests = arrivals(rng, pods, capacity, args.arrive)
        else:
            requests = resampled(
                rng,
                pods,
                fleet,
                typed_share=args.typed_share,
                balance=args.type_balance,
                capacity=capacity,
                arrive=args.arrive,
            )
    else:
        mix, sizes, typed, pair = WORKLOADS[args.workload]
        workload = (args.mix or mix, sizes, typed if args.typed is None else args.typed, pair)
        fleet = make_fleet(rng, args.hosts, args.host_sizes, args.types)
        capacity = sum(len(m.free) for m in fleet) * UNIT
        requests = make_requests(rng, fleet, workload, args.arrive)
    policies: dict[str, dict[str, float | None]] = {}
    for name in args.policies.split(","):
        machines = [Machine(m.name, m.type, m.gib, list(m.free)) for m in fleet]
        if name == "default":
            policies[name] = replay_default(machines, requests)
        else:
            baselines: dict[str, Callable[[Sequence[Machine], Request], Choice]] = {
                "first-fit": first_fit,
                "best-fit": best_fit,
                "fgd": Fgd(requests),
            }
            choose = baselines[name]
            policies[name] = replay_baseline(machines, requests, choose)
    others = [p for n, p in policies.items() if n in ("first-fit", "best-fit")]
    out: dict[str, object] = {
        "workload": _mix_name(args) if args.trace else args.workload,
        "hosts": len(fleet),
        "gpus": capacity // UNIT,
        "seed": args.seed,
        "requests": len(requests),
        "policies": policies,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
    if "default" in policies and others:
        d = policies["default"]
        out["default_vs_best_baseline"] = {
            key: round(value - max(float(b[key] or 0) for b in others), 4)
            for key, value in d.items()
            if key.endswith("_alloc") or key.startswith("at_")
            if value is not None and all(b[key] is not None for b in others)
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
