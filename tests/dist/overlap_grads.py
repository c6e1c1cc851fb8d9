"""``parallel.grad_reduce: overlap`` under mixed depth: run by tests/train/test_overlap_grad_reduce.py.

usage: overlap_grads.py ep2|pp2|dp4 OUT_DIR (2 processes under torchrun, gloo; dp4: 4). Each run builds the same
model from the same seed, wraps it (session.wrap_ddp) and trains 3 optimizer steps of 4 micro-batches
through ``TrainStep`` (megatron's schedule, optimizer and LR schedule), ℓ and exits changing between
micro-batches, replicas and steps: the last micro-batch's ℓ changes, pass 3 goes unused for a whole
step, an extra exit runs its head mid-pipeline before a last micro-batch without one. Runs:

  <recompute>-after_backward  the reference: one reduction after backward (megatron's default path)
  <recompute>-overlap         DepthOverlapDDP, small buckets (many per process group, so issue order matters)
  none-overlap-gather         (dp4 only) and the parameter all-gathers overlapped (``parallel.param_gather``)
  stock                       (ep2 only) megatron's own overlap_grad_reduce on the same steps: the evidence

for recompute none, and pass with route replay. ep2: expert parallel 2 (both replicas one EP group, ghost passes),
distributed optimizer off, so every reduced gradient is compared, and once more with it on
(``none-*-distopt``: reduce-scatter into shards whose layout follows the buckets, so parameters and
losses are compared); pp2: 2 pipeline stages (virtual chunks, one DDP per stage), distributed
optimizer on; dp4: data parallel 4 with the distributed optimizer (the GPU presets' path, issue 31 item 1).
Writes per run the per-step
losses, gradient norms, reduced gradients (ep2), buckets started during backward, final parameters,
or the error.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
from elastic_pretrain.parallel.overlap import DepthOverlapDDP, settle_param_gather
from elastic_pretrain.parallel.pipeline import MicroBatch, Pipeline
from elastic_pretrain.schedule import DepthPlan
from elastic_pretrain.train.config import TrainConfig
from elastic_pretrain.train.session import build_optimizer
from elastic_pretrain.train.step import TrainStep
from tests.dist.equivalence import wrap_ddp_for_test

MODEL = ModelConfig(hidden_size=32, num_heads=4, ffn_hidden_size=64, prelude_layers=1, coda_layers=1, core_layers=2,
                    num_experts=4, loops=3, flatten=1, moe_top_k=2, moe_ffn_hidden_size=32, moe_z_loss_coeff=1e-3,
                    moe_aux_loss_coeff=0.0)
ROWS, SEQ = 2, 16
BUCKET = 4000  # parameters per bucket: ~10 dense buckets and several expert ones
# (ℓ, supervised exits) of micro-batch i of replica r at step s: STEPS[s][r][i] (pp2 runs replica 0's)
STEPS = [
    [[(3, (3,)), (1, (1,)), (2, (1, 2)), (1, (1,))], [(1, (1,)), (2, (2,)), (3, (2, 3)), (2, (2,))]],
    [[(1, (1,)), (2, (2,)), (3, (1, 3)), (3, (3,))], [(2, (2,)), (1, (1,)), (1, (1,)), (1, (1,))]],
    [[(2, (2,)), (2, (1, 2)), (1, (1,)), (2, (2,))], [(1, (1,)), (2, (2,)), (1, (1,)), (1, (1,))]],
]
LAYOUTS = {"ep2": ParallelConfig(expert=2), "pp2": ParallelConfig(pipeline=2), "dp4": ParallelConfig()}


def plans(s: int, replica: int, layout: str) -> list[DepthPlan]:
    if layout in ("pp2", "dp4"):  # no expert group: each replica's own ℓ (dp4: replicas 2, 3 run 0's, 1's)
        return [DepthPlan(ell, exits, group_loops=ell) for ell, exits in STEPS[s][replica % 2]]
    mine = STEPS[s][replica]
    group = [max(STEPS[s][r][i][0] for r in range(2)) for i in range(len(mine))]  # the EP group's max ℓ
    return [DepthPlan(ell, exits, group_loops=g) for (ell, exits), g in zip(mine, group)]


def run(layout: str, recompute: str, grad_reduce: str, out: Path, *, distributed: bool,
        param_gather: str = "after_step") -> None:
    name = f"{recompute}-{grad_reduce}" + ("-distopt" if distributed and layout == "ep2" else "")
    name += "-gather" if param_gather == "overlap" else ""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{out}/store_{name}", rank=rank, world_size=world)
    par = LAYOUTS[layout]
    mesh = init_mesh(par, seed=21)
    torch.set_num_threads(1)
    cfg = dataclasses.replace(MODEL, route_replay=recompute == "pass")  # replay: router weight used functionally
    net = build_model(cfg, par, recompute=recompute)  # type: ignore[arg-type]
    net.set_modes(conditioning=True)  # the loop-count heads (of the mixed phase)
    if grad_reduce == "stock":  # megatron's overlap_grad_reduce with its own bucket bookkeeping
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(config=net.config, module=net, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True, bucket_size=BUCKET))
        net.config.no_sync_func = model.no_sync
        from megatron.core.distributed import finalize_model_grads

        net.config.finalize_model_grads_func = finalize_model_grads
    else:
        model = wrap_ddp_for_test(net, grad_reduce=grad_reduce, bucket_size=BUCKET,
                                  distributed_optimizer=distributed, param_gather=param_gather)
    assert isinstance(model, DepthOverlapDDP) == (grad_reduce == "overlap")
    job = SimpleNamespace(model=MODEL, train=TrainConfig(steps=3, warmup_steps=0, lr=1e-2, clip_grad=0.0,
                                                         distributed_optimizer=distributed))
    optimizer, scheduler = build_optimizer(job, model)  # type: ignore[arg-type]
    pipeline = Pipeline(model, net, mesh.pp_size) if mesh.pp_size > 1 else None
    step = TrainStep(model, optimizer, scheduler, seq_len=SEQ, micro_batch_size=ROWS, max_loops=MODEL.max_loops,
                     pipeline=pipeline)
    tokens = torch.randint(0, MODEL.vocab_size, (len(STEPS), 4, ROWS, SEQ + 1),
                           generator=torch.Generator().manual_seed(mesh.dp_rank))
    result: dict = {"loss": [], "grad_norm": [], "grads": [], "overlapped": [], "buckets": 0, "error": None,
                    "gathers_in_flight": []}
    if isinstance(model, DepthOverlapDDP):
        result["buckets"] = sum(len(lane) for lane in model.ledger.lanes)
    try:
        for s in range(len(STEPS)):
            micro = [MicroBatch(tokens[s, i], plan) for i, plan in enumerate(plans(s, mesh.dp_rank, layout))]
            got = step(micro)
            result["loss"].append(got.loss)
            result["grad_norm"].append(got.grad_norm)
            if not distributed:
                result["grads"].append({n: p.main_grad.detach().clone() for n, p in net.named_parameters()})
            if isinstance(model, DepthOverlapDDP):
                result["overlapped"].append(model.ledger.overlapped)
                result["gathers_in_flight"].append(sum(g.param_gather_handle is not None
                                                       for lane in model.ledger.lanes for g in lane))
    except Exception:  # the evidence of the stock path (both ranks stop at zero_grad_buffer, no collective)
        if grad_reduce != "stock":
            raise  # this rank dies, torchrun ends its peer (which may be waiting in a collective)
        result["error"] = traceback.format_exc(limit=4)
    settle_param_gather(optimizer)  # param_gather=overlap: the last step's all-gathers (as a checkpoint save does)
    result["params"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    torch.save(result, out / f"{layout}_{name}_rank{mesh.rank}.pt")
    del step, pipeline, optimizer, model, net
    teardown()


if __name__ == "__main__":
    which, out_dir = sys.argv[1], Path(sys.argv[2])
    if which == "dp4":  # 4 processes: data parallel 4 with the distributed optimizer (the GPU presets' path)
        for grad_reduce in ("after_backward", "overlap"):
            run(which, "none", grad_reduce, out_dir, distributed=True)
        run(which, "none", "overlap", out_dir, distributed=True, param_gather="overlap")  # and the gathers
        sys.exit(0)
    for recompute in ("none", "pass"):
        for grad_reduce in ("after_backward", "overlap"):
            run(which, recompute, grad_reduce, out_dir, distributed=which == "pp2")
    if which == "ep2":
        for grad_reduce in ("after_backward", "overlap"):  # the default optimizer: reduce-scatter
            run(which, "none", grad_reduce, out_dir, distributed=True)
        run(which, "none", "stock", out_dir, distributed=False)
