"""The same job on both engines (torchrun, 2 gloo ranks, data parallel 2): the same per-step losses for 20 steps
at fixed depth and at mixed depth (ranks draw their own ℓ per micro-batch from the first step).

Tolerance: |Δloss| <= 1e-5 per step (fp32; losses ~5). What differs between the engines is only summation
order — megatron DDP scales gradients by 1/DP before its all-reduce and clips with its own norm kernel,
DeepSpeed averages after a reduce-scatter and clips inside ZeRO; optimizer (torch AdamW), parameter groups and
LR schedule are the same. Measured worst over the 20 steps: 3.6e-7 (fixed), 2.4e-7 (mixed); 1e-5 leaves room
for reassociation on other machines while a wrong LR, weight decay group, 1/micro-batch scale or a gradient
reduced over the wrong parameters moves a step's loss by far more.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.runs import COMMON, history, train

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS = [
    "train.steps=20",
    "train.global_batch_size=8",
    "train.eval_sequences=4",
    "checkpoint.interval=0",
    "parallel=single",
]
DEPTH = {
    "fixed": ["schedule.sampler=fixed", "schedule.switch_at=1.0"],
    # mixed from the first step, no one-loop override bias: ranks run different passes in one update
    "mixed": ["schedule.sampler=independent_rank", "schedule.switch_at=0.0", "schedule.one_loop_fraction=0.3"],
    # ELR's route replay: passes >= 1 reuse pass 0's expert choices (the router still learns from live gates)
    "mixed-replay": [
        "schedule.sampler=independent_rank",
        "schedule.switch_at=0.0",
        "schedule.one_loop_fraction=0.3",
        "model.route_replay=true",
    ],
}
TOLERANCE = 1e-5
# ZeRO-3 at mixed depth: every parameter partitioned (none kept whole below DeepSpeed's 1e5-element default, which
# on this model would be all of them), so each module call gathers over the ranks and ghost passes must pair up
ZERO3 = ["engine=deepspeed", "deepspeed.zero_stage=3", "deepspeed.param_persistence_threshold=0"]
ENGINES = {"megatron": ["engine=megatron"], "deepspeed": ["engine=deepspeed"]}


# compute-balanced mixed depth (schedule.balance=compute): 2 micro-batches per replica, M = 4 dealt so that ranks run
# 1 + 3 or 2 + 2 of them (the DeepSpeed step accumulates a rank's own locally; ZeRO-2); 10 steps keep it cheap
BALANCED = [
    "schedule.sampler=independent_rank",
    "schedule.switch_at=0.0",
    "schedule.one_loop_fraction=0.3",
    "schedule.balance=compute",
    "train.global_batch_size=16",
    "train.steps=10",
]


def test_compute_balanced_depth_gives_the_same_losses_on_both_engines(tmp_path: Path) -> None:
    """Per-token weighting across replicas with unequal micro-batch counts, as megatron's calculate_per_token_loss:
    the same per-step losses within the parity tolerance, and the deal really was unequal on some step."""
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.schedule import ScheduleController
    from tests.conftest import REPO

    runs = {}
    for name, engine in ENGINES.items():
        train(tmp_path / name, 2, *engine, *STEPS, *BALANCED)
        runs[name] = history(tmp_path / name)
    assert len(runs["megatron"]) == len(runs["deepspeed"]) == 10
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(runs["megatron"], runs["deepspeed"]))
    print(f"balanced: worst per-step |Δloss| over 10 steps = {worst:.2e}")
    for a, b in zip(runs["megatron"], runs["deepspeed"]):
        assert b["loss"] == pytest.approx(a["loss"], abs=TOLERANCE), (a["step"], a["loss"], b["loss"])
        assert a["loss_by_loops"].keys() == b["loss_by_loops"].keys()
    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", [*COMMON, "engine=deepspeed", *STEPS, *BALANCED])
    ctl = ScheduleController(
        job.schedule,
        max_loops=job.model.max_loops,
        total_tokens=job.train.steps * job.tokens_per_step,
        seed=job.train.seed,
    )
    counts = [
        tuple(len(ctl.balanced_plans(step=s, micro_batches=2, replica=r, replicas=2)) for r in range(2))
        for s in range(10)
    ]
    assert any(c[0] != c[1] for c in counts), counts  # some step dealt 1 + 3


# CI runs mixed depth (megatron, ZeRO-2, ZeRO-3); fixed depth and route replay are --long
@pytest.mark.parametrize(
    "depth",
    [pytest.param("fixed", marks=pytest.mark.long), "mixed", pytest.param("mixed-replay", marks=pytest.mark.long)],
)
def test_both_engines_give_the_same_losses(tmp_path: Path, depth: str) -> None:
    runs = {}
    engines = {**ENGINES, "zero3": ZERO3} if depth == "mixed" else ENGINES
    for name, engine in engines.items():
        train(tmp_path / name, 2, *engine, *STEPS, *DEPTH[depth])
        runs[name] = history(tmp_path / name)
    mega = runs["megatron"]
    for name in engines.keys() - {"megatron"}:
        ds = runs[name]
        assert len(mega) == len(ds) == 20
        worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(mega, ds))
        print(f"{depth} {name}: worst per-step |Δloss| over 20 steps = {worst:.2e}")
        for a, b in zip(mega, ds):
            assert b["loss"] == pytest.approx(a["loss"], abs=TOLERANCE), (name, a["step"], a["loss"], b["loss"])
            assert a["loss_by_loops"].keys() == b["loss_by_loops"].keys()  # the same ℓ drawn on both engines
        if depth.startswith("mixed"):  # the ranks really ran different depths inside updates
            assert any(h.get("depth_efficiency", 1.0) < 1.0 or len(h["loss_by_loops"]) > 1 for h in ds)
    assert (tmp_path / "deepspeed" / "deepspeed_config.json").is_file()
    if "zero3" in runs:  # every replica ran each micro-batch to the deepest ℓ: ghost passes executed, not useful
        for h in runs["zero3"]:  # one micro-batch per replica: useful (ℓ0 + ℓ1) / executed 2 max ℓ
            drawn = sorted(int(k) for k in h["loss_by_loops"])  # the two replicas' ℓ (one key when they drew the same)
            assert h["depth_efficiency"] == pytest.approx((drawn[0] + drawn[-1]) / (2 * drawn[-1])), h
            assert h["depth_balance"] == 1.0, h
        assert any(h["depth_efficiency"] < 1.0 for h in runs["zero3"])
