"""Quality-budget curves: loss against relative compute, and their area (AUC).

A curve has one point per loop count (or per decider threshold: mean passes per token), placed at its
relative compute FLOPs(ℓ) / FLOPs(L_max) (``model/flops.py``). Pure arithmetic: the losses come from
``eval/loss.py``, tables and plots from ``eval/report.py``.

**AUC** (:func:`auc`): the area under loss against relative compute is the trapezoid integral of loss
over the curve's compute range divided by the width of that range, i.e. the *compute-averaged loss*
(same unit as the loss, lower is better, and comparable between models whose shallowest exit costs a
different fraction of their deepest). Edge cases: one point (or all points at the same compute) → the
mean loss of the points. :func:`compare` integrates every curve over the *common* compute range
(linear interpolation at the ends) so that relative AUC differences compare like with like.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class CurvePoint:
    """One operating point: a loop count (or mean passes under adaptive depth), its cost and loss."""

    loops: float
    relative_compute: float
    loss: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@dataclasses.dataclass(frozen=True)
class QualityCurve:
    """Loss against relative compute; points sorted by compute."""

    name: str
    points: tuple[CurvePoint, ...]
    flops_max: float = 0.0  # FLOPs/token at L_max (for the table); 0 = unknown

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError(f"curve {self.name!r} has no points")
        object.__setattr__(self, "points", tuple(sorted(self.points, key=lambda p: (p.relative_compute, p.loops))))

    @property
    def auc(self) -> float:
        return auc([p.relative_compute for p in self.points], [p.loss for p in self.points])


def auc(compute: Sequence[float], loss: Sequence[float], *, lo: float | None = None, hi: float | None = None) -> float:
    """Compute-averaged loss: trapezoid ∫ loss d(compute) over [lo, hi] / (hi − lo).

    ``lo``/``hi`` default to the curve's own compute range; inside it the curve is linearly
    interpolated (used by :func:`compare` for a common range). Points at equal compute are averaged
    first. One point, or ``lo == hi``: the (interpolated) loss there.
    """
    if len(compute) != len(loss) or not compute:
        raise ValueError(f"auc needs equally many (>= 1) compute and loss values, got {len(compute)}, {len(loss)}")
    by_c: dict[float, list[float]] = {}
    for c, v in zip(compute, loss, strict=True):
        if not (math.isfinite(c) and math.isfinite(v)):
            raise ValueError(f"auc: non-finite point ({c}, {v})")
        by_c.setdefault(float(c), []).append(float(v))
    xs = sorted(by_c)
    ys = [sum(by_c[x]) / len(by_c[x]) for x in xs]
    lo = xs[0] if lo is None else lo
    hi = xs[-1] if hi is None else hi
    if lo < xs[0] - 1e-12 or hi > xs[-1] + 1e-12 or lo > hi:
        raise ValueError(f"auc range [{lo}, {hi}] is not inside the curve's compute range [{xs[0]}, {xs[-1]}]")
    if hi - lo <= 0:
        return interp(xs, ys, lo)
    grid = [lo] + [x for x in xs if lo < x < hi] + [hi]
    vals = [interp(xs, ys, x) for x in grid]
    area = sum((grid[i + 1] - grid[i]) * (vals[i] + vals[i + 1]) / 2 for i in range(len(grid) - 1))
    return area / (hi - lo)


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """``ys`` linearly interpolated at ``x`` over sorted ``xs`` (held constant beyond the ends)."""
    if x <= xs[0]:
        return ys[0]
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            w = (x - xs[i]) / (xs[i + 1] - xs[i])
            return ys[i] + w * (ys[i + 1] - ys[i])
    return ys[-1]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """AUCs of several curves over their common compute range, relative to the first (the reference)."""

    names: tuple[str, ...]
    lo: float
    hi: float
    aucs: tuple[float, ...]

    @property
    def relative(self) -> tuple[float, ...]:
        """(AUC_i − AUC_ref) / AUC_ref; negative = lower (better) loss per unit of compute."""
        ref = self.aucs[0]
        return tuple((a - ref) / ref for a in self.aucs)


def compare(curves: Sequence[QualityCurve]) -> Comparison:
    """AUC of every curve over the common compute range, relative to ``curves[0]`` (plotted by
    ``eval/report.py:plot_comparison``)."""
    if not curves:
        raise ValueError("compare needs at least one curve")
    lo = max(c.points[0].relative_compute for c in curves)
    hi = min(c.points[-1].relative_compute for c in curves)
    if lo > hi:
        raise ValueError(f"curves share no compute range (latest start {lo:.3f} > earliest end {hi:.3f})")
    aucs = tuple(auc([p.relative_compute for p in c.points], [p.loss for p in c.points], lo=lo, hi=hi) for c in curves)
    return Comparison(names=tuple(c.name for c in curves), lo=lo, hi=hi, aucs=aucs)


# ---------------------------------------------------------------------------------------------------
# Pareto frontier of operating points (issue 32: adaptive depth is scored on the points worth choosing)
def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points (compute, loss) that no other point dominates, by increasing compute (so by decreasing loss).

    A point is dominated when another costs no more and loses no more, and is better in one of the two: no
    budget would choose it. Of points equal in both, one is kept. For a quantity where higher is better
    (accuracy), pass its negative. Non-finite points are refused (ValueError)."""
    if any(not (math.isfinite(c) and math.isfinite(v)) for c, v in points):
        raise ValueError(f"pareto_front: non-finite point in {list(points)}")
    front: list[tuple[float, float]] = []
    for c, v in sorted((float(c), float(v)) for c, v in points):  # by compute, then loss: the cheapest first
        if not front or v < front[-1][1]:  # lower loss than every cheaper (or equally cheap) point kept
            front.append((c, v))
    return front


def frontier_gap(points: Sequence[tuple[float, float]], reference: Sequence[tuple[float, float]]) -> float:
    """Mean over the Pareto frontier of ``points`` of (loss − ``reference`` at the same compute), the reference a
    curve (compute, loss) linearly interpolated (held constant beyond its ends). Negative: the frontier lies
    below the reference. ValueError without points."""
    front = pareto_front(points)
    if not front:
        raise ValueError("frontier_gap: no operating points")
    ref = sorted(reference)
    xs, ys = [x for x, _ in ref], [y for _, y in ref]
    return sum(v - interp(xs, ys, c) for c, v in front) / len(front)
