"""The decider experiment's claim plumbing (issue #18): the per-token job is decider.yaml with the joint
per-token backbone only, every decider run is compared with the base's fixed depth over one common compute
range, and the claims (adaptive vs fixed depth, joint vs frozen, vs random stopping) are decided over paired
seeds from those per-arm metrics. Synthetic curves and metrics: the end-to-end run is `elastic-pretrain
experiment decider`, outside CI; one
`--quick --seeds 1` run checks the wiring (both deciders measured, every claim has a value)."""

from __future__ import annotations

import pytest

from elastic_pretrain.config import flatten, load_yaml
from elastic_pretrain.eval.curves import CurvePoint, QualityCurve
from elastic_pretrain.experiments.analyses.decider import BASE, COVERAGE, EXPERIMENT, FROZEN, PER_TOKEN, UNIFORM
from elastic_pretrain.experiments.analyses.decider_measure import matched, run_metrics
from elastic_pretrain.experiments.stats import PREMISE_ABSENT, evaluate
from tests.conftest import REPO
from tests.experiments.quick import QuickRun

SET = REPO / "jobs/experiments/decider"


def _curve(name: str, pts: list[tuple[float, float]]) -> QualityCurve:
    return QualityCurve(name=name, points=tuple(CurvePoint(i + 1, x, y) for i, (x, y) in enumerate(pts)))


def test_the_per_token_job_is_the_frozen_job_with_the_joint_per_token_backbone() -> None:
    frozen, joint = flatten(load_yaml(SET / "decider.yaml")), flatten(load_yaml(SET / "decider-per-token.yaml"))
    assert {k for k in frozen.keys() | joint.keys() if frozen.get(k) != joint.get(k)} == {"decider.backbone"}
    assert (frozen["decider.backbone"], joint["decider.backbone"]) == ("frozen", "per_token")
    assert joint["decider.init_from"] == "late-switch.yaml"  # the same base run of the same seed


def test_the_uniform_control_is_the_per_token_job_trained_at_every_depth() -> None:
    joint, uniform = flatten(load_yaml(SET / "decider-per-token.yaml")), flatten(load_yaml(SET / f"{UNIFORM}.yaml"))
    assert {k for k in joint.keys() | uniform.keys() if joint.get(k) != uniform.get(k)} == {
        "decider.backbone",
        "decider.lm_loss",
    }
    assert (uniform["decider.backbone"], uniform["decider.lm_loss"]) == ("joint", "every_exit")


def test_tah2_labels_by_default_and_the_coverage_cut_as_an_ablation() -> None:
    from elastic_pretrain.model.config import DeciderConfig

    assert (DeciderConfig().backbone, DeciderConfig().coverage) == ("per_token", 1.0)  # TaH2's joint post-training
    for job in SET.glob("decider*.yaml"):
        want = 0.9 if job.stem == COVERAGE else 1.0  # 'continue' iff one more pass lowers the token's loss
        assert flatten(load_yaml(job))["decider.coverage"] == want, job
    joint, cut = flatten(load_yaml(SET / "decider-per-token.yaml")), flatten(load_yaml(SET / f"{COVERAGE}.yaml"))
    assert {k for k in joint.keys() | cut.keys() if joint.get(k) != cut.get(k)} == {"decider.coverage"}


def test_matched_compares_every_decider_over_the_range_they_all_cover() -> None:
    base = _curve("fixed", [(0.25, 3.0), (0.5, 2.5), (1.0, 2.0)])
    frozen = _curve("frozen", [(0.25, 3.0), (0.5, 2.4), (1.0, 2.0)])
    joint = _curve("joint", [(0.4, 2.4), (1.0, 1.8)])  # starts later: the common range is [0.4, 1]
    cmp, out = matched(base, {FROZEN: frozen, PER_TOKEN: joint})
    assert (cmp.lo, cmp.hi) == (0.4, 1.0)
    assert out[PER_TOKEN]["auc_matched"] == pytest.approx((2.4 + 1.8) / 2)
    # base on [0.4, 1]: 2.7 at 0.4, 2.5 at 0.5, 2.0 at 1 (trapezoids, / 0.6)
    base_auc = (0.1 * (2.7 + 2.5) / 2 + 0.5 * (2.5 + 2.0) / 2) / 0.6
    frozen_auc = (0.1 * (2.64 + 2.4) / 2 + 0.5 * (2.4 + 2.0) / 2) / 0.6
    assert out[FROZEN]["auc_matched"] == pytest.approx(frozen_auc)
    assert out[FROZEN]["auc_vs_base"] == pytest.approx(frozen_auc - base_auc)
    assert out[PER_TOKEN]["auc_vs_base"] == pytest.approx(2.1 - base_auc)
    assert "auc_vs_control" not in out[PER_TOKEN]
    # with the uniform control's fixed depth (2.2 flat on [0.4, 1]): each adaptive AUC minus the control's
    control = _curve("control", [(0.25, 2.2), (1.0, 2.2)])
    cmp, out = matched(base, {FROZEN: frozen, PER_TOKEN: joint}, control)
    assert (cmp.lo, cmp.hi) == (0.4, 1.0) and cmp.aucs[1] == pytest.approx(2.2)
    assert out[PER_TOKEN]["auc_vs_control"] == pytest.approx(2.1 - 2.2)
    assert out[FROZEN]["auc_vs_control"] == pytest.approx(frozen_auc - 2.2)
    assert out[PER_TOKEN]["auc_vs_base"] == pytest.approx(2.1 - base_auc)


def test_run_metrics_average_the_inner_thresholds_only() -> None:
    class R:
        def __init__(self, t: float) -> None:
            self.threshold = t

    class Cmp:
        aucs = (2.5, 2.4)

    m = {"cmp": Cmp(), "inner": [R(0.3), R(0.5)], "delta": {0.0: 9.0, 0.3: -0.02, 0.5: -0.04},
         "vs_random": {0.3: -0.01, 0.5: 0.03}}  # fmt: skip
    out = run_metrics(m)
    assert out["auc_vs_fixed"] == pytest.approx(-0.1)
    assert out["minus_fixed"] == pytest.approx(-0.03) and out["minus_random"] == pytest.approx(0.01)
    assert set(run_metrics({**m, "inner": []})) == {"auc_vs_fixed"}  # no threshold inside the ends


def _seed(joint_gain: float, noise: float, depth_gain: float = -0.1) -> dict[str, dict[str, float]]:
    frozen = {"frontier_vs_base": 0.03 + noise, "frontier_vs_random": 0.001 + noise, "frontier_vs_control": 0.1}
    joint = {"frontier_vs_base": -0.05 + noise, "frontier_vs_random": -0.02, "frontier_vs_control": -0.03 + noise}
    uniform = {**frozen, "frontier_vs_control": -0.03 + joint_gain / 2 + noise}  # the extra tokens give half the gain
    return {BASE: {"depth_gain": depth_gain}, FROZEN: frozen, PER_TOKEN: joint, UNIFORM: uniform}


def test_the_claims_are_decided_over_paired_seeds() -> None:
    vs_uniform = f"joint per-token minus {UNIFORM}"
    names = ("frozen decider", "joint per-token decider", vs_uniform, "joint per-token minus frozen decider",
             "frozen vs random", "joint per-token decider under the last-loop cache", "joint vs random")  # fmt: skip
    claims = dict(zip(names, (c for c in EXPERIMENT.claims if c.kind != "premise"), strict=True))
    assert all(claims[n].measure.startswith(n) for n in (*names[:4], names[5]))
    assert all("random stopping" in claims[n].measure for n in (names[4], names[6]))
    by_seed = {s: _seed(0.04, n) for s, n in zip((1, 2, 3), (0.0, 0.002, -0.001), strict=True)}
    verdicts = {k: evaluate(c, by_seed).verdict for k, c in claims.items()}
    assert verdicts["frozen decider"] == "contradicted"  # adaptive worse than fixed depth at every seed
    assert verdicts["joint per-token decider"] == "yes"  # against the control's fixed depth
    assert verdicts["joint per-token minus frozen decider"] == "yes"
    assert verdicts[vs_uniform] == "yes"
    # the per-token claim reads the control's fixed depth, not the base's: with no gain over the control it is
    # not decided in per-token depth's favour even though the base is beaten
    flat = {s: {**d, PER_TOKEN: {**d[PER_TOKEN], "frontier_vs_control": 0.01 + 0.01 * s}} for s, d in by_seed.items()}
    assert evaluate(claims["joint per-token decider"], flat).verdict == "contradicted"
    # the joint-vs-frozen difference is paired within a seed: seed noise shared by both arms cancels
    noisy = {s: _seed(0.04, n) for s, n in zip((1, 2, 3), (0.0, 0.5, -0.5), strict=True)}
    assert evaluate(claims["joint per-token minus frozen decider"], noisy).verdict == "yes"
    assert evaluate(claims["joint per-token decider"], noisy).verdict == "not resolved at this scale"
    # where depth does not pay on the base, none of it is read (issue 32: never "contradicted" on no premise)
    gains = (0.001, -0.002, 0.0005)  # the base's ℓ = L_max minus ℓ = 1: the interval includes 0
    flat_depth = {s: _seed(0.04, n, g) for s, n, g in zip((1, 2, 3), (0.0, 0.002, -0.001), gains, strict=True)}
    assert {evaluate(c, flat_depth).verdict for c in claims.values()} == {PREMISE_ABSENT}
    # a job set without the per-token arm: its claims say so instead of failing
    without = {s: {BASE: {"depth_gain": -0.1 - s / 100}, FROZEN: by_seed[s][FROZEN]} for s in by_seed}
    missing = evaluate(claims["joint per-token minus frozen decider"], without)
    assert missing.verdict == "not measured" and "decider-per-token" in missing.reason


@pytest.mark.slow
def test_quick_decider_experiment_measures_both_deciders(decider_quick: QuickRun) -> None:
    # one seed, 2 steps per job, run with decider-depths in one process (tests/experiments/conftest.py)
    numbers = decider_quick.numbers("decider")
    assert [r["job"] for r in numbers["runs"]] == ["late-switch", COVERAGE, "decider-per-token", UNIFORM, "decider"]
    assert {n: d["backbone"] for n, d in numbers["deciders"].items()} == {
        FROZEN: "frozen",
        COVERAGE: "per_token",
        PER_TOKEN: "per_token",
        UNIFORM: "joint",
    }
    metrics = numbers["metrics_by_seed"]["1234"]
    assert {"auc_matched", "auc_vs_base", "auc_vs_fixed", "auc_vs_control"} <= set(metrics[FROZEN]) & set(
        metrics[PER_TOKEN]
    )
    assert set(numbers["matched"]["auc"]) == {
        "fixed depth (late-switch)",
        f"fixed depth ({UNIFORM})",
        f"adaptive ({FROZEN})",
        f"adaptive ({COVERAGE})",
        f"adaptive ({PER_TOKEN})",
        f"adaptive ({UNIFORM})",
    }
    assert numbers["deciders"][UNIFORM]["backbone_drift"] > 1e-3  # the control's backbone trained too
    # the frozen decider's backbone is the base model: its own fixed depth is the base's, so both AUCs agree
    assert metrics[FROZEN]["auc_vs_base"] == pytest.approx(metrics[FROZEN]["auc_vs_fixed"], abs=1e-5)
    assert numbers["deciders"][PER_TOKEN]["backbone_drift"] > 1e-3  # the joint backbone trained
    assert len(numbers["claims"]) == 8 and numbers["claims"][0]["kind"] == "premise"
    # every claim is measured where the deciders it reads decide something: after 2 training steps a decider can
    # stop every token at the same pass, and then its sweep has no point off the forced ends, no frontier
    inner = {n: any(1 + 1e-6 < r["mean_passes"] < 4 - 1e-6 for r in d["adaptive"])
             for n, d in numbers["deciders"].items()}  # fmt: skip
    # the last-loop sweep (the cache generate serves with) is stored per decider run, fixed depth at every ℓ
    assert all(len(d["last_loop"]["fixed"]) == 4 and d["last_loop"]["adaptive"] for d in numbers["deciders"].values())
    last = numbers["deciders"][PER_TOKEN]["last_loop"]["adaptive"]
    served = any(1 + 1e-6 < r["mean_passes"] < 4 - 1e-6 for r in last)
    reads = [[FROZEN], [PER_TOKEN], [PER_TOKEN, UNIFORM], [PER_TOKEN, FROZEN], [FROZEN], None, [PER_TOKEN]]
    for claim, names in zip(numbers["claims"][1:], reads, strict=True):
        assert bool(claim["values"]) == (served if names is None else all(inner[n] for n in names)), claim
        assert claim["verdict"] == "not resolved — premise absent"  # one seed: the premise has no interval
    assert numbers["claims"][0]["values"] and "depth_gain" in metrics["late-switch"]
