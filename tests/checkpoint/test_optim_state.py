"""Optimizer state in model space, boxes of each rank's flat slice (checkpoint/optim_state.py): the boxes
tile a flat range exactly, and one process saves and loads the state bitwise through them (SwiGLU's
two-part factory included); the multi-rank cases are test_parallel_io.py and test_reshard.py."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from elastic_pretrain.checkpoint.optim_state import boxes


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 3, 2, 4), (1, 1, 6), ()])
def test_boxes_tile_a_flat_range_in_order(shape: tuple[int, ...]) -> None:
    index = torch.arange(math.prod(shape)).view(shape)
    rng = random.Random(0)
    n = index.numel()
    ranges = [(0, n), (0, 0), *[sorted(rng.sample(range(n + 1), 2)) for _ in range(40) if n > 1]]
    for start, end in ranges:
        got = [index[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1) for off, size in
               boxes(shape, start, end)]  # fmt: skip
        assert len(got) <= max(1, 2 * len(shape) - 1)
        flat = torch.cat(got) if got else torch.empty(0, dtype=torch.long)
        assert torch.equal(flat, torch.arange(start, end)), (shape, start, end)


def test_one_process_saves_megatrons_global_tensors_and_loads_them_bitwise(mesh1, tmp_path: Path) -> None:
    """The saved global tensors equal those of megatron's own model-space optimizer tensors
    (``make_sharded_optimizer_tensor``: one whole tensor per parameter, what this module saved before
    it saved boxes), so checkpoints of either chunking load; the load restores every slice bitwise."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from elastic_pretrain.checkpoint.manager import load_tensors, save_tensors
    from elastic_pretrain.checkpoint.optim_state import _param_index
    from tests.checkpoint.runs import differing
    from tests.dist.ckpt_reshard import build, owned_slices

    def dcp(path: Path) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, path / "all.pt")
        return {k: v for k, v in torch.load(path / "all.pt", weights_only=False).items() if k.startswith("optimizer.")}

    net, _, optimizer = build("single")
    g = torch.Generator().manual_seed(1)
    want = {}
    with torch.no_grad():
        for name, _, _, _, t in owned_slices(optimizer, net):
            for state in STATES:
                t[state].copy_(torch.randn(t[state].shape, generator=g))
                want[(name, state)] = t[state].clone()
            t["step"].fill_(4.0)
    boxes_dir, whole_dir = tmp_path / "boxes", tmp_path / "whole"
    boxes_dir.mkdir()
    whole_dir.mkdir()
    save_tensors(net, optimizer, boxes_dir, TorchDistSaveShardedStrategy("torch_dist", 1))
    by_param = _param_index(net.sharded_state_dict())
    whole = {
        f"{state}.{name}": make_sharded_optimizer_tensor(
            by_param[id(p)][1], t[state].detach().view(p.shape), f"optimizer.{state}"
        )
        for name, p, _, _, t in owned_slices(optimizer, net)
        for state in STATES
    }
    whole_sd = {"model": net.sharded_state_dict(), "optimizer": whole}
    dist_checkpointing.save(whole_sd, str(whole_dir), sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1))
    saved, reference = dcp(boxes_dir), dcp(whole_dir)
    assert len(saved) == len(reference) > 0 and differing(saved, reference) == []

    with torch.no_grad():
        for _, _, _, _, t in owned_slices(optimizer, net):
            for state in STATES:
                t[state].zero_()
    for source in (boxes_dir, whole_dir):
        load_tensors(net, optimizer, source, adam_step=4.0)
        for name, _, _, _, t in owned_slices(optimizer, net):
            for state in STATES:
                assert torch.equal(t[state], want[(name, state)]), (source.name, name, state)
            assert float(t["step"]) == 4.0


STATES = ("exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("distributed", [True, False])
def test_each_parameters_own_state_in_a_group_mixing_bf16_and_fp32(mesh1, distributed: bool) -> None:
    """A bf16 model keeps its loop-conditioning embeddings in fp32, so a param group holds both. megatron
    0.16.1's ``_get_main_param_and_optimizer_states`` then handed back *another* parameter's state (its group
    is rebuilt fp32-first): the first save of such a run crashed, or saved swapped moments where the shapes
    agreed. Every entry's main copy must be its own parameter (equal values) with moments of its size."""
    from elastic_pretrain.checkpoint.optim_state import _entries, _param_index, ensure_state, optimizers
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.parallel.mesh import ParallelConfig
    from elastic_pretrain.train.session import build_optimizer, wrap_ddp
    from tests.conftest import REPO

    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", [
        "model.dtype=bf16", "model.loop_conditioning=true", f"train.distributed_optimizer={str(distributed).lower()}",
        "parallel=single", "train.steps=10", "train.warmup_steps=0"])  # fmt: skip
    net = build_model(job.model, ParallelConfig())
    optimizer, _ = build_optimizer(job, wrap_ddp(job, net))
    ensure_state(optimizer)
    dtypes = {p.dtype for p in net.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}, dtypes  # the premise: a group mixing both
    by_param = _param_index(net.sharded_state_dict())
    seen = 0
    for opt in optimizers(optimizer):
        for e in _entries(opt, by_param):
            if e.end == e.start:
                continue
            size = e.end - e.start
            assert e.tensors["param"].numel() == size, e.key
            assert all(e.tensors[s].numel() == size for s in STATES), e.key
            mine = e.param.detach().reshape(-1)[e.start : e.end].float()
            assert torch.equal(e.tensors["param"].reshape(-1).float(), mine), e.key
            seen += 1
    assert seen == sum(1 for _ in net.parameters())
