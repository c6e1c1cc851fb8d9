"""How a report decides a paper's claim: a t-interval over seeds of a paired difference.

Every arm trains with the same seeds, so a claim's quantity is measured once per seed from that seed's runs
only, and a direction is stated only when the two-sided 95% Student-t interval of the mean excludes zero
(the t quantile is computed here: no scipy). Labels keep a verdict from saying more than the numbers can:
a claim whose *premise* (above all, that depth pays) did not resolve reads "not resolved — premise absent";
another metric than the paper's reads "not comparable"; an *implementation check* fails as "no".
docs/experiments.md, "The claim table" (verdicts, "Premises and labels").
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Literal

CONFIDENCE = 0.95  # two-sided, for every interval in every report
MIN_SEEDS = 3

Direction = Literal["negative", "positive", "equal"]  # the sign the paper predicts for the quantity
Verdict = Literal[
    "yes",
    "no",
    "contradicted",
    "not resolved at this scale",
    "not resolved — premise absent",
    "not comparable",
    "not measured",
]
PREMISE_ABSENT: Verdict = "not resolved — premise absent"  # the claim's premise did not resolve "yes"
NOT_COMPARABLE: Verdict = "not comparable"  # another metric than the paper's: no agreement or contradiction stated
NOT_MEASURED: Verdict = "not measured"  # an arm or a quantity the stored numbers lack, or no seed ran
# "paper": a paper's claim; "premise": a condition other claims presuppose (e.g. depth pays on these runs);
# "implementation check": an accounting identity of our code, not evidence for a paper
Kind = Literal["paper", "premise", "implementation check"]
Metrics = dict[str, dict[str, float]]  # one seed's scalar metrics: arm (job name) -> metric -> value


# ---------------------------------------------------------------------------------------------------
# Student-t quantile (regularized incomplete beta by Lentz's continued fraction, then bisection)
def _beta_cf(a: float, b: float, x: float) -> float:
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # fmt: skip
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_cf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t value with P(T ≤ t) = p for Student's t with ``df`` degrees of freedom."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return 0.5 * (lo + hi)


# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Interval:
    """Mean of per-seed values with its two-sided t-interval (n ≥ 2; with n = 1 lo = hi = mean)."""

    mean: float
    std: float  # sample standard deviation over the seeds (the seed noise of this quantity)
    n: int
    lo: float
    hi: float
    confidence: float = CONFIDENCE

    def text(self, fmt: str = "+.4f") -> str:
        if self.n < 2:
            return f"{self.mean:{fmt}} (1 seed)"
        return f"{self.mean:{fmt}} [{self.lo:{fmt}}, {self.hi:{fmt}}] (n={self.n}, std {self.std:.4f})"


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Student-t interval of the mean: mean ± t_{(1+c)/2, n−1} · s / √n."""
    if not values:
        raise ValueError("t_interval of no values")
    mean = statistics.fmean(values)
    n = len(values)
    if n < 2:
        return Interval(mean=mean, std=0.0, n=n, lo=mean, hi=mean, confidence=confidence)
    std = statistics.stdev(values)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * std / math.sqrt(n)
    return Interval(mean=mean, std=std, n=n, lo=mean - half, hi=mean + half, confidence=confidence)


def decide(iv: Interval, expect: Direction, *, margin: float = 0.0) -> tuple[Verdict, str]:
    """The verdict on a claim from the interval of its per-seed values, and the reason in words.

    ``negative``/``positive``: yes when the interval excludes zero on the predicted side, contradicted when
    it excludes zero on the other side. ``equal`` ("matches"): yes when the interval lies inside
    [−margin, margin], contradicted when it lies wholly outside it (two one-sided tests)."""
    pct = f"{iv.confidence:.0%}"
    if iv.n < MIN_SEEDS:
        return "no", f"{iv.n} seed(s): an interval needs ≥ {MIN_SEEDS} (--seeds)"
    if expect == "equal":
        if -margin <= iv.lo and iv.hi <= margin:
            return "yes", f"the {pct} interval lies within ±{margin:g}"
        if iv.lo > margin or iv.hi < -margin:
            return "contradicted", f"the {pct} interval lies outside ±{margin:g}"
        return "not resolved at this scale", f"the {pct} interval overlaps ±{margin:g} without lying inside it"
    if iv.lo <= 0.0 <= iv.hi:
        return "not resolved at this scale", f"the {pct} interval includes 0"
    sign: Direction = "negative" if iv.hi < 0.0 else "positive"
    if sign == expect:
        return "yes", f"the {pct} interval excludes 0 ({sign}, as the paper)"
    return "contradicted", f"the {pct} interval excludes 0 ({sign}, the paper: {expect})"


# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Claim:
    """A paper's claim as an experiment tests it: a quantity measured per seed and its predicted sign."""

    paper: str  # the claim, quoted from ../shared/seeds/ (file named in ``source``)
    source: str  # e.g. "seeds/003 (ELR)"
    magnitude: str  # the paper's number, in the paper's units
    measure: str  # what this report computes per seed, in words (with units)
    value: Callable[[Metrics], float]  # that quantity from one seed's metrics (KeyError: an arm is missing)
    expect: Direction
    margin: float = 0.0  # for expect="equal": the band that counts as "matches"
    # A claim this one presupposes, e.g. a share of an improvement presupposes the improvement, and an adaptive
    # depth claim that more passes lower the loss: unless the premise resolves "yes", this claim is "not
    # resolved — premise absent" whatever its own interval says (a ratio over an improvement that is absent or
    # negative, or a decider's gain where depth gains nothing, has no meaning to compare with the paper's).
    premise: Claim | None = None
    kind: Kind = "paper"
    # False where the quantity is another metric than the paper's number (next-token accuracy against Koi-4B's
    # benchmark scores): an interval that would agree or disagree with that number reads "not comparable"
    comparable: bool = True


@dataclasses.dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    values: tuple[float, ...]  # one per seed, in seed order
    interval: Interval | None
    verdict: Verdict
    reason: str
    premise: ClaimResult | None = None  # the premise's own result, where the claim has one


def paired(a: str, b: str, metric: str) -> Callable[[Metrics], float]:
    """Arm ``a`` minus arm ``b`` on ``metric``, within one seed (same initialisation and data)."""
    return lambda m: m[a][metric] - m[b][metric]


def _values(claim: Claim, by_seed: dict[int, Metrics]) -> tuple[tuple[float, ...], str | None]:
    """The claim's value at every seed, or () and why it cannot be measured."""
    try:
        return tuple(claim.value(m) for m in by_seed.values()), None
    except KeyError as e:
        return (), (f"no {e.args[0]!r} (an arm the job set lacks, a quantity these runs give "
                    "nothing to measure, or one measured only since these numbers were stored)")  # fmt: skip


def _premise_reason(premise: ClaimResult) -> str:
    if premise.interval is not None:
        shown = f"{premise.interval.text()}, {premise.verdict}"
    else:
        shown = f"{NOT_MEASURED}: {premise.reason}" if premise.verdict == NOT_MEASURED else premise.reason
    what = f"{premise.claim.measure}: {shown}"
    return f"its premise is not established here ({what}); the claim's own interval is not read"


def _labelled(claim: Claim, verdict: Verdict, reason: str) -> tuple[Verdict, str]:
    """The verdict as the claim's kind and comparability allow it to be stated (module docstring)."""
    if claim.kind == "implementation check" and verdict == "contradicted":
        return "no", f"the check fails: {reason}"
    if claim.kind == "premise" and verdict == "contradicted":  # a condition of this setting, not the paper's claim
        return "no", f"the premise does not hold here: {reason}"
    if not claim.comparable and verdict in ("yes", "contradicted"):
        return NOT_COMPARABLE, (f"{reason}; but on another metric than the paper's number, so neither agreement nor "
                                "contradiction with it")  # fmt: skip
    return verdict, reason


def evaluate(claim: Claim, by_seed: dict[int, Metrics]) -> ClaimResult:
    """The claim's values over the seeds, their interval and the verdict: its premise first (an absent premise
    gates the claim even where the claim's own values were measured), then its own interval."""
    values, missing = _values(claim, by_seed)
    finite = bool(values) and all(math.isfinite(v) for v in values)
    iv = t_interval(values) if finite else None
    premise = evaluate(claim.premise, by_seed) if claim.premise is not None else None
    if premise is not None and premise.verdict != "yes":
        other = "" if claim.comparable else "; on another metric than the paper's number besides (not comparable)"
        return ClaimResult(claim, values, iv, PREMISE_ABSENT, _premise_reason(premise) + other, premise)
    if missing is not None:
        return ClaimResult(claim, (), None, NOT_MEASURED, missing, premise)
    if not values:
        return ClaimResult(claim, (), None, NOT_MEASURED, "no seeds ran", premise)
    if iv is None:  # e.g. a share of an improvement that is 0 at some seed
        return ClaimResult(claim, values, None, "no", "undefined at some seed (a ratio over 0)", premise)
    verdict, reason = decide(iv, claim.expect, margin=claim.margin)
    return ClaimResult(claim, values, iv, *_labelled(claim, verdict, reason), premise)
