"""The reruns on the depth-pays corpus (issue 32 item 1).

late-switch-depth-pays: ELR's 75% late switch. Its arms are late-switch's 75% arms on the bare core of
depth-premise-long (same schedule, heads and attention per arm), its mixed-scratch is decider-depth-pays's base
run, its claims are late-switch's for that switch, gated by the loops paying, and the quick end-to-end run measures
the answer tokens beside late-switch's table. exit-schedules-depth-pays: exit-schedules' arms but fixed-depth, the
same model and schedule, on the depth-pays corpus and learning rate, still matched in training FLOPs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from elastic_pretrain.experiments.analyses import late_switch as ls
from elastic_pretrain.experiments.analyses import late_switch_depth_pays as dp
from elastic_pretrain.experiments.registry import EXPERIMENTS
from elastic_pretrain.experiments.runner import job_diff, job_fingerprint
from elastic_pretrain.experiments.stats import PREMISE_ABSENT, evaluate
from elastic_pretrain.job_loader import load_job
from tests.conftest import REPO
from tests.experiments.quick import quick_experiments, run_python
from tests.experiments.test_elr_designs import _plans

SET = REPO / "jobs/experiments/late-switch-depth-pays"
STEMS = ("baseline", "mixed-scratch", "switch-0.75", "switch-0.75-noheads")
ARMS = {*STEMS, *(ls.TIED + s for s in STEMS)}


def test_the_arms_are_late_switchs_on_the_bare_core_of_the_depth_pays_corpus() -> None:
    assert EXPERIMENTS["late-switch-depth-pays"] is dp.EXPERIMENT
    assert {p.stem for p in SET.glob("*.yaml")} == ARMS
    premise = load_job(REPO / "jobs/experiments/depth-premise-long/bare-1.yaml")
    for stem in ARMS:
        job, byte = load_job(SET / f"{stem}.yaml"), load_job(REPO / f"jobs/experiments/late-switch/{stem}.yaml")
        assert job.schedule == byte.schedule, stem  # ELR's recipe, arm by arm
        assert (job.model.attention, job.model.loop_conditioning) == (
            byte.model.attention,
            byte.model.loop_conditioning,
        )
        assert (job.model.prelude_layers, job.model.coda_layers) == (0, 0)  # the bare core: ℓ = 1 is one layer
        assert job.data == premise.data and job.train == premise.train, stem  # the premise's corpus and schedule
    for stem in STEMS:
        assert job_diff([load_job(SET / f"tied-{stem}.yaml"), load_job(SET / f"{stem}.yaml")]) == ["model.attention"]
    # the untied baseline is depth-premise-long's bare-1 (so the premise's ℓ = 1 arm is this experiment's baseline)
    assert job_diff([load_job(SET / "baseline.yaml"), premise]) == []
    scratch = load_job(REPO / "jobs/experiments/decider-depth-pays/mixed.yaml")
    assert job_fingerprint(load_job(SET / "mixed-scratch.yaml")) == job_fingerprint(scratch)  # the run is shared


def test_elrs_fixed_phase_is_one_loop_and_the_switch_at_75_percent() -> None:
    assert set(_plans(SET / "baseline.yaml")) == {1}
    for stem in ("switch-0.75", "switch-0.75-noheads", "tied-switch-0.75", "tied-switch-0.75-noheads"):
        plans = _plans(SET / f"{stem}.yaml")
        cut = round(0.75 * len(plans))
        assert set(plans[:cut]) == {1} and set(plans[cut:]) == {1, 2, 3, 4}, stem
    assert max(_plans(SET / "mixed-scratch.yaml")[:8]) > 1


LONG = REPO / "jobs/experiments/late-switch-depth-pays-long"


def test_the_long_set_is_the_same_arms_trained_twice_as_long() -> None:
    """late-switch-depth-pays-long: at 3,000 steps one mixed-depth seed per attention was still on the copying
    plateau; the long set changes the steps only (the schedule's shape, the 75% switch and the seeds follow)."""
    from elastic_pretrain.experiments.analyses import late_switch_depth_pays_long as long

    assert EXPERIMENTS["late-switch-depth-pays-long"] is long.EXPERIMENT
    assert long.EXPERIMENT.claims == dp.EXPERIMENT.claims and long.EXPERIMENT.analyse is dp.EXPERIMENT.analyse
    assert {p.stem for p in LONG.glob("*.yaml")} == ARMS
    for stem in ARMS:
        job, short = load_job(LONG / f"{stem}.yaml"), load_job(SET / f"{stem}.yaml")
        assert job_diff([job, short]) == ["train.steps"], stem
        assert (job.train.steps, short.train.steps) == (6000, 3000)
    for stem in ("switch-0.75", "tied-switch-0.75-noheads"):
        plans = _plans(LONG / f"{stem}.yaml")
        assert len(plans) == 6000 and set(plans[:4500]) == {1} and set(plans[4500:]) == {1, 2, 3, 4}, stem


def _metrics(deep_gain: float, noise: float) -> dict[str, dict[str, float]]:
    """One seed's metrics: the loops lower the loss by ``deep_gain`` at L_max; the 75% switch keeps 85%."""
    out = {}
    for prefix in ("", ls.TIED):
        out |= {
            prefix + "baseline": {"loss@1": 0.35 + noise, "loss@max": 0.35 + noise, "compute": 1.0},
            prefix + "mixed-scratch": {"loss@1": 0.40, "loss@max": 0.35 - deep_gain + noise, "compute": 2.0},
            prefix + "switch-0.75": {"loss@1": 0.352 + noise, "loss@max": 0.35 - 0.9 * deep_gain, "compute": 1.3},
            prefix + "switch-0.75-noheads": {"loss@1": 0.35, "loss@max": 0.35 - 0.85 * deep_gain, "compute": 1.3},
        }
    return out


def test_the_claims_are_late_switchs_for_the_75_percent_switch_and_gated_by_the_loops_paying() -> None:
    claims = dp.EXPERIMENT.claims
    assert len(claims) == 18 and all("switch-0.25" not in c.measure and "switch-0.50" not in c.measure for c in claims)
    assert {c.measure for c in claims} <= {c.measure for c in ls.EXPERIMENT.claims}
    gated = [c for c in claims if c.premise is not None]
    assert len(gated) == 8 and {c.premise for c in gated} == {ls.LOOPS_HELP, ls.LOOPS_HELP_TIED}
    pays = {s: _metrics(0.05, s / 1000) for s in range(3)}
    flat = {s: _metrics(-0.01, s / 1000) for s in range(3)}  # the loops cost: nothing to retain
    retained = next(c for c in claims if c.measure.startswith("switch-0.75-noheads: share"))
    assert retained.value(pays[0]) == pytest.approx(0.85 * 0.05 / (0.05) - 0.84)
    assert evaluate(retained, pays).verdict == "yes"  # 85% against ELR's 84 ± 10
    assert {evaluate(c, flat).verdict for c in gated} == {PREMISE_ABSENT}
    assert evaluate(ls.LOOPS_HELP, pays).verdict == "yes" and evaluate(ls.LOOPS_HELP, flat).verdict != "yes"


@pytest.mark.slow
def test_quick_run_measures_the_answers_of_every_arm(tmp_path: Path) -> None:
    """The end-to-end command on a small depth-pays corpus prepared in the workspace: every arm trained, the
    answer-token table beside late-switch's, every claim with a value."""
    import shutil

    for folder in ("data", "parallel", "jobs/experiments/late-switch-depth-pays"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    preset = tmp_path / "data/depth-pays.yaml"
    preset.write_text(preset.read_text().replace("max_tokens: 4000000", "max_tokens: 60000"))
    prep = run_python(tmp_path, "-m", "elastic_pretrain.cli", "prepare-data", "depth-pays", timeout=300)
    assert prep.returncode == 0, prep.stderr[-4000:]
    run = quick_experiments(tmp_path, "late-switch-depth-pays")
    report = run.numbers("late-switch-depth-pays")
    seed = str(report["seeds"][0])
    metrics = report["metrics_by_seed"][seed]
    assert set(metrics) == ARMS
    for arm, m in metrics.items():
        assert 0.0 <= m["acc[answers]@1"] <= 1.0 and math.isfinite(m["loss[answers]@max"]), arm
    assert set(report["numbers_by_seed"][seed]["answers"]) == ARMS
    assert len(report["claims"]) == 18 and all(c["values"] for c in report["claims"])
    page = (run.results / "late-switch-depth-pays.md").read_text()
    assert "| job | answers loss ℓ=1 |" in page  # the answers table is on the page


EXIT = REPO / "jobs/experiments/exit-schedules-depth-pays"


def test_the_exit_arms_are_exit_schedules_on_the_depth_pays_corpus() -> None:
    from elastic_pretrain.experiments.analyses.exit_schedules import EXPERIMENT as BYTES
    from elastic_pretrain.experiments.analyses.exit_schedules import planned_training_flops

    pays = EXPERIMENTS["exit-schedules-depth-pays"]
    assert pays.claims == BYTES.claims and pays.analyse is BYTES.analyse
    stems = {p.stem for p in EXIT.glob("*.yaml")}
    assert stems == {"sparse-exits", "telescopic", "telescopic-one-draw", "telescopic-dial"}
    premise = load_job(REPO / "jobs/experiments/depth-premise-long/bare-1.yaml")
    for stem in stems:
        job, byte = load_job(EXIT / f"{stem}.yaml"), load_job(REPO / f"jobs/experiments/exit-schedules/{stem}.yaml")
        assert job.model == byte.model and job.schedule == byte.schedule, stem  # TLM's arms, exit by exit
        assert job.data == premise.data and job.train.lr == premise.train.lr, stem
        assert (job.train.micro_batch_size, job.train.global_batch_size) == (8, 16)  # 2 exit draws per step
    flops = {s: planned_training_flops(load_job(EXIT / f"{s}.yaml"), steps=20) for s in stems}
    assert flops["telescopic"] == flops["sparse-exits"] and flops["telescopic-dial"] == flops["telescopic-one-draw"]


def test_the_twin_check_counts_the_fixed_phase_steps_a_heads_arm_and_its_twin_part(tmp_path: Path) -> None:
    """An arm with heads and its no-heads twin, as the late-switch reports read them: the steps before the switch
    (replayed from the schedule) whose logged training loss differs, a step either history lacks counted."""
    import json

    from elastic_pretrain.experiments.measure import steps_apart_before_switch, switch_step
    from elastic_pretrain.experiments.runner import Run

    def run(name: str, losses: dict[int, float]) -> Run:
        job = load_job(LONG / f"{name}.yaml", ["train.steps=8", "train.warmup_steps=2"])
        (tmp_path / name).mkdir()
        lines = [json.dumps({"step": s, "loss": v, "loss_by_loops": {"1": v}}) for s, v in losses.items()]
        (tmp_path / name / "history.jsonl").write_text("\n".join(lines) + "\n")
        return Run(name, job, LONG / f"{name}.yaml", tmp_path / name, {"steps": 8}, "reused")

    path = {s: 5.0 - s / 10 for s in range(1, 9)}
    heads = run("switch-0.75", path)
    assert switch_step(heads) == 6  # 0.75 of 8 steps: steps 1..6 (as logged) are the fixed phase
    after = run("switch-0.75-noheads", {**path, 7: 1.0, 8: 1.0})  # parting after the switch is the heads' doing
    assert steps_apart_before_switch(heads, after) == 0
    rounded = run("tied-switch-0.75-noheads", {**path, 3: path[3] + 1e-7, 5: path[5] + 1e-7})
    assert steps_apart_before_switch(heads, rounded) == 2
    torn = run("tied-switch-0.75", {s: v for s, v in path.items() if s != 4})
    assert steps_apart_before_switch(heads, torn) == 1
    claim = next(c for c in dp.EXPERIMENT.claims if c.measure.startswith("switch-0.75 vs switch-0.75-noheads"))
    assert evaluate(claim, {s: {"switch-0.75": {ls.APART: 0}} for s in range(3)}).verdict == "yes"
    parted = evaluate(claim, {s: {"switch-0.75": {ls.APART: 4400 + s}} for s in range(3)})
    assert parted.verdict == "no" and parted.reason.startswith("the check fails")
