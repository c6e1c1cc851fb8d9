"""The decision rule of the experiment reports: the t quantile, the interval over seeds and the verdict,
on fixed numbers (compared with a printed t table, and with scipy.stats.t where scipy is installed)."""

from __future__ import annotations

import math

import pytest

from elastic_pretrain.experiments.stats import (
    Claim,
    Interval,
    decide,
    evaluate,
    paired,
    t_cdf,
    t_interval,
    t_quantile,
)

# two-sided 95% critical values t_{0.975, df} from a printed table (e.g. any statistics textbook)
T_TABLE_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 19: 2.093, 29: 2.045, 120: 1.980}


@pytest.mark.parametrize(("df", "t"), T_TABLE_975.items())
def test_t_quantile_matches_the_printed_table(df: int, t: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(t, abs=5e-4)
    assert t_quantile(0.025, df) == pytest.approx(-t, abs=5e-4)
    assert t_cdf(t_quantile(0.975, df), df) == pytest.approx(0.975, abs=1e-12)


def test_t_quantile_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 7, 30, 500):
        for p in (0.5, 0.6, 0.9, 0.95, 0.975, 0.995, 0.9995):
            assert t_quantile(p, df) == pytest.approx(float(stats.t.ppf(p, df)), rel=1e-9, abs=1e-12)


def test_t_interval_on_fixed_numbers() -> None:
    iv = t_interval([0.1, 0.2, 0.3])
    half = 4.302652729749464 * 0.1 / math.sqrt(3)  # t_{0.975, 2} · s / √n with s = 0.1
    assert (iv.mean, iv.std, iv.n) == (pytest.approx(0.2), pytest.approx(0.1), 3)
    assert (iv.lo, iv.hi) == (pytest.approx(0.2 - half), pytest.approx(0.2 + half))
    one = t_interval([0.5])
    assert (one.lo, one.hi, one.n) == (0.5, 0.5, 1)
    with pytest.raises(ValueError):
        t_interval([])


def _iv(lo: float, hi: float, n: int = 3) -> Interval:
    return Interval(mean=(lo + hi) / 2, std=0.01, n=n, lo=lo, hi=hi)


@pytest.mark.parametrize(
    ("lo", "hi", "expect", "verdict"),
    [
        (-0.05, -0.01, "negative", "yes"),
        (0.01, 0.05, "positive", "yes"),
        (0.01, 0.05, "negative", "contradicted"),
        (-0.05, -0.01, "positive", "contradicted"),
        (-0.01, 0.05, "negative", "not resolved at this scale"),
        (-0.01, 0.05, "positive", "not resolved at this scale"),
        (0.0, 0.05, "positive", "not resolved at this scale"),  # touching zero does not exclude it
    ],
)
def test_decide_states_a_direction_only_when_the_interval_excludes_zero(
    lo: float, hi: float, expect: str, verdict: str
) -> None:
    assert decide(_iv(lo, hi), expect)[0] == verdict  # type: ignore[arg-type]


def test_decide_needs_three_seeds_and_reads_matches_as_a_band() -> None:
    verdict, reason = decide(_iv(-0.05, -0.01, n=2), "negative")
    assert verdict == "no" and "≥ 3" in reason and "--seeds" in reason
    assert decide(_iv(-0.004, 0.006), "equal", margin=0.01)[0] == "yes"
    assert decide(_iv(0.02, 0.05), "equal", margin=0.01)[0] == "contradicted"
    assert decide(_iv(-0.03, -0.015), "equal", margin=0.01)[0] == "contradicted"
    assert decide(_iv(-0.002, 0.02), "equal", margin=0.01)[0] == "not resolved at this scale"


def test_a_claim_is_decided_on_paired_differences_per_seed() -> None:
    # b is 0.1 above a in every seed although both arms swing by 1.0 between seeds: the paired difference
    # resolves what the unpaired spread would hide
    by_seed = {
        s: {"a": {"loss": 2.0 + d}, "b": {"loss": 2.1 + d + e}}
        for s, d, e in ((1, 0.0, 0.001), (2, 1.0, -0.002), (3, -1.0, 0.0))
    }
    claim = Claim(
        paper="a beats b",
        source="test",
        magnitude="",
        measure="a − b",
        value=paired("a", "b", "loss"),
        expect="negative",
    )
    result = evaluate(claim, by_seed)
    assert result.values == pytest.approx((-0.101, -0.098, -0.1))
    assert result.verdict == "yes" and result.interval is not None and result.interval.hi < 0
    flipped = evaluate(Claim(**{**claim.__dict__, "expect": "positive"}), by_seed)
    assert flipped.verdict == "contradicted"
    missing = evaluate(Claim(**{**claim.__dict__, "value": paired("a", "c", "loss")}), by_seed)
    assert missing.verdict == "not measured" and "'c'" in missing.reason and missing.interval is None
