"""Checkpoint conversion between the engines: a DeepSpeed-engine checkpoint (ZeRO-2) -> megatron -> DeepSpeed
(ZeRO-1) evaluates to the same validation loss at every ℓ (bitwise: the same fp32 weights through the same
model code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.runs import train

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def losses_per_loop(step: Path) -> dict[int, float]:
    from elastic_pretrain.checkpoint.tensors import load_model
    from elastic_pretrain.data.loader import load_validation
    from elastic_pretrain.eval.loss import loss_by_loops

    job, net = load_model(step)
    tokens = load_validation(job.data, num_sequences=4)
    return loss_by_loops(net, tokens, batch_size=2)


def test_a_converted_checkpoint_evaluates_to_the_same_loss_per_loop(tmp_path: Path, mesh1) -> None:
    from elastic_pretrain.checkpoint.store import CheckpointStore
    from elastic_pretrain.engine.convert import convert
    from elastic_pretrain.engine.weights import is_deepspeed

    # 4 steps, switching to mixed depth at step 3: the loop-conditioning heads are on in the checkpoint
    train(tmp_path / "ds", 1, "engine=deepspeed", "train.steps=4", "train.global_batch_size=8")
    step = CheckpointStore(tmp_path / "ds" / "checkpoints").newest().path
    assert is_deepspeed(step)
    want = losses_per_loop(step)
    assert len(want) == 4 and len(set(want.values())) > 1

    mega = convert(step, tmp_path / "as-megatron")
    assert not is_deepspeed(mega) and (mega / "COMMITTED").is_file()
    assert losses_per_loop(mega) == want

    # a checkpoint resumes only on the engine that wrote it: one line naming both fixes
    from elastic_pretrain.checkpoint.manager import check_resumable
    from elastic_pretrain.errors import UserError
    from elastic_pretrain.job import load_job
    from tests.conftest import REPO

    ds_job = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", "engine=deepspeed"])
    with pytest.raises(UserError, match=r"written by engine=megatron.*set engine=megatron, or convert it"):
        check_resumable(mega, ds_job)

    back = convert(mega, tmp_path / "back", zero_stage=1)
    assert is_deepspeed(back) and (back.parent / "latest").is_file()
    assert losses_per_loop(back) == want
