"""Run by tests/parallel/test_equivalence.py under torchrun (or 1 process for the reference).

usage: equivalence.py MODE OUT_DIR  — MODE is ref (1 process: writes weights, batch, loss, grads) or
tp2/ep2 (2 processes: load the reference weights sharded for this rank, same batch, write loss/grads).
Gradients come out of the real training path: megatron DDP + schedule + finalize_model_grads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
from elastic_pretrain.parallel.pipeline import MicroBatch
from elastic_pretrain.schedule import DepthPlan
from elastic_pretrain.train.session import wrap_ddp
from elastic_pretrain.train.step import _forward_step, _reduce_by_loops

MODEL = ModelConfig(hidden_size=32, num_heads=4, ffn_hidden_size=64, prelude_layers=1, coda_layers=1, core_layers=2,
                    num_experts=4, loops=2, moe_top_k=2, moe_ffn_hidden_size=32, flatten=1, moe_z_loss_coeff=1e-3,
                    moe_aux_loss_coeff=0.0)  # batch-statistics aux loss differs by design under a DP split


def shard_for_rank(name: str, full: torch.Tensor, param: torch.Tensor, mesh) -> torch.Tensor:
    """The slice of a full (1-process) tensor that this rank holds under TP/EP."""
    if ".local_experts." in name:
        return REF[global_name(name, mesh.ep_rank, MODEL.experts_built // mesh.ep_size)]
    if getattr(param, "tensor_model_parallel", False):
        return tp_shard(name, full, param.partition_dim, mesh.tp_size, mesh.tp_rank)
    return full


def global_name(name: str, ep_rank: int, n_local: int) -> str:
    """A parameter's name in the 1-process model: local expert k on EP rank r is global r*n_local+k."""
    if ".local_experts." not in name:
        return name
    head, rest = name.split(".local_experts.")
    k, tail = rest.split(".", 1)
    return f"{head}.local_experts.{ep_rank * n_local + int(k)}.{tail}"


def local_view(name: str, full: torch.Tensor, local_shape: torch.Size, tp: int, tp_rank: int) -> torch.Tensor:
    """The part of a 1-process tensor that a rank holding ``local_shape`` corresponds to (TP shard)."""
    if full.shape == local_shape:
        return full
    dim = next(d for d in range(full.dim()) if full.shape[d] != local_shape[d])
    return tp_shard(name, full, dim, tp, tp_rank)


def tp_shard(name: str, full: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    """TP shard of a full tensor. SwiGLU fc1 is [gate; up]: each rank holds [gate_r; up_r]."""
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=dim)[rank]


def main(mode: str, out: Path) -> None:
    global REF
    par = {"ref": ParallelConfig(), "tp2": ParallelConfig(tensor=2), "ep2": ParallelConfig(expert=2)}[mode]
    mesh = init_mesh(par, seed=7)
    torch.set_num_threads(1)
    net = build_model(MODEL, par)
    if mode == "ref":
        g = torch.Generator().manual_seed(0)
        batch = torch.randint(0, MODEL.vocab_size, (4, 17), generator=g)
        torch.save({"state": net.state_dict(), "batch": batch}, out / "ref_inputs.pt")
    else:
        saved = torch.load(out / "ref_inputs.pt", weights_only=True)
        REF, batch = saved["state"], saved["batch"]
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(shard_for_rank(name, REF[name], p, mesh))
        rows = batch.shape[0] // mesh.dp_size
        batch = batch[mesh.dp_rank * rows : (mesh.dp_rank + 1) * rows]
    model = wrap_ddp_for_test(net)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    plan = DepthPlan(loops=2, exits=(1, 2))  # both exits supervised: checks the telescopic sum too
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter([MicroBatch(batch, plan)]), model=[model],
        num_microbatches=1, seq_length=16, micro_batch_size=batch.shape[0], forward_only=False)
    loss, by_loops = _reduce_by_loops(reports, MODEL.max_loops)
    grads = {n: p.main_grad.detach().clone() for n, p in net.named_parameters()}
    torch.save({"loss": loss, "by_loops": by_loops, "grads": grads, "rank": mesh.rank, "tp": mesh.tp_rank,
                "ep": mesh.ep_rank}, out / f"{mode}_rank{mesh.rank}.pt")
    teardown()


def wrap_ddp_for_test(net, balance: str = "off", grad_reduce: str = "after_backward", bucket_size=None,
                      distributed_optimizer: bool = False, param_gather: str = "after_step"):
    class _Job:  # wrap_ddp reads only these
        class train:
            pass

        class schedule:
            pass

        class parallel:
            pass

    _Job.train.distributed_optimizer = distributed_optimizer  # type: ignore[attr-defined]
    _Job.schedule.balance = balance  # type: ignore[attr-defined]
    _Job.parallel.grad_reduce = grad_reduce  # type: ignore[attr-defined]
    _Job.parallel.param_gather = param_gather  # type: ignore[attr-defined]
    _Job.parallel.bucket_size = 0  # type: ignore[attr-defined]

    return wrap_ddp(_Job, net, bucket_size=bucket_size)


REF: dict[str, torch.Tensor] = {}

if __name__ == "__main__":
    out_dir = Path(sys.argv[2])
    if sys.argv[1] == "ref":
        main("ref", out_dir)
    else:  # every 2-rank layout in one launch: a process group (file store) per layout
        import os

        import torch.distributed as dist

        for layout in sys.argv[1].split(","):
            dist.init_process_group("gloo", init_method=f"file://{out_dir}/store_{layout}",
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
            main(layout, out_dir)
