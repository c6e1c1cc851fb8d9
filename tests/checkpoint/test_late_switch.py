"""ELR's late switch from one loop (``schedule.fixed_loops: 1``), end to end on one process: a run
stopped before the switch and resumed equals the uninterrupted run bitwise (per-step losses, every
model and Adam tensor) although the switch copies pass 0's attention into the never-run passes, and
the summary reports the training FLOPs relative to the matched non-looped baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_pretrain.job_loader import load_job
from elastic_pretrain.provenance import code_identity
from elastic_pretrain.schedule import ScheduleController
from elastic_pretrain.train.mfu import DepthCounts, baseline_flops_per_token, step_flops
from tests.checkpoint.runs import COMMON, differing, history, tensors, train
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prepared"), pytest.mark.timeout(1200)]
STEPS = 4
LATE = [f"train.steps={STEPS}", "schedule.fixed_loops=1", "schedule.switch_at=0.5"]  # switch before step 2


def expected_flops_ratio() -> float:
    """The same draws as the run (plans are pure functions of seed, step, micro-batch), counted by hand."""
    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", *COMMON, *LATE])
    ctl = ScheduleController(
        job.schedule, max_loops=job.model.max_loops, total_tokens=STEPS * job.tokens_per_step, seed=job.train.seed
    )
    micro = job.train.micro_batches(1)
    total = 0.0
    for step in range(STEPS):
        ctl.update(step=step, tokens_seen=step * job.tokens_per_step)
        plans = [ctl.plan(step=step, micro=m, replica=0) for m in range(micro)]
        depth = DepthCounts(loops=sum(p.loops for p in plans) / micro, exits=1.0, ghost_passes=0.0)
        total += step_flops(
            job.model, depth, seq_len=job.data.seq_len, micro_batch_tokens=job.train.micro_batch_size * job.data.seq_len
        ).model
    return total / (STEPS * baseline_flops_per_token(job.model, seq_len=job.data.seq_len))


def test_late_switch_from_one_loop_resumes_bitwise_and_reports_flops_vs_baseline(tmp_path: Path) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    train(full, 1, *LATE)
    stopped = train(split, 1, *LATE, "checkpoint.stop_at=1")  # saved after step 1, before the switch
    assert "stopped" in stopped.stdout and not (split / "FINISHED").exists()
    train(split, 1, *LATE)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (full, split))
    assert history(full) == history(split) and [h["step"] for h in b["history"]] == list(range(1, STEPS + 1))
    # steps 1-2 ran ℓ = 1 only; steps 3-4 mixed (the switch)
    # the code that trained each start (provenance.py): the resumed run's second start took over at step 1
    assert (a["code"]["started_at_step"], b["code"]["started_at_step"]) == (0, 1)
    assert a["code"]["commit"] == b["code"]["commit"] == code_identity()["commit"]
    assert all(set(h["loss_by_loops"]) == {"1"} for h in a["history"][:2])
    assert set().union(*(h["loss_by_loops"] for h in a["history"][2:])) > {"1"}
    assert a["train_flops"] == b["train_flops"] > 0
    ratio = a["train_flops_vs_baseline"]
    assert ratio == pytest.approx(expected_flops_ratio(), rel=1e-12) and 1.0 < ratio < 2.5
    x = tensors(full / "checkpoints" / f"step_{STEPS}", tmp_path / "x.pt")
    y = tensors(split / "checkpoints" / f"step_{STEPS}", tmp_path / "y.pt")
    assert differing(x, y) == []
