"""MoE edge layers under expert parallelism with different plans per member: run by tests/train/test_edge_moe_ep.py.

usage: edge_moe_ep.py ref|ep2 OUT_DIR — every case of PLANS in one launch (a process group per case):
  ref — 1 process: writes weights and batches; runs both replicas' micro-batches at their plans (gradient
        accumulation) and writes loss/gradients.
  ep2 — 2 processes under torchrun, expert parallel 2 (data parallel 2): replica r runs its micro-batch at
        its own plan, so the two members of the expert-parallel group run different numbers of passes
        (``mixed``: the shallower joins the deeper one's passes as ghost calls) or supervise different
        exits (``telescopic``). With ``model.edge_mlp: moe`` the coda layer is an all-to-all too: before
        issue 30's item 4 a head ran between passes and paired with the partner's core-layer call.
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
from elastic_pretrain.train.step import _forward_step, _reduce_by_loops
from tests.dist.equivalence import global_name, wrap_ddp_for_test

# the plans of replica 0 and 1 (one expert-parallel group): (loops, exits)
PLANS = {"mixed": [(1, (1,)), (3, (3,))], "telescopic": [(3, (1, 3)), (3, (2, 3))]}
MODEL = ModelConfig(hidden_size=32, num_heads=4, ffn_hidden_size=64, prelude_layers=1, coda_layers=1, core_layers=2,
                    num_experts=4, loops=3, flatten=1, moe_top_k=2, moe_ffn_hidden_size=32, edge_mlp="moe",
                    moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1e-3)  # batch-statistics aux loss differs under a DP split


def run(mode: str, case: str, out: Path) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("gloo", init_method=f"file://{out}/store_{mode}_{case}", rank=rank, world_size=world)
    par = ParallelConfig(expert=2) if mode == "ep2" else ParallelConfig()
    mesh = init_mesh(par, seed=3)
    torch.set_num_threads(1)
    net = build_model(MODEL, par)
    plans = [DepthPlan(loops, exits) for loops, exits in PLANS[case]]
    if mode == "ref":
        batches = torch.randint(0, MODEL.vocab_size, (2, 2, 17), generator=torch.Generator().manual_seed(5))
        torch.save({"state": net.state_dict(), "batches": batches}, out / f"inputs_{case}.pt")
        micro = [MicroBatch(batches[r], plans[r]) for r in range(2)]
    else:
        saved = torch.load(out / f"inputs_{case}.pt", weights_only=True)
        n_local = MODEL.experts_built // mesh.ep_size
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(saved["state"][global_name(name, mesh.ep_rank, n_local)])
        micro = [MicroBatch(saved["batches"][mesh.dp_rank], plans[mesh.dp_rank])]
    model = wrap_ddp_for_test(net)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(micro), model=[model], num_microbatches=len(micro),
        seq_length=16, micro_batch_size=2, forward_only=False)
    loss, by_loops = _reduce_by_loops(reports, MODEL.max_loops)
    grads = {n: p.main_grad.detach().clone() for n, p in net.named_parameters()}
    torch.save({"loss": loss, "by_loops": by_loops, "grads": grads, "ep": mesh.ep_rank},
               out / f"{mode}_{case}_rank{mesh.rank}.pt")
    teardown()


if __name__ == "__main__":
    for case_name in PLANS:
        run(sys.argv[1], case_name, Path(sys.argv[2]))
