"""Run by tests/parallel/test_pipeline.py (via pipeline_checks.py); alone: ``torchrun --nproc-per-node 4 … OUT``.

Pipeline parallelism of the loop against one process, in one launch (a file store per phase, so a
phase can use 1, 2 or 4 of the ranks, as in ckpt_reshard.py):

  P0 (1 rank)   reference: weights (conditioning head made non-zero), batches; for each case the
                1-process schedule's loss, loss per exit and every gradient
  P1 (4 ranks)  PP=2 x EP=2 (2 replicas; the EP group pairs the replicas' ranks of one stage)

``pipeline_parity.py OUT_DIR pp2|pp2tp2`` runs another layout instead of P1 (not in CI, for time:
PP=2 alone is covered by the trainer check pipeline_resume.py; both were verified).

Cases (route replay and the loop-conditioning head on in all):
  fixed     every micro-batch at ℓ = L_max
  mixed     ℓ per micro-batch and replica (independent-rank style: the EP partners differ, so the
            pipeline runs identity chunks, ghost MoE calls, and extra exits mid-pipeline)
  mixedrecompute  mixed with train.recompute=pass (every chunk and ghost chunk re-run in backward),
            against the same reference (pipelined phase only)
Writes ``result_<phase>_<case>_rank<R>.json``: loss, loss per exit, the gradients compared and
those that differ (fp32: rtol 1e-4, atol 1e-6 — sums reassociate across ranks, nothing else differs).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import Mesh, ParallelConfig, init_mesh, teardown
from elastic_pretrain.parallel.pipeline import MicroBatch, Pipeline, run_pipeline
from elastic_pretrain.schedule import DepthPlan
from elastic_pretrain.train.step import _forward_step, _reduce_by_loops
from tests.dist.equivalence import global_name, local_view, wrap_ddp_for_test

MODEL = ModelConfig(
    hidden_size=32,
    num_heads=4,
    ffn_hidden_size=64,
    prelude_layers=1,
    coda_layers=1,
    core_layers=2,
    num_experts=4,
    loops=3,
    flatten=1,
    moe_top_k=2,
    moe_ffn_hidden_size=32,
    moe_z_loss_coeff=1e-3,
    moe_aux_loss_coeff=0.0,
    route_replay=True,
)  # aux loss: batch statistics differ under a DP split
MICRO, ROWS, SEQ = 4, 2, 16  # micro-batches per replica, rows per micro-batch, tokens per row
# DepthPlan (ℓ, supervised exits) of micro-batch i of replica r
PLANS = {
    "fixed": [[(3, (3,))] * MICRO] * 2,
    "mixed": [[(3, (1, 3)), (1, (1,)), (2, (2,)), (3, (2, 3))], [(1, (1,)), (3, (3,)), (2, (1, 2)), (2, (2,))]],
}
LAYOUTS = {
    "ref": ParallelConfig(),
    "pp2": ParallelConfig(pipeline=2),
    "pp2ep2": ParallelConfig(pipeline=2, expert=2),
    "pp2tp2": ParallelConfig(pipeline=2, tensor=2),
}


def open_phase(out: Path, phase: str, world: int, layout: str) -> Mesh:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{out}/store_{phase}", rank=rank, world_size=world)
    mesh = init_mesh(LAYOUTS[layout], seed=7)
    torch.set_num_threads(1)
    return mesh


def close() -> None:
    gc.collect()
    teardown()


def micro_batches(batches: torch.Tensor, case: str, replicas: list[int]) -> list[MicroBatch]:
    return [MicroBatch(batches[r, i], DepthPlan(*PLANS[case][r][i])) for r in replicas for i in range(MICRO)]


def reference(out: Path) -> None:
    open_phase(out, "p0", 1, "ref")
    net = build_model(MODEL, LAYOUTS["ref"])
    net.set_modes(conditioning=True)
    with torch.no_grad():  # the head is zero-initialised; make its gradient reach every one of its weights
        net.loop_conditioning.out.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(1))
    batches = torch.randint(0, MODEL.vocab_size, (2, MICRO, ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    saved: dict[str, Any] = {"state": {n: p.detach().clone() for n, p in net.named_parameters()}, "batches": batches}
    model = wrap_ddp_for_test(net)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for case in PLANS:
        for replicas in ([0], [0, 1]):
            model.zero_grad_buffer()
            micro = micro_batches(batches, case, replicas)
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step,
                data_iterator=iter(micro),
                model=[model],
                num_microbatches=len(micro),
                seq_length=SEQ,
                micro_batch_size=ROWS,
                forward_only=False,
            )
            loss, by_loops = _reduce_by_loops(reports, MODEL.max_loops)
            saved[f"{case}_{len(replicas)}"] = {
                "loss": loss,
                "by_loops": by_loops,
                "grads": {n: p.main_grad.detach().clone() for n, p in net.named_parameters()},
            }
    torch.save(saved, out / "ref.pt")
    del model, net
    close()


def pipelined(out: Path, phase: str, layout: str, world: int) -> None:
    mesh = open_phase(out, phase, world, layout)
    ref = torch.load(out / "ref.pt", weights_only=True)
    net = build_model(MODEL, LAYOUTS[layout])
    net.set_modes(conditioning=True)
    n_local = MODEL.experts_built // mesh.ep_size
    with torch.no_grad():
        for name, p in net.named_parameters():
            full = ref["state"][global_name(name, mesh.ep_rank, n_local)]
            p.copy_(local_view(name, full, p.shape, mesh.tp_size, mesh.tp_rank))
    model = wrap_ddp_for_test(net)
    syncs = count_calls(model, "finish_grad_sync")
    pipeline = Pipeline(model, net, stages=mesh.pp_size)
    for case in [*PLANS, "mixedrecompute"]:
        plans = case.removesuffix("recompute")
        net.set_modes(recompute="pass" if case.endswith("recompute") else "none")
        model.zero_grad_buffer()
        syncs.clear()
        micro = micro_batches(ref["batches"], plans, [mesh.dp_rank])
        reports = run_pipeline(pipeline, micro, seq_len=SEQ, training=True)
        loss, by_loops = _reduce_by_loops(reports, MODEL.max_loops)
        want = ref[f"{plans}_{mesh.dp_size}"]
        bad, compared, nonzero = [], 0, 0
        for name, p in net.named_parameters():
            got = p.main_grad.detach()
            full = want["grads"][global_name(name, mesh.ep_rank, n_local)]
            expect = local_view(name, full, got.shape, mesh.tp_size, mesh.tp_rank)
            compared += 1
            nonzero += int(bool(expect.abs().sum() > 0))
            if not torch.allclose(got, expect, rtol=1e-4, atol=1e-6):
                bad.append(f"{name}: max diff {float((got - expect).abs().max()):.3g}")
        result = {
            "loss": loss,
            "ref_loss": want["loss"],
            "by_loops": by_loops,
            "ref_by_loops": want["by_loops"],
            "compared": compared,
            "nonzero": nonzero,
            "bad": bad,
            "stage": mesh.pp_rank,
            "grad_syncs": len(syncs),
            "names": sorted(global_name(n, mesh.ep_rank, n_local) for n, _ in net.named_parameters()),
            "ref_names": sorted(ref["state"]),
        }
        (out / f"result_{phase}_{case}_rank{mesh.rank}.json").write_text(json.dumps(result))
    del pipeline, model, net
    close()


def count_calls(obj: Any, method: str) -> list[int]:
    """Record each call of ``obj.method`` (which still runs): DP/EP gradient reduction must happen once a step."""
    calls: list[int] = []
    real = getattr(obj, method)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    setattr(obj, method, counted)
    return calls


def main(out: Path, layout: str) -> None:
    rank = int(os.environ["RANK"])
    if rank == 0:
        reference(out)
    world = 2 if layout == "pp2" else 4
    if rank < world:  # the other ranks wait at this phase's store until rank 0 has written the reference
        pipelined(out, layout, layout, world)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), sys.argv[2] if len(sys.argv) > 2 else "pp2ep2")
