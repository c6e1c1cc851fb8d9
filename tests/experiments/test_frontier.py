"""Adaptive depth scored on the Pareto frontier of the operating points a decider reaches (issue 32 item 2): the
frontier of hand-made points (dominated, duplicate and equal-compute points dropped), the mean gap to a reference
curve, one decider run's scores from its stored numbers (forced ends and dominated thresholds never count), and
the decider experiment's claims from a seed's stored numbers — gated by the premise that depth pays."""

from __future__ import annotations

import math

import pytest

from elastic_pretrain.eval.curves import frontier_gap, pareto_front
from elastic_pretrain.experiments.analyses import decider
from elastic_pretrain.experiments.analyses.decider_measure import frontier_scores, reachable
from elastic_pretrain.experiments.stats import PREMISE_ABSENT, evaluate


def test_pareto_front_keeps_the_points_no_other_beats_in_compute_and_loss() -> None:
    pts = [(0.9, 2.0), (0.5, 2.5), (0.7, 2.6), (0.6, 2.4), (0.6, 2.45), (0.5, 2.5), (1.0, 2.0)]
    # (0.7, 2.6) costs more than (0.6, 2.4) and loses more; (0.6, 2.45) loses more at equal compute; (1.0, 2.0)
    # costs more at equal loss than (0.9, 2.0); the duplicate (0.5, 2.5) is kept once
    assert pareto_front(pts) == [(0.5, 2.5), (0.6, 2.4), (0.9, 2.0)]
    assert pareto_front([]) == [] and pareto_front([(0.3, 1.0)]) == [(0.3, 1.0)]
    acc = [(0.5, -0.40), (0.6, -0.38), (0.8, -0.45)]  # accuracy: pass its negative
    assert pareto_front(acc) == [(0.5, -0.40), (0.8, -0.45)]
    with pytest.raises(ValueError, match="non-finite"):
        pareto_front([(0.5, math.nan)])


def test_frontier_gap_averages_the_frontier_against_the_interpolated_reference() -> None:
    ref = [(0.5, 3.0), (1.0, 2.0)]  # linear: 3.0 at 0.5, 2.5 at 0.75, 2.0 at 1
    pts = [(0.75, 2.4), (0.8, 2.6), (1.0, 2.0)]  # (0.8, 2.6) is dominated by (0.75, 2.4)
    assert frontier_gap(pts, ref) == pytest.approx(((2.4 - 2.5) + (2.0 - 2.0)) / 2)
    assert frontier_gap([(0.25, 3.5)], ref) == pytest.approx(0.5)  # held constant beyond the reference's ends
    with pytest.raises(ValueError, match="no operating points"):
        frontier_gap([], ref)


def _run(inner: list[tuple[float, float, float, float]], fixed_loss: tuple[float, ...] = (3.0, 2.6, 2.4, 2.3)) -> dict:
    """A decider run's stored numbers (as the JSON report holds them): fixed depth ℓ = 1..4 at relative compute
    0.4, 0.6, 0.8, 1.0; the sweep's forced ends (threshold 0: ℓ = 4, threshold 1.01: ℓ = 1, and 0.9, where the
    decider also stops every token after one pass) and ``inner`` (mean passes, compute, loss, accuracy)."""
    compute = (0.4, 0.6, 0.8, 1.0)
    fixed = [{"loops": i + 1, "relative_compute": c, "loss": v, "accuracy": 0.5 - v / 10}
             for i, (c, v) in enumerate(zip(compute, fixed_loss, strict=True))]  # fmt: skip
    end_hi = {"threshold": 0.0, "mean_passes": 4.0, "relative_compute": 1.0, "loss": fixed_loss[-1], "accuracy": 0.3}
    end_lo = {"threshold": 1.01, "mean_passes": 1.0, "relative_compute": 0.4, "loss": fixed_loss[0], "accuracy": 0.2}
    sweep = [{"threshold": 0.1 * (i + 1), "mean_passes": p, "relative_compute": c, "loss": v, "accuracy": a}
             for i, (p, c, v, a) in enumerate(inner)]  # fmt: skip
    forced = {**end_lo, "threshold": 0.9}
    random = [{"q": 0.5, "mean_passes": 2.0, "relative_compute": 0.6, "loss": 2.7, "accuracy": 0.2}]
    return {"backbone": "frozen", "fixed": fixed, "adaptive": [end_hi, *sweep, forced, end_lo], "random_stop": random}


def test_frontier_scores_drop_forced_ends_and_dominated_thresholds() -> None:
    # inner: (2 passes, 0.6, 2.5) beats fixed depth by 0.1; (2.5 passes, 0.7, 2.7) is dominated by it (an AUC
    # over every threshold would count its +0.2 against fixed depth); (3 passes, 0.8, 2.4) equals fixed depth
    run = _run([(2.0, 0.6, 2.5, 0.30), (2.5, 0.7, 2.7, 0.25), (3.0, 0.8, 2.4, 0.31)])
    assert [r["mean_passes"] for r in reachable(run["adaptive"], 4)] == [2.0, 2.5, 3.0]
    s = frontier_scores(run, {"base": [(0.4, 2.9), (1.0, 2.3)]})
    assert s["frontier_points"] == 2.0
    assert s["frontier_vs_own_fixed"] == pytest.approx((-0.1 + 0.0) / 2)
    assert s["frontier_vs_base"] == pytest.approx(((2.5 - 2.7) + (2.4 - 2.5)) / 2)  # base: 2.9 → 2.3 linearly
    # random stopping with the sweep's ends: (0.4, 3.0), (0.6, 2.7), (1.0, 2.3): 2.7 at 0.6, 2.5 at 0.8
    assert s["frontier_vs_random"] == pytest.approx(((2.5 - 2.7) + (2.4 - 2.5)) / 2)
    assert s["own_depth_gain"] == pytest.approx(2.3 - 3.0)
    # accuracy frontier: (0.6, 0.30), (0.8, 0.31); fixed depth 0.24 at 0.6, 0.26 at 0.8 → +6 and +5 points
    assert s["acc_frontier_vs_own_fixed"] == pytest.approx((6.0 + 5.0) / 2)
    # a decider that decides nothing (every threshold forced): no frontier to score, said as "not measured"
    none = frontier_scores(_run([]), {})
    assert none["frontier_points"] == 0.0 and "frontier_vs_own_fixed" not in none
    assert "last_loop_frontier_vs_own_fixed" not in s  # numbers stored before the last-loop sweep: not measured


def test_the_last_loop_sweep_is_scored_against_fixed_depth_under_the_same_cache() -> None:
    """Adaptive depth as `generate` serves it (issue 32 item 3): its frontier against the same checkpoint's fixed
    depth under the last-loop cache, not the per-loop one (under which the whole-sequence curve is lower)."""
    run = _run([(2.0, 0.6, 2.5, 0.30)])
    last = _run([(2.0, 0.6, 2.75, 0.28), (3.0, 0.8, 2.9, 0.27)], fixed_loss=(3.1, 2.8, 2.7, 2.6))
    run["last_loop"] = {"fixed": last["fixed"], "adaptive": last["adaptive"]}
    s = frontier_scores(run, {})
    assert s["frontier_vs_own_fixed"] == pytest.approx(2.5 - 2.6)  # per-loop: its own per-loop fixed depth
    # last-loop frontier: (0.6, 2.75) only ((0.8, 2.9) is dominated); fixed depth under last-loop at 0.6: 2.8
    assert s["last_loop_frontier_vs_own_fixed"] == pytest.approx(2.75 - 2.8)
    assert s["last_loop_depth_gain"] == pytest.approx(2.6 - 3.1)


def _seed(base_gain: float, frozen_gap: float, noise: float) -> dict:
    """One seed's stored decider numbers: the base's fixed depth gains ``base_gain`` from ℓ = 1 to 4; the frozen
    decider's inner threshold sits ``frozen_gap`` above the base's fixed depth; per-token and uniform arms alike."""
    base = {"1": 3.0, "2": 2.8, "3": 2.7, "4": 3.0 + base_gain}
    fixed = tuple(base[k] for k in ("1", "2", "3", "4"))
    runs = {name: _run([(2.0, 0.6, 2.8 + frozen_gap + noise, 0.3)], fixed) for name in
            (decider.FROZEN, decider.PER_TOKEN, decider.UNIFORM)}  # fmt: skip
    return {"deciders": runs, "base_loss_by_loops": base}


def test_the_decider_claims_read_the_frontier_and_are_gated_by_depth_paying() -> None:
    # the stored reports' pattern: the frozen decider loses to fixed depth at every seed (an AUC-based claim read
    # "contradicted"), but the base's fixed depth at L_max is no better than at ℓ = 1: the premise is absent
    flat = {s: decider.rescore(_seed(g, 0.02, n), {}) for s, g, n in ((1, 0.001, 0.0), (2, -0.002, 0.001),
                                                                      (3, 0.0005, -0.001))}  # fmt: skip
    assert flat[1][decider.BASE]["depth_gain"] == pytest.approx(0.001)
    assert flat[2][decider.FROZEN]["frontier_vs_base"] == pytest.approx(0.021)
    claims = [c for c in decider.EXPERIMENT.claims if c.kind != "premise"]
    assert len(claims) == 7 and all(c.premise is decider.DEPTH_PAYS for c in claims)
    frozen = claims[0]
    assert evaluate(decider.DEPTH_PAYS, flat).verdict == "not resolved at this scale"
    result = evaluate(frozen, flat)
    assert result.verdict == PREMISE_ABSENT and result.interval is not None and result.interval.lo > 0
    # where depth pays (ℓ = 4 below ℓ = 1 at every seed) the same numbers are a contradiction
    pays = {s: decider.rescore(_seed(g, 0.02, n), {}) for s, g, n in ((1, -0.3, 0.0), (2, -0.31, 0.001),
                                                                      (3, -0.29, -0.001))}  # fmt: skip
    assert evaluate(frozen, pays).verdict == "contradicted"
    better = {s: decider.rescore(_seed(-0.3, -0.05, n), {}) for s, n in ((1, 0.0), (2, 0.001), (3, -0.002))}
    assert evaluate(frozen, better).verdict == "yes"
    # rescoring keeps the metrics it does not recompute (the AUCs of reports written before)
    kept = decider.rescore(_seed(0.0, 0.0, 0.0), {decider.FROZEN: {"auc_vs_fixed": 0.01}})
    assert kept[decider.FROZEN]["auc_vs_fixed"] == 0.01 and "frontier_vs_base" in kept[decider.FROZEN]


def test_decider_depth_pays_reads_its_own_base_and_the_passes_difficulty_correlation() -> None:
    """decider-depth-pays (issue 32 item 1): the premise reads the stored base's name (``mixed``, not decider's
    late-switch), the passes–difficulty ρ comes from the stored numbers, and the two ρ claims are gated by the
    premise like every other claim of the set."""
    from elastic_pretrain.experiments.analyses import decider_depth_pays as dp

    def seed(gain: float, rho: float) -> dict:
        numbers = {**_seed(gain, -0.05, 0.0), "base": "mixed"}
        numbers["passes_by_difficulty"] = {
            name: {"threshold": 0.5, "mean_passes": {"0": 1.2, "1": 1.5}, "count": {"0": 9, "1": 3},
                   "rho_answers": rho, "rho_all": rho / 2}
            for name in (decider.FROZEN, decider.PER_TOKEN)
        }  # fmt: skip
        return decider.rescore(numbers, {})

    pays = {s: seed(-0.3 - s / 100, 0.4 + s / 100) for s in (1, 2, 3)}
    assert "late-switch" not in pays[1] and pays[1]["mixed"]["depth_gain"] == pytest.approx(-0.31)
    assert pays[2][decider.PER_TOKEN]["passes_rho_answers"] == pytest.approx(0.42)
    assert pays[2][decider.FROZEN]["passes_rho_all"] == pytest.approx(0.21)
    assert "passes_rho_answers" not in pays[2][decider.UNIFORM]  # no stored passes: no metric, no made-up 0
    claims = dp.EXPERIMENT.claims
    assert claims[0] is dp.PREMISE and dp.PREMISE.kind == "premise" and "mixed" in dp.PREMISE.measure
    assert len(claims) == 10 and all(c.premise is dp.PREMISE for c in claims[1:])
    rho = claims[-2:]
    assert [evaluate(c, pays).verdict for c in rho] == ["yes", "yes"]
    assert evaluate(claims[1], pays).verdict == "yes"  # the frozen frontier below the base's fixed depth
    flat = {s: seed(0.001 * (-1) ** s, 0.4 + s / 100) for s in (1, 2, 3)}
    assert [evaluate(c, flat).verdict for c in rho] == [PREMISE_ABSENT, PREMISE_ABSENT]
    against = {s: seed(-0.3 - s / 100, -0.4 - s / 100) for s in (1, 2, 3)}
    assert evaluate(rho[0], against).verdict == "contradicted"
    # decider's own claims still read late-switch: a report stored before "base" existed rescores as before
    assert decider.DEPTH_PAYS is decider.EXPERIMENT.claims[0] and "late-switch" in decider.DEPTH_PAYS.measure
