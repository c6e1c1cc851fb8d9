"""decider-depths (issue #18, TaH2's L_max sweep): the job set is the decider set's late-switch base, per-token
decider and uniform-depth control at L_max 2, 4, 8 and nothing else; TaH2's measure (accuracy and loss per
doubling of decode compute) from a sweep; the claims decided over seeds from per-arm metrics. Synthetic sweeps and
metrics; one `--quick --seeds 1` run checks the wiring (the full experiment is `elastic-pretrain experiment
decider-depths`, outside CI)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from elastic_pretrain.config import flatten, load_yaml
from elastic_pretrain.eval.adaptive import AdaptiveResult, AdaptiveSweep, FixedPoint
from elastic_pretrain.experiments.analyses.decider_depths import (
    DEPTHS,
    EXPERIMENT,
    arm,
    control,
    depth_metrics,
    slopes,
)
from elastic_pretrain.experiments.registry import EXPERIMENTS
from elastic_pretrain.experiments.stats import NOT_MEASURED, PREMISE_ABSENT, evaluate
from tests.conftest import REPO
from tests.experiments.quick import QuickRun

SET = REPO / "jobs/experiments/decider-depths"
DECIDER_SET = REPO / "jobs/experiments/decider"


def _diff(a: Path, b: Path) -> dict[str, tuple[object, object]]:
    fa, fb = flatten(load_yaml(a)), flatten(load_yaml(b))
    return {k: (fa.get(k), fb.get(k)) for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


def test_the_set_is_the_decider_sets_base_per_token_decider_and_control_at_each_depth() -> None:
    assert EXPERIMENTS["decider-depths"] is EXPERIMENT
    assert sorted(p.name for p in SET.glob("*.yaml")) == sorted(
        [f"{kind}-L{d}.yaml" for d in DEPTHS for kind in ("base", "decider", "uniform")]
    )
    for d in DEPTHS:
        base = _diff(DECIDER_SET / "late-switch.yaml", SET / f"base-L{d}.yaml")
        assert base == ({} if d == 4 else {"model.loops": (2, d // 2)})  # L_max = loops x flatten 2
        dec = _diff(DECIDER_SET / "decider-per-token.yaml", SET / f"decider-L{d}.yaml")
        assert dec == {"decider.init_from": ("late-switch.yaml", f"base-L{d}.yaml")}
        ctrl = _diff(DECIDER_SET / "decider-uniform.yaml", SET / f"{control(d)}.yaml")
        assert ctrl == {"decider.init_from": ("late-switch.yaml", f"base-L{d}.yaml")}


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

    base_loss = {p.loops: p.loss + 0.02 for p in fixed}  # the base: 0.02 nat above the post-trained backbone
    # the control (uniform depth on the same tokens): 0.005 nat below the decider's own fixed depth, accuracy rising
    # 1 point per doubling
    ctrl = tuple(dataclasses.replace(p, loss=p.loss - 0.005, accuracy=0.3 + 0.01 * i) for i, p in enumerate(fixed))
    return {"sweep": AdaptiveSweep(fixed=fixed, adaptive=adaptive), "top": 3, "cmp": Cmp(), "inner": [],
            "control": [], "base_loss": base_loss, "control_fixed": ctrl}  # fmt: skip


def test_tah2_measure_per_doubling_of_decode_compute() -> None:
    m = _sweep(0.0179, 0.0274, -0.05)
    s = slopes(m)
    assert s["acc_per_doubling_fixed"] == pytest.approx(1.79)  # points, TaH2's units
    assert s["acc_per_doubling_adaptive"] == pytest.approx(2.74)
    assert s["acc_per_doubling_gain"] == pytest.approx(0.95)
    assert s["loss_per_doubling_fixed"] == pytest.approx(-0.05)
    assert s["loss_per_doubling_adaptive"] == pytest.approx(-0.05)  # the inner dip sits at the mean log2 compute
    assert s["acc_per_doubling_control"] == pytest.approx(1.0)  # the control's fixed depth, not the decider's own
    assert s["acc_per_doubling_gain_vs_control"] == pytest.approx(1.74)
    assert s["loss_per_doubling_gain_vs_control"] == pytest.approx(0.0)
    metrics = depth_metrics(m)
    assert metrics["fixed_loss_at_l_max"] == pytest.approx(2.9) and metrics["adaptive_best_loss"] == pytest.approx(2.9)
    assert metrics["auc_vs_fixed"] == pytest.approx(-0.01) and metrics["l_max"] == 3.0
    # the premise and the frontier (issue 32): the base gains 2 x loss_fixed from ℓ = 1 to 3; the one threshold the
    # decider decides (2 passes) sits 0.01 below its own fixed depth and 0.03 below the base's
    assert metrics["base_depth_gain"] == pytest.approx(-0.1) and metrics["frontier_points"] == 1.0
    assert metrics["frontier_vs_own_fixed"] == pytest.approx(-0.01)
    assert metrics["frontier_vs_base"] == pytest.approx(-0.03)
    assert metrics["frontier_vs_control"] == pytest.approx(-0.005)  # what the claims read
    assert metrics["control_depth_gain"] == pytest.approx(-0.1)
    # stored as the report stores it, rescoring from the JSON gives the same metrics
    import json

    from elastic_pretrain.experiments.analyses.decider_depths import rescore, sweep_numbers

    stored = json.loads(json.dumps({"depths": {"decider-L2": sweep_numbers(m)}}))
    assert rescore(stored, {"decider-L2": {"x": 1.0}})["decider-L2"] == {"x": 1.0, **scores_of(m)}
    assert rescore({"depths": {"decider-L2": {"l_max": 2}}}, {"decider-L2": {"x": 1.0}}) == {"decider-L2": {"x": 1.0}}
    # a report stored before the controls: scored against the base only, so its claims read "not measured"
    old = json.loads(json.dumps({"depths": {"decider-L2": {**sweep_numbers(m), "control_fixed": None}}}))
    old["depths"]["decider-L2"].pop("control_fixed")
    rescored = rescore(old, {"decider-L2": {}})["decider-L2"]
    assert "frontier_vs_base" in rescored and "frontier_vs_control" not in rescored


def scores_of(m: dict) -> dict:
    from elastic_pretrain.experiments.analyses.decider_depths import scores, sweep_numbers

    return scores(sweep_numbers(m))


def _seed(noise: float, depths: tuple[int, ...] = DEPTHS, gain: float = -0.1) -> dict[str, dict[str, float]]:
    # the adaptive advantage on the frontier grows with L_max (-0.01 at 2, -0.02 at 4, -0.04 at 8); depth pays
    return {arm(d): {"frontier_vs_control": -0.01 * d / 2 + noise / 100, "base_depth_gain": gain + noise / 10,
                     "frontier_vs_base": -0.4 + noise / 100}
            for d in depths}  # fmt: skip


def test_the_claims_are_decided_over_seeds_and_say_when_a_depth_is_missing() -> None:
    premises = [c for c in EXPERIMENT.claims if c.kind == "premise"]
    frontier, growth = [c for c in EXPERIMENT.claims if c.kind != "premise"][:-1], EXPERIMENT.claims[-1]
    assert [c.measure.split(":")[0] for c in frontier] == [f"L_max = {d}" for d in DEPTHS]
    assert [c.premise for c in frontier] == premises[:-1] and growth.premise is premises[-1]
    by_seed = {s: _seed(n) for s, n in zip((1, 2, 3), (0.0, 0.1, -0.05), strict=True)}
    assert all(evaluate(c, by_seed).verdict == "yes" for c in frontier)
    result = evaluate(growth, by_seed)
    assert result.verdict == "yes" and result.values[0] == pytest.approx(-0.04 + 0.01)  # L_max 8 minus L_max 2
    # without L_max = 8 the growth is read at the deepest arm there is; without a deeper arm it is not measured
    no8 = {s: _seed(n, (2, 4)) for s, n in zip((1, 2, 3), (0.0, 0.1, -0.05), strict=True)}
    assert evaluate(growth, no8).values[0] == pytest.approx(-0.02 + 0.01)
    assert evaluate(frontier[-1], no8).verdict == PREMISE_ABSENT  # its premise is not measured either
    only2 = {1: _seed(0.0, (2,))}
    missing = evaluate(growth, only2)
    assert missing.verdict == PREMISE_ABSENT and "decider-L8" in missing.reason
    # depth that does not pay on the bases: nothing is read, whatever the frontier says
    flat = {s: _seed(n, gain=0.0) for s, n in zip((1, 2, 3), (0.0, 0.1, -0.05), strict=True)}
    assert {evaluate(c, flat).verdict for c in [*frontier, growth]} == {PREMISE_ABSENT}


def test_the_frontier_claims_read_the_control_not_the_base() -> None:
    # the decider's backbone saw its base's tokens again: 0.4 nat below the base's fixed depth is what any
    # post-training gives (the control too). Depth pays and the frontier sits on the control's fixed depth: the
    # claims must not read "yes" (they did while they read frontier_vs_base); without the controls, "not measured".
    frontier = [c for c in EXPERIMENT.claims if c.kind != "premise"][:-1]
    by_seed = {s: _seed(0.0) for s in (1, 2, 3)}
    for s, on_control in zip(by_seed, (0.002, -0.003, 0.001), strict=True):
        for v in by_seed[s].values():
            v["frontier_vs_control"] = on_control
    assert [evaluate(c, by_seed).verdict for c in frontier] == ["not resolved at this scale"] * len(frontier)
    no_control = {s: {a: {k: x for k, x in v.items() if k != "frontier_vs_control"} for a, v in ms.items()}
                  for s, ms in by_seed.items()}  # fmt: skip
    assert [evaluate(c, no_control).verdict for c in frontier] == [NOT_MEASURED] * len(frontier)


@pytest.mark.slow
def test_quick_decider_depths_experiment_measures_every_depth(decider_quick: QuickRun) -> None:
    # one seed, 2 steps per job, run after the decider experiment in one process (tests/experiments/conftest.py):
    # base-L4 is the decider set's late-switch job, whose run it reuses
    numbers = decider_quick.numbers("decider-depths")
    assert "base-L4: reused" in decider_quick.output
    assert {n: d["l_max"] for n, d in numbers["depths"].items()} == {arm(d): d for d in DEPTHS}
    metrics = numbers["metrics_by_seed"]["1234"]
    for d in DEPTHS:
        assert {"acc_per_doubling_gain", "loss_per_doubling_gain", "auc_vs_fixed", "base_depth_gain"} <= set(
            metrics[arm(d)]
        )
        assert {"acc_per_doubling_control", "control_depth_gain"} <= set(metrics[arm(d)])  # its control, measured
        assert "adaptive" in numbers["depths"][arm(d)]  # the sweep is stored: --from-json can rescore it
        assert len(numbers["depths"][arm(d)]["control_fixed"]) == d  # and the control's fixed depth ℓ = 1..L_max
    assert control(2) not in numbers["depths"]  # a control is measured for its decider, not as one
    premises = [c for c in numbers["claims"] if c["kind"] == "premise"]
    assert len(numbers["claims"]) == 8 and len(premises) == 4 and all(c["values"] for c in premises)
