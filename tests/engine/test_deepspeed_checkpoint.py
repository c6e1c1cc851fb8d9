"""DeepSpeed-engine checkpoints keep the project's guarantees: commit marker, ``latest``, retention, auto-resume,
and a bitwise resume under ZeRO-3 at mixed depth at world size 1 and 2 (CLI runs of the tiny job on gloo); at
world size 2 the first run is stopped by SIGTERM to one rank (the preemption path: save, exit 0, ``STOPPED``).
A run also resumes at another world size (2 -> 1 -> 2), continuing the uninterrupted run's losses within 1e-5."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from elastic_pretrain.rundir import RunFiles
from tests.checkpoint.launch import Launch
from tests.checkpoint.runs import history, train

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# mixed depth from the first step, every parameter partitioned (each module call gathers): at 2 ranks steps 2-4
# run full ghost passes (the resumed run's steps 3-4 among them)
ZERO3 = [
    "engine=deepspeed",
    "parallel=single",
    "deepspeed.zero_stage=3",
    "deepspeed.param_persistence_threshold=0",
    "schedule.sampler=independent_rank",
    "schedule.switch_at=0.0",
    "schedule.one_loop_fraction=0.3",
    "train.steps=4",
    "train.global_batch_size=8",
    "checkpoint.interval=1",
    "checkpoint.keep_last=2",
]


def ds_tensors(step: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DeepSpeed checkpoint's files (weights-only: engine/safe_load.py), keyed by file/path."""
    from elastic_pretrain.engine.safe_load import weights_only_loads

    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)

    with weights_only_loads():
        for f in sorted((step / "model_optim").glob("*.pt")):
            walk(f.name, torch.load(f, map_location="cpu"))
    return out


@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.long), 2])  # 2 ranks in CI, 1 with --long
def test_zero3_resume_is_bitwise(tmp_path: Path, nproc: int) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(straight, nproc, *ZERO3)
    if nproc == 1:
        stopped = train(split, nproc, *ZERO3, "checkpoint.stop_at=2")
        assert "stopped (stop_at) at step 2/4" in stopped.stdout
        step = 2
    else:  # a real stop signal to one rank, as a preemption reaches the job: save, exit 0, STOPPED, resume
        first = Launch(split, *ZERO3)
        first.wait_for(r"step +1/4")
        first.signal(first.rank_pid(1))
        assert first.finish() == 0, first.text()
        found = re.search(r"stopped \(SIGTERM on rank 1\) at step (\d)/4: checkpoint saved", "".join(first.out))
        assert found, first.text()
        step = int(found.group(1))
        assert json.loads(RunFiles(split).stopped.read_text())["step"] == step
    resumed = train(split, nproc, *ZERO3)
    assert "resumed from" in resumed.stdout and f"step {step}" in resumed.stdout
    assert not RunFiles(split).stopped.exists() and RunFiles(split).finished.is_file()
    assert history(split) == history(straight)
    ckpts = split / "checkpoints"
    # retention keeps the last two committed steps; latest names the newest; each has its commit marker
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_3", "step_4"]
    assert (ckpts / "latest").read_text().strip().endswith("step_4")
    assert all((ckpts / s / "COMMITTED").is_file() for s in ("step_3", "step_4"))
    a, b = ds_tensors(straight / "checkpoints" / "step_4"), ds_tensors(ckpts / "step_4")
    assert a.keys() == b.keys() and len(a) > 0
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


# fixed depth: the same micro-batches at the same ℓ whatever the world size (the data loader deals the global batch
# by position), so a run resumed at another world size continues the uninterrupted one up to summation order
RESHARD = [
    "engine=deepspeed",
    "parallel=single",
    "schedule.sampler=fixed",
    "schedule.switch_at=1.0",
    "train.steps=4",
    "train.global_batch_size=8",
    "checkpoint.interval=1",
    "checkpoint.keep_last=4",
]
RESHARD_TOLERANCE = 1e-5  # the engines' parity tolerance (tests/engine/test_engine_parity.py): reduction order only


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.long)])  # ZeRO-2 in CI, ZeRO-3 --long
def test_resume_at_another_world_size(tmp_path: Path, stage: int) -> None:
    """Saved at 2 ranks, resumed at 1, saved, resumed at 2: every rank reads the whole state (weights, Adam moments,
    step: engine/full_state.py, bitwise) and keeps its new partition; the losses continue the run that was never
    interrupted (at world size 1: the same global batches) within the tolerance."""
    zero = f"deepspeed.zero_stage={stage}"
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(straight, 1, *RESHARD, zero)
    train(split, 2, *RESHARD, zero, "checkpoint.stop_at=2")
    down = train(split, 1, *RESHARD, zero, "checkpoint.stop_at=3")
    assert f"world size 2 ZeRO-{stage} -> world size 1" in down.stdout + down.stderr
    up = train(split, 2, *RESHARD, zero)
    assert f"world size 1 ZeRO-{stage} -> world size 2" in up.stdout + up.stderr
    assert RunFiles(split).finished.is_file()
    got, want = history(split), history(straight)
    assert [h["step"] for h in got] == [h["step"] for h in want] == [1, 2, 3, 4]
    deltas = [f"{abs(a['loss'] - b['loss']):.1e}" for a, b in zip(got, want)]
    print(f"ZeRO-{stage} 2 -> 1 -> 2: per-step |Δloss|", deltas)
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], abs=RESHARD_TOLERANCE), (a["step"], a["loss"], b["loss"])
