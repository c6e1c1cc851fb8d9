"""EP-safe mixed depth: run by tests/train/test_mixed_depth.py.

usage: mixed_depth.py ref|dist OUT_DIR — every case of CASES in one launch (a process group per case):
``ref`` as 1 process, ``dist`` under torchrun with 4 processes.
  ref   — 1 process: writes weights and batches; runs the 4 replicas' micro-batches as 4 micro-batches
          at their ℓ values (gradient accumulation) and writes loss/gradients.
  ep2   — 4 processes, expert parallel 2 (data parallel 4): replica r runs its micro-batch at ℓ_r,
          so the two members of each EP group run different numbers of passes.
  ref2 / tp2ep2 — the same with 2 replicas of tensor parallel 2 × expert parallel 2 (4 processes;
          each EP group pairs the two replicas' ranks of one TP rank).
  ep2-recompute — ep2 with ``train.recompute: pass`` (compared with the same reference, no recompute):
          the backward re-runs every pass and ghost pass, and the all-to-alls still pair up.
  ref-lastloop / ep2-lastloop — ep2 with ``model.kv_training: last_loop`` (every rank's no-grad
          final-K/V run, with its ghost passes, pairs up with its partner's).
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
from tests.dist.equivalence import global_name, local_view, wrap_ddp_for_test

LOOPS = [1, 3, 2, 4]  # ℓ of replica 0..3; EP groups pair replicas (0,1) and (2,3)
# (distributed layout, its one-process reference, route replay)
CASES = [("ep2", "ref", False), ("ep2", "ref", True), ("tp2ep2", "ref2", True), ("ep2-recompute", "ref", True),
         ("ep2-lastloop", "ref-lastloop", True)]


def model_cfg(replay: bool, mode: str = "") -> ModelConfig:
    return ModelConfig(hidden_size=32, num_heads=4, ffn_hidden_size=64, prelude_layers=1, coda_layers=1,
                       core_layers=2, num_experts=4, loops=2, flatten=2, moe_top_k=2, moe_ffn_hidden_size=32,
                       moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1e-3, route_replay=replay,
                       kv_training="last_loop" if mode.endswith("lastloop") else "same_pass")


def run(mode: str, out: Path, replay: bool) -> None:
    """One case in its own process group (a file store per case, so one launch runs them all)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    tag = "replay" if replay else "plain"
    dist.init_process_group("gloo", init_method=f"file://{out}/store_{mode}_{tag}", rank=rank, world_size=world)
    par = {"ep2": ParallelConfig(expert=2), "ep2-recompute": ParallelConfig(expert=2),
           "ep2-lastloop": ParallelConfig(expert=2),
           "tp2ep2": ParallelConfig(tensor=2, expert=2)}.get(mode, ParallelConfig())
    replicas = 2 if mode in ("ref2", "tp2ep2") else 4
    mesh = init_mesh(par, seed=11)
    torch.set_num_threads(1)
    cfg = model_cfg(replay, mode)
    net = build_model(cfg, par, recompute="pass" if mode.endswith("-recompute") else "none")
    if mode.startswith("ref"):
        batches = torch.randint(0, cfg.vocab_size, (4, 2, 17), generator=torch.Generator().manual_seed(5))
        torch.save({"state": net.state_dict(), "batches": batches}, out / f"inputs_{mode}_{tag}.pt")
        micro = [MicroBatch(batches[r], DepthPlan(LOOPS[r], (LOOPS[r],))) for r in range(replicas)]
    else:
        ref = next(r for layout, r, _ in CASES if layout == mode)
        saved = torch.load(out / f"inputs_{ref}_{tag}.pt", weights_only=True)
        n_local = cfg.experts_built // mesh.ep_size
        with torch.no_grad():
            for name, p in net.named_parameters():
                full = saved["state"][global_name(name, mesh.ep_rank, n_local)]
                p.copy_(local_view(name, full, p.shape, mesh.tp_size, mesh.tp_rank))
        r = mesh.dp_rank
        micro = [MicroBatch(saved["batches"][r], DepthPlan(LOOPS[r], (LOOPS[r],)))]
    model = wrap_ddp_for_test(net)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(micro), model=[model], num_microbatches=len(micro),
        seq_length=16, micro_batch_size=2, forward_only=False)
    loss, by_loops = _reduce_by_loops(reports, cfg.max_loops)
    grads = {n: p.main_grad.detach().clone() for n, p in net.named_parameters()}
    torch.save({"loss": loss, "by_loops": by_loops, "grads": grads, "ep": mesh.ep_rank, "dp": mesh.dp_rank,
                "tp": mesh.tp_rank},
               out / f"{mode}_{tag}_rank{mesh.rank}.pt")
    teardown()


if __name__ == "__main__":
    which, out_dir = sys.argv[1], Path(sys.argv[2])
    done = set()
    for layout, ref, route_replay in CASES:
        mode = ref if which == "ref" else layout
        if (mode, route_replay) not in done:  # a reference serves every layout compared with it
            run(mode, out_dir, route_replay)
            done.add((mode, route_replay))
