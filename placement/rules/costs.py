"""What a pass or a job costs, learned from the last ones that ran: a least-squares fit of
their times over two sizes.

The engine's pace (`worker.generation.pacing`) fits a prefill pass's time over its tokens
and the columns they attend to; a GPU worker's batcher (`tasks.serving.batching`) fits a
batch job's over its calls and their input characters. Both need the same three answers
from noisy timings of a machine that others share: a fixed part, and a marginal cost for
each size. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fit", "plane"]


def fit(points: Sequence[tuple[int, int]], times: Sequence[float]) -> tuple[float, float, float]:
    """`(fixed, a, b)` of `time = fixed + a x + b y` over `points` (x, y), for at least
    one point: the least-squares plane; where y does not vary apart from x enough to tell
    them (or noise makes a cost negative), the line through x alone (b = 0); where x does
    not vary either (or its slope is no cost at all), the mean cost per x, which counts
    the fixed part in (fixed = 0) and so errs low below the mean size and high above it."""
    found = plane(points, times)
    if found is not None and found[0] >= 0 and found[1] > 0 and found[2] >= 0:
        return found
    count = len(points)
    mean_x = sum(x for x, _ in points) / count
    mean_t = sum(times) / count
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread > 0:
        pairs = zip(points, times, strict=True)
        slope = sum((x - mean_x) * (t - mean_t) for (x, _), t in pairs) / spread
        if slope > 0:
            return max(0.0, mean_t - slope * mean_x), slope, 0.0
    return 0.0, mean_t / max(mean_x, 1e-9), 0.0


def plane(
    points: Sequence[tuple[int, int]], times: Sequence[float]
) -> tuple[float, float, float] | None:
    """The least-squares `t = c + a x + b y` through `points` (x, y) and `times`: (c, a,
    b), or None when the points do not span a plane."""
    count = len(points)
    mx = sum(x for x, _ in points) / count
    my = sum(y for _, y in points) / count
    mt = sum(times) / count
    sxx = sum((x - mx) ** 2 for x, _ in points)
    syy = sum((y - my) ** 2 for _, y in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    sxt = sum((x - mx) * (t - mt) for (x, _), t in zip(points, times, strict=True))
    syt = sum((y - my) * (t - mt) for (_, y), t in zip(points, times, strict=True))
    det = sxx * syy - sxy * sxy
    if det <= 1e-9 * sxx * syy or det <= 0:  # collinear: y follows x
        return None
    a, b = (sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det
    return mt - a * mx - b * my, a, b
