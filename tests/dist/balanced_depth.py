"""Compute-balanced mixed depth, gradient weighting: run by tests/train/test_balanced_depth_grads.py.

usage: balanced_depth.py ref|dist OUT_DIR
  ref   — 1 process: writes weights and 4 micro-batches; runs them at ℓ = LOOPS (gradient accumulation,
          megatron's default weighting: each micro-batch 1/4, so every token 1 / global tokens).
  dist  — 2 processes under torchrun, every case in one launch (a process group per case):
    dp2          — data parallel 2, ``balance: compute`` weighting: replica 0 runs micro-batches 0, 1, 2,
                   replica 1 micro-batch 3 (the unequal counts a balanced deal gives).
    dp2-default  — the same deal with megatron's default weighting (per-rank micro-batch mean, then the
                   DP mean): must *not* match the reference (why balance changes the weighting).
    ep2          — expert parallel 2, ``balance: compute``: replica 0 runs micro-batches 0, 2, replica 1
                   micro-batches 1, 3 (same ℓ at each position, as a depth group's deal): expert
                   gradients summed over the expert group and divided by the global token count.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
from elastic_pretrain.parallel.pipeline import MicroBatch
from elastic_pretrain.schedule import DepthPlan
from elastic_pretrain.train.step import _forward_step, _reduce_by_loops, depth_counts
from tests.dist.equivalence import global_name, local_view, wrap_ddp_for_test

LOOPS = [1, 1, 2, 2]  # ℓ of micro-batch 0..3
DEALS = {"dp2": [[0, 1, 2], [3]], "dp2-default": [[0, 1, 2], [3]], "ep2": [[0, 2], [1, 3]]}
CASES = ["dp2", "dp2-default", "ep2"]


def model_cfg() -> ModelConfig:
    # aux (load-balancing) loss off: its batch statistics differ under a DP split by design; z-loss on
    return ModelConfig(hidden_size=32, num_heads=4, ffn_hidden_size=64, prelude_layers=1, coda_layers=1,
                       core_layers=2, num_experts=4, loops=2, flatten=2, moe_top_k=2, moe_ffn_hidden_size=32,
                       moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1e-3)


def run(mode: str, out: Path) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("gloo", init_method=f"file://{out}/store_{mode}", rank=rank, world_size=world)
    par = ParallelConfig(expert=2) if mode == "ep2" else ParallelConfig()
    mesh = init_mesh(par, seed=13)
    torch.set_num_threads(1)
    cfg = model_cfg()
    net = build_model(cfg, par)
    if mode == "ref":
        batches = torch.randint(0, cfg.vocab_size, (4, 2, 17), generator=torch.Generator().manual_seed(5))
        torch.save({"state": net.state_dict(), "batches": batches}, out / "inputs.pt")
        mine = [0, 1, 2, 3]
    else:
        saved = torch.load(out / "inputs.pt", weights_only=True)
        batches = saved["batches"]
        n_local = cfg.experts_built // mesh.ep_size
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(local_view(name, saved["state"][global_name(name, mesh.ep_rank, n_local)], p.shape, 1, 0))
        mine = DEALS[mode][mesh.dp_rank]
    micro = [MicroBatch(batches[i], DepthPlan(LOOPS[i], (LOOPS[i],), group_loops=LOOPS[i])) for i in mine]
    model = wrap_ddp_for_test(net, balance="compute" if mode in ("dp2", "ep2") else "off")
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(micro), model=[model], num_microbatches=len(micro),
        seq_length=16, micro_batch_size=2, forward_only=False)
    loss, by_loops = _reduce_by_loops(reports, cfg.max_loops)
    grads = {n: p.main_grad.detach().clone() for n, p in net.named_parameters()}
    torch.save({"loss": loss, "by_loops": by_loops, "grads": grads, "ep": mesh.ep_rank,
                "balance": depth_counts(micro).balance},
               out / f"{mode}_rank{mesh.rank}.pt")
    teardown()


if __name__ == "__main__":
    which, out_dir = sys.argv[1], Path(sys.argv[2])
    for case in ["ref"] if which == "ref" else CASES:
        run(case, out_dir)
