"""Optimizer state in *model space*: one tensor per (model parameter, Adam state), sharded like the
parameter itself — so a checkpoint reshards over TP, EP and DP exactly as the model does.

Why not megatron's own formats: on megatron-core 0.16.1 ``dp_reshardable`` reshards only over DP,
``fully_sharded_model_space`` needs ``ShardedTensor.flattened_range`` (rejected by 0.16.1), and
``fully_reshardable`` keys depend on how many chained optimizers a layout has (EP=1: one; EP>1:
dense + expert), so EP 2→1 cannot load. Here every DP rank contributes the flat slice of each
parameter it owns (DistributedOptimizer) and one all-reduce per (optimizer, state) assembles the
parameter's full local tensor — summed as int32 bit patterns over disjoint slices, so the result is
bit-exact (also for -0.0). Keys are ``optimizer.<state>.<model key>``, independent of the layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

from elastic_pretrain.parallel.device import device

ADAM_STATES = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class _Entry:
    """One model parameter as one optimizer sees it on this rank."""

    key: str
    param: torch.nn.Parameter
    sharded: ShardedTensor | ShardedTensorFactory
    start: int  # this rank's flat slice [start, end) of the parameter; empty when start == end
    end: int
    tensors: dict[str, torch.Tensor]  # "param" (main copy), "exp_avg", "exp_avg_sq" (flat slices), "step"


def optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(opt: Any) -> bool:
    return hasattr(opt, "model_param_gbuf_map")


def ensure_state(optimizer: Any) -> None:
    """Allocate Adam state (zeros, step 0) where it does not exist yet, so it can be loaded into."""
    for opt in optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _main_params(opt: Any) -> dict[int, torch.Tensor]:
    """Non-distributed optimizers: model parameter id -> the parameter the optimizer updates."""
    if hasattr(opt, "float16_groups"):  # bf16: fp32 main copies
        pairs = [(m, f) for mg, fg in zip(opt.float16_groups, opt.fp32_from_float16_groups) for m, f in zip(mg, fg)]
        pairs += [(p, p) for g in opt.fp32_from_fp32_groups for p in g]
        return {id(m): f for m, f in pairs}
    return {id(p): p for g in opt.optimizer.param_groups for p in g["params"]}


def _entries(opt: Any, by_param: dict[int, tuple[str, Any]]) -> Iterator[_Entry]:
    """Every model parameter this optimizer updates, in checkpoint-key order."""
    if _is_distributed(opt):
        # every parameter of its buffers (model_param_gbuf_map holds only those overlapping this rank's shard)
        params = [p for buf in opt.buffers for p in buf.param_index_map]
        owned = opt.model_param_group_index_map
    else:
        mains = _main_params(opt)
        if hasattr(opt, "float16_groups"):
            params = [p for g in opt.float16_groups + opt.fp32_from_fp32_groups for p in g]
        else:
            params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    for p in sorted(params, key=lambda q: by_param[id(q)][0]):
        key, sharded = by_param[id(p)]
        if _is_distributed(opt):
            if p not in owned:
                yield _Entry(key, p, sharded, 0, 0, {})
                continue
            r = opt._get_model_param_range_map(p)["param"]
            yield _Entry(key, p, sharded, r.start, r.end, opt._get_main_param_and_optimizer_states(p))
        else:
            main = mains[id(p)]
            yield _Entry(
                key,
                p,
                sharded,
                0,
                p.numel(),
                {
                    "param": main.view(-1),
                    **{k: (v.view(-1) if k != "step" else v) for k, v in opt.optimizer.state[main].items()},
                },
            )


def _param_index(model_sharded: ShardedStateDict) -> dict[int, tuple[str, Any]]:
    """id(parameter) -> (checkpoint key, its ShardedTensor/factory) from the model's sharded state dict."""
    out: dict[int, tuple[str, Any]] = {}

    def walk(d: Any) -> None:
        if isinstance(d, dict):
            for v in d.values():
                walk(v)
        elif isinstance(d, (ShardedTensor, ShardedTensorFactory)) and isinstance(d.data, torch.nn.Parameter):
            out[id(d.data)] = (d.key, d)

    walk(model_sharded)
    return out


def _states(opt: Any, entries: list[_Entry]) -> list[str]:
    """Adam moments always; the main parameter only when it is a separate (fp32) copy of a bf16 model."""
    separate_main = any(e.param.dtype != torch.float32 for e in entries)
    return [*ADAM_STATES, "param"] if separate_main else list(ADAM_STATES)


def _dp_group(opt: Any) -> Any:
    return getattr(opt, "data_parallel_group", None) if _is_distributed(opt) else None


def _assemble(entries: list[_Entry], state: str, group: Any) -> torch.Tensor:
    """The full flat fp32 tensors of every entry, concatenated; each DP rank fills its own slices.

    Assembled on the device (the DP group is NCCL on GPU machines), returned on the host: the
    checkpoint writer reads host memory, and the full copy must not stay in GPU memory."""
    total = sum(e.param.numel() for e in entries)
    flat = torch.zeros(total, dtype=torch.float32, device=device())
    offset = 0
    for e in entries:
        if e.end > e.start:
            flat[offset + e.start : offset + e.end] = e.tensors[state].detach().view(-1).float()
        offset += e.param.numel()
    if group is not None and dist.get_world_size(group) > 1:
        bits = flat.view(torch.int32)  # disjoint slices: integer sum of bit patterns is exact
        dist.all_reduce(bits, group=group)
    return flat.cpu()


def sharded_optimizer_state(optimizer: Any, model_sharded: ShardedStateDict) -> tuple[ShardedStateDict, float]:
    """(``{state: {"<optimizer>.<entry>": ShardedTensor}}`` to save, Adam's step count).

    Collective over each optimizer's DP group."""
    by_param = _param_index(model_sharded)
    out: ShardedStateDict = {}
    step = 0.0
    for o, opt in enumerate(optimizers(optimizer)):
        entries = list(_entries(opt, by_param))
        for e in entries:
            if "step" in e.tensors:
                step = max(step, float(e.tensors["step"]))
        for state in _states(opt, entries):
            flat = _assemble(entries, state, _dp_group(opt))
            offset = 0
            for i, e in enumerate(entries):
                full = flat[offset : offset + e.param.numel()].view(e.param.shape)
                offset += e.param.numel()
                out.setdefault(state, {})[f"{o}.{i}"] = make_sharded_optimizer_tensor(
                    e.sharded, full, f"optimizer.{state}"
                )
    t = torch.tensor([step], dtype=torch.float64, device=device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a rank may own no slice of some optimizer
    return out, float(t.item())


def loading_template(optimizer: Any, model_sharded: ShardedStateDict) -> ShardedStateDict:
    """The same structure as :func:`sharded_optimizer_state`, with empty tensors to load into."""
    by_param = _param_index(model_sharded)
    out: ShardedStateDict = {}
    for o, opt in enumerate(optimizers(optimizer)):
        entries = list(_entries(opt, by_param))
        for state in _states(opt, entries):
            for i, e in enumerate(entries):
                empty = torch.empty(e.param.shape, dtype=torch.float32)
                out.setdefault(state, {})[f"{o}.{i}"] = make_sharded_optimizer_tensor(
                    e.sharded, empty, f"optimizer.{state}"
                )
    return out


@torch.no_grad()
def load_optimizer_state(optimizer: Any, model_sharded: ShardedStateDict, loaded: dict[str, Any], step: float) -> None:
    """Copy this rank's slices of the loaded full tensors into the optimizer (after :func:`ensure_state`)."""
    by_param = _param_index(model_sharded)
    for o, opt in enumerate(optimizers(optimizer)):
        entries = list(_entries(opt, by_param))
        for state in _states(opt, entries):
            for i, e in enumerate(entries):
                if e.end > e.start:
                    src = loaded[state][f"{o}.{i}"].reshape(-1)[e.start : e.end]
                    e.tensors[state].view(-1).copy_(src.to(e.tensors[state].dtype))
        for e in entries:
            if "step" in e.tensors:
                e.tensors["step"].fill_(step)
