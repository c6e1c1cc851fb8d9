"""decider-depths (issue #18, TaH2's L_max sweep): the job set is the decider set's late-switch base and per-token
decider at L_max 2, 4, 8 and nothing else; TaH2's measure (accuracy and loss per doubling of decode compute) from a
sweep; the claims decided over seeds from per-arm metrics. Synthetic sweeps and metrics; one `--quick --seeds 1`
run checks the wiring (the full experiment is `elastic-pretrain experiment decider-depths`, outside CI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_pretrain.config import flatten, load_yaml
from elastic_pretrain.eval.adaptive import AdaptiveResult, AdaptiveSweep, FixedPoint
from elastic_pretrain.experiments.analyses.decider_depths import DEPTHS, EXPERIMENT, arm, depth_metrics, slopes
from elastic_pretrain.experiments.registry import EXPERIMENTS
from elastic_pretrain.experiments.stats import evaluate
from tests.conftest import REPO
from tests.experiments.quick import QuickRun

SET = REPO / "jobs/experiments/decider-depths"
DECIDER_SET = REPO / "jobs/experiments/decider"


def _diff(a: Path, b: Path) -> dict[str, tuple[object, object]]:
    fa, fb = flatten(load_yaml(a)), flatten(load_yaml(b))
    return {k: (fa.get(k), fb.get(k)) for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


def test_the_set_is_the_decider_sets_base_and_per_token_decider_at_each_depth() -> None:
    assert EXPERIMENTS["decider-depths"] is EXPERIMENT
    assert sorted(p.name for p in SET.glob("*.yaml")) == sorted(
        [f"base-L{d}.yaml" for d in DEPTHS] + [f"decider-L{d}.yaml" for d in DEPTHS]
    )
    for d in DEPTHS:
        base = _diff(DECIDER_SET / "late-switch.yaml", SET / f"base-L{d}.yaml")
        assert base == ({} if d == 4 else {"model.loops": (2, d // 2)})  # L_max = loops x flatten 2
        dec = _diff(DECIDER_SET / "decider-per-token.yaml", SET / f"decider-L{d}.yaml")
        assert dec == {"decider.init_from": ("late-switch.yaml", f"base-L{d}.yaml")}


def _sweep(acc_fixed: float, acc_adaptive: float, loss_fixed: float) -> dict:
    """A sweep whose accuracy rises by the given amounts per doubling (compute 1/4, 1/2, 1) and whose fixed-depth
    loss falls by ``loss_fixed`` per doubling; adaptive loss is fixed depth's minus 0.01 inside."""
    compute = (0.25, 0.5, 1.0)
    fixed = tuple(
        FixedPoint(loops=i + 1, relative_compute=c, loss=3.0 + loss_fixed * i, accuracy=0.3 + acc_fixed * i)
        for i, c in enumerate(compute)
    )
    adaptive = tuple(
        AdaptiveResult(threshold=t, loss=3.0 + loss_fixed * i - (0.01 if i == 1 else 0.0), mean_passes=i + 1.0,
                       relative_compute=c, policy="per-loop", accuracy=0.3 + acc_adaptive * i)
        for i, (t, c) in enumerate(zip((1.01, 0.5, 0.0), compute, strict=True))
    )  # fmt: skip

    class Cmp:
        aucs = (2.5, 2.49)

    return {"sweep": AdaptiveSweep(fixed=fixed, adaptive=adaptive), "top": 3, "cmp": Cmp(), "inner": []}


def test_tah2_measure_per_doubling_of_decode_compute() -> None:
    m = _sweep(0.0179, 0.0274, -0.05)
    s = slopes(m)
    assert s["acc_per_doubling_fixed"] == pytest.approx(1.79)  # points, TaH2's units
    assert s["acc_per_doubling_adaptive"] == pytest.approx(2.74)
    assert s["acc_per_doubling_gain"] == pytest.approx(0.95)
    assert s["loss_per_doubling_fixed"] == pytest.approx(-0.05)
    assert s["loss_per_doubling_adaptive"] == pytest.approx(-0.05)  # the inner dip sits at the mean log2 compute
    metrics = depth_metrics(m)
    assert metrics["fixed_loss_at_l_max"] == pytest.approx(2.9) and metrics["adaptive_best_loss"] == pytest.approx(2.9)
    assert metrics["auc_vs_fixed"] == pytest.approx(-0.01) and metrics["l_max"] == 3.0


def _seed(noise: float, depths: tuple[int, ...] = DEPTHS) -> dict[str, dict[str, float]]:
    # the adaptive advantage grows with L_max (AUC gap -0.01 at 2, -0.02 at 4, -0.04 at 8); slopes steeper by 0.9
    return {
        arm(d): {"acc_per_doubling_gain": 0.9 + noise, "auc_vs_fixed": -0.01 * d / 2 + noise / 100} for d in depths
    }


def test_the_claims_are_decided_over_seeds_and_say_when_a_depth_is_missing() -> None:
    slope_claims, growth = EXPERIMENT.claims[:-1], EXPERIMENT.claims[-1]
    assert [c.measure.split(":")[0] for c in slope_claims] == [f"L_max = {d}" for d in DEPTHS]
    by_seed = {s: _seed(n) for s, n in zip((1, 2, 3), (0.0, 0.1, -0.05), strict=True)}
    assert all(evaluate(c, by_seed).verdict == "yes" for c in slope_claims)
    result = evaluate(growth, by_seed)
    assert result.verdict == "yes" and result.values[0] == pytest.approx(-0.04 + 0.01)  # L_max 8 minus L_max 2
    # without L_max = 8 the growth is read at the deepest arm there is; without a deeper arm it is not measured
    no8 = {s: _seed(n, (2, 4)) for s, n in zip((1, 2, 3), (0.0, 0.1, -0.05), strict=True)}
    assert evaluate(growth, no8).values[0] == pytest.approx(-0.02 + 0.01)
    assert evaluate(slope_claims[-1], no8).verdict == "no"
    only2 = {1: _seed(0.0, (2,))}
    missing = evaluate(growth, only2)
    assert missing.verdict == "no" and "decider-L8" in missing.reason


@pytest.mark.slow
def test_quick_decider_depths_experiment_measures_every_depth(decider_quick: QuickRun) -> None:
    # one seed, 2 steps per job, run after the decider experiment in one process (tests/experiments/conftest.py):
    # base-L4 is the decider set's late-switch job, whose run it reuses
    numbers = decider_quick.numbers("decider-depths")
    assert "base-L4: reused" in decider_quick.output
    assert {n: d["l_max"] for n, d in numbers["depths"].items()} == {arm(d): d for d in DEPTHS}
    metrics = numbers["metrics_by_seed"]["1234"]
    for d in DEPTHS:
        assert {"acc_per_doubling_gain", "loss_per_doubling_gain", "auc_vs_fixed"} <= set(metrics[arm(d)])
    assert len(numbers["claims"]) == 4 and all(c["values"] for c in numbers["claims"])  # every claim measured
