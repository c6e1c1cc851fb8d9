"""Run by tests/checkpoint/test_reshard.py: ``torchrun --nproc-per-node 2 ckpt_reshard.py OUT_DIR``.

Saves model + Adam state at one layout and loads it at another, in one launch: each phase opens its
own process group (a file store per phase), so a phase can have 1 or 2 ranks.

  P0 (1 rank)          reference tensors: the model's init + random Adam moments; save S0
  P1..P3 (2 ranks)     tp2 / dp2 / ep2: load S0 (TP, DP, EP 1 -> 2), compare, save S1..S3
  P4 (1 rank)          load S1, S2, S3 (TP, DP, EP 2 -> 1), compare

Compared bitwise with the reference, sharded for the rank: every parameter, and every Adam moment
slice the rank's (distributed) optimizer owns, read through megatron's own optimizer API; the Adam
step count too. Writes ``<OUT_DIR>/result_<phase>_rank<R>.json`` (what was compared).
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

from elastic_pretrain.checkpoint.manager import load_tensors, save_tensors
from elastic_pretrain.checkpoint.optim_state import ensure_state, optimizers, owned_states
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import Mesh, ParallelConfig, init_mesh, teardown
from elastic_pretrain.train.session import build_optimizer, wrap_ddp
from tests.dist.equivalence import tp_shard

JOB = load_job(
    Path(__file__).resolve().parents[2] / "jobs" / "tiny-cpu.yaml",
    ["model.hidden_size=32", "model.ffn_hidden_size=64", "model.moe_ffn_hidden_size=32", "train.steps=100"],
)
LAYOUTS = {
    "single": ParallelConfig(),
    "tp2": ParallelConfig(tensor=2),
    "dp2": ParallelConfig(),
    "ep2": ParallelConfig(expert=2),
}
ADAM_STEP = 7.0
STATES = ("exp_avg", "exp_avg_sq")


def open_phase(out: Path, phase: str, layout: str, world: int) -> Mesh:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{out}/store_{phase}", rank=rank, world_size=world)
    return init_mesh(LAYOUTS[layout], seed=11)


def build(layout: str) -> tuple[Any, Any, Any]:
    net = build_model(JOB.model, LAYOUTS[layout])
    model = wrap_ddp(JOB, net)
    optimizer, _ = build_optimizer(JOB, model)
    ensure_state(optimizer)
    return net, model, optimizer


def expected(name: str, full: dict[str, torch.Tensor], param: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The part of a full (1-rank) tensor that this rank holds for ``name`` under TP/EP."""
    if ".local_experts." in name and mesh.ep_size > 1:  # local expert k is global expert ep_rank * n + k
        head, rest = name.split(".local_experts.")
        k, tail = rest.split(".", 1)
        n_local = JOB.model.experts_built // mesh.ep_size
        name = f"{head}.local_experts.{mesh.ep_rank * n_local + int(k)}.{tail}"
    tensor = full[name]
    if tensor.shape == param.shape:  # replicated (also experts under TP: expert-TP is 1)
        return tensor
    return tp_shard(name, tensor, param.partition_dim, mesh.tp_size, mesh.tp_rank)


def owned_slices(optimizer: Any, net: Any) -> list[tuple[str, Any, int, int, dict[str, torch.Tensor]]]:
    """(name, param, start, end, {param, exp_avg, exp_avg_sq, step}) for each slice this rank's optimizers own."""
    names = {id(p): n for n, p in net.named_parameters()}
    out = []
    for opt in optimizers(optimizer):
        for p in opt.model_param_group_index_map:
            r = opt._get_model_param_range_map(p)["param"]
            out.append((names[id(p)], p, r.start, r.end, owned_states(opt, p)))
    return out


def compare(net: Any, optimizer: Any, mesh: Mesh) -> dict[str, Any]:
    bad, params, slices, covered = [], 0, 0, 0
    for name, p in net.named_parameters():
        params += 1
        if not torch.equal(p.detach(), expected(name, REF["param"], p, mesh)):
            bad.append(f"param {name}")
    for name, p, start, end, tensors in owned_slices(optimizer, net):
        slices += 1
        covered += end - start
        for state in STATES:
            want = expected(name, REF[state], p, mesh).reshape(-1)[start:end]
            if not torch.equal(tensors[state].detach().view(-1), want):
                bad.append(f"{state} {name}")
        if float(tensors["step"]) != ADAM_STEP:
            bad.append(f"step {name}: {float(tensors['step'])}")
    return {
        "params": params,
        "slices": slices,
        "covered": covered,
        "bad": bad,
        "total": sum(p.numel() for p in net.parameters()),
    }


def reference(out: Path) -> None:
    """P0: one rank; the reference is the model's own init plus random (positive for v) Adam moments."""
    mesh = open_phase(out, "p0", "single", 1)
    net, model, optimizer = build("single")
    g = torch.Generator().manual_seed(3)
    ref: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in net.named_parameters():
        ref["param"][name] = p.detach().clone()
        ref["exp_avg"][name] = torch.randn(p.shape, generator=g)
        ref["exp_avg_sq"][name] = torch.rand(p.shape, generator=g)
    with torch.no_grad():
        for name, _, start, end, tensors in owned_slices(optimizer, net):
            for state in STATES:
                tensors[state].view(-1).copy_(ref[state][name].view(-1)[start:end])
            tensors["step"].fill_(ADAM_STEP)
    (out / "S0").mkdir()
    save_tensors(net, optimizer, out / "S0", strategy())
    torch.save(ref, out / "ref.pt")
    del net, model, optimizer
    close(mesh)


def strategy() -> Any:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def close(mesh: Mesh) -> None:
    gc.collect()
    teardown()


def report(out: Path, phase: str, mesh: Mesh, result: dict[str, Any]) -> None:
    (out / f"result_{phase}_rank{mesh.rank}.json").write_text(json.dumps(result))


def main(out: Path) -> None:
    global REF
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    if rank == 0:
        reference(out)
    for i, layout in enumerate(("tp2", "dp2", "ep2"), start=1):
        mesh = open_phase(out, f"p{i}", layout, 2)  # rank 1 waits here until rank 0 has finished P0
        REF = torch.load(out / "ref.pt", weights_only=True)
        net, model, optimizer = build(layout)
        load_tensors(net, optimizer, out / "S0", adam_step=ADAM_STEP)
        report(out, f"1to{layout}", mesh, compare(net, optimizer, mesh))
        if rank == 0:
            (out / f"S{i}").mkdir()
        dist.barrier()
        save_tensors(net, optimizer, out / f"S{i}", strategy())
        del net, model, optimizer
        close(mesh)
    if rank == 0:
        mesh = open_phase(out, "p4", "single", 1)
        for i, layout in enumerate(("tp2", "dp2", "ep2"), start=1):
            net, model, optimizer = build("single")
            load_tensors(net, optimizer, out / f"S{i}", adam_step=ADAM_STEP)
            report(out, f"{layout}to1", mesh, compare(net, optimizer, mesh))
            del net, model, optimizer
        close(mesh)


REF: dict[str, dict[str, torch.Tensor]] = {}

if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
