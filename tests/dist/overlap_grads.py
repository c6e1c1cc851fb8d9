"""megatron DDP ``overlap_grad_reduce`` under mixed depth: run by tests/train/test_overlap_grad_reduce.py.

usage: overlap_grads.py OUT_DIR (2 processes under torchrun, expert parallel 2, gloo). Two DDP wraps
of the same weights, ``overlap_grad_reduce`` off then on, each 3 steps of 2 micro-batches whose ℓ
differs across the two replicas and from step to step (the last micro-batch included: megatron
counts each parameter's gradient-ready hooks on the last micro-batch and fires a bucket's reduction
when the counts equal those of the first step). Writes per step the reduced gradients, or the error.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
from elastic_pretrain.train.schedule import DepthPlan
from elastic_pretrain.train.step import MicroBatch, _forward_step
from tests.dist.balanced_depth import model_cfg

# ℓ of (replica 0, replica 1) per step and micro-batch; the EP group's MoE calls run for the max
STEPS = [[(4, 1), (2, 3)], [(1, 2), (1, 4)], [(3, 1), (4, 1)]]


def run(overlap: bool, out: Path) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{out}/store_{overlap}", rank=rank, world_size=world)
    par = ParallelConfig(expert=2)
    mesh = init_mesh(par, seed=21)
    torch.set_num_threads(1)
    net = build_model(model_cfg(), par)
    ddp = DistributedDataParallel(config=net.config, module=net, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap))
    net.config.finalize_model_grads_func = finalize_model_grads
    net.config.no_sync_func = ddp.no_sync
    batches = torch.randint(0, 257, (len(STEPS), 2, 2, 17), generator=torch.Generator().manual_seed(rank))
    result: dict = {"grads": [], "error": None}
    try:
        for s, step in enumerate(STEPS):
            ddp.zero_grad_buffer()
            micro = [MicroBatch(batches[s, m], DepthPlan(ells[mesh.dp_rank], (ells[mesh.dp_rank],),
                                                          group_loops=max(ells)))
                     for m, ells in enumerate(step)]
            get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(micro), model=[ddp],
                                        num_microbatches=len(micro), seq_length=16, micro_batch_size=2,
                                        forward_only=False)
            result["grads"].append({n: p.main_grad.detach().clone() for n, p in net.named_parameters()})
    except Exception:  # the evidence: what megatron's bucket bookkeeping says about a changed ℓ
        result["error"] = traceback.format_exc(limit=3)
    torch.save(result, out / f"overlap{int(overlap)}_rank{mesh.rank}.pt")
    teardown()


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    for flag in (False, True):
        run(flag, out_dir)
