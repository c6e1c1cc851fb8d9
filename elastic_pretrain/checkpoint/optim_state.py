"""Optimizer state in *model space*, each data-parallel rank saving and loading only its own slice.

Every (model parameter, Adam state) is one global tensor, ``optimizer.<state>.<model key>``, sharded like the
parameter over TP/EP/PP, so a checkpoint reshards exactly as the model does; each DP rank saves its flat slice
as at most ``2·ndim − 1`` boxes of that tensor (views: no copy, no communication) and loads only its own.
megatron-core 0.16.1's own optimizer formats cannot reshard EP 2 → 1. Adam's step count is one number in
``trainer.json``, kept wherever the optimizer keeps it (:func:`step_home`); losing it restarts bias correction.
docs/checkpoints.md, "Optimizer state in model space, saved in shares" and "Adam's step, wherever ...".
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, ShardedTensorFactory

from elastic_pretrain.errors import UserError
from elastic_pretrain.parallel.device import device

if TYPE_CHECKING:  # annotations only (megatron-core's optimizer: a ChainedOptimizer or one of its parts)
    from megatron.core.optimizer import MegatronOptimizer

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


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A box of one saved global tensor that holds the flat range [start, end) of a local parameter."""

    start: int
    end: int
    base: ShardedTensor  # the part of the parameter the box lies in (the parameter, or a factory's part)
    offset: tuple[int, ...]  # the box inside ``base``'s local tensor
    shape: tuple[int, ...]


def optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(opt: MegatronOptimizer) -> bool:
    return hasattr(opt, "model_param_gbuf_map")


def ensure_state(optimizer: MegatronOptimizer) -> None:
    """Allocate Adam state (zeros, step 0) where it does not exist yet, so it can be loaded into. The step
    goes where the optimizer keeps it: a per-parameter ``step`` in FusedAdam's state would break its
    ``state_dict`` (it unscales every state entry by name)."""
    for opt in optimizers(optimizer):
        inner = opt.optimizer
        home = step_home(inner)
        for group in _groups(inner):
            if home == "group":
                group.setdefault("step", 0)
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    if home == "state":
                        state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _groups(inner: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups that hold parameters: FusedAdam skips empty groups, whose step never counts."""
    return [g for g in inner.param_groups if g["params"]]


def _group_step_classes() -> tuple[type, ...]:
    """Optimizer classes that keep Adam's step in the param group: the fused Adam megatron picks when
    Transformer Engine (or Apex) imports; its distributed optimizer reads ``group["step"]`` "for TE
    FusedAdam support" (megatron-core 0.16.1 ``distrib_optimizer.py``: ``state_dict``)."""
    from megatron.core import optimizer as mcore_optimizer

    return () if mcore_optimizer.USING_PYTORCH_OPTIMIZER else (mcore_optimizer.Adam,)


def step_home(inner: torch.optim.Optimizer) -> Literal["group", "state"]:
    """Where ``inner`` keeps Adam's step: once it has stepped, where the step is; before, by its class."""
    groups = _groups(inner)
    if any("step" in g for g in groups):
        return "group"
    if any("step" in inner.state.get(p, {}) for g in groups for p in g["params"]):
        return "state"
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return "state"  # torch keeps a per-parameter step tensor from the first step on
    if isinstance(inner, _group_step_classes()):
        return "group"
    raise UserError(
        f"optimizer {type(inner).__module__}.{type(inner).__qualname__} keeps Adam's step neither in its param "
        "groups nor in its per-parameter state, so a checkpoint cannot save it: use torch's Adam/AdamW or "
        "Transformer Engine's/Apex's FusedAdam (what megatron-core builds)"
    )


def local_adam_step(optimizer: MegatronOptimizer) -> float:
    """Adam's step count on this rank (the largest of its optimizers'; 0 before the first step)."""
    step = 0.0
    for opt in optimizers(optimizer):
        inner = opt.optimizer
        home = step_home(inner)
        for g in _groups(inner):
            values = (
                [g.get("step", 0)] if home == "group" else [inner.state.get(p, {}).get("step", 0) for p in g["params"]]
            )
            step = max([step, *(float(v) for v in values)])
    return step


@torch.no_grad()
def set_adam_step(optimizer: MegatronOptimizer, step: float) -> None:
    """Set Adam's step count where each optimizer keeps it, in its own type (FusedAdam: an int, or a tensor
    when capturable; torch: a tensor per parameter) — after :func:`ensure_state`."""
    for opt in optimizers(optimizer):
        inner = opt.optimizer
        home = step_home(inner)
        for g in _groups(inner):
            if home == "group":
                if isinstance(g.get("step"), torch.Tensor):
                    g["step"].fill_(step)
                else:
                    g["step"] = round(step)
                continue
            for p in g["params"]:
                inner.state[p]["step"].fill_(step)


def _main_params(opt: MegatronOptimizer) -> dict[int, torch.Tensor]:
    """Non-distributed optimizers: model parameter id -> the parameter the optimizer updates."""
    if hasattr(opt, "float16_groups"):  # bf16: fp32 main copies
        pairs = [(m, f) for mg, fg in zip(opt.float16_groups, opt.fp32_from_float16_groups) for m, f in zip(mg, fg)]
        pairs += [(p, p) for g in opt.fp32_from_fp32_groups for p in g]
        return {id(m): f for m, f in pairs}
    return {id(p): p for g in opt.optimizer.param_groups for p in g["params"]}


def _entries(opt: MegatronOptimizer, by_param: dict[int, tuple[str, Any]]) -> Iterator[_Entry]:
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
            yield _Entry(key, p, sharded, r.start, r.end, owned_states(opt, p))
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


def _group_order(opt: MegatronOptimizer) -> dict[int, tuple[int, int]]:
    """id(model parameter) -> (param group, position) of its main shard in the distributed optimizer's groups.

    megatron-core 0.16.1's ``_get_main_param_and_optimizer_states`` indexes a param group by the parameter's
    position among all the group's parameters, but ``_build_model_and_main_param_groups`` rebuilds each group
    as its fp32 parameters first, then the main copies of its bf16/fp16 ones. In a group that mixes both (a
    bf16 model with fp32 loop-conditioning embeddings) it returns *another parameter's* state: the first save
    crashed where the shapes differ, and where they agree the checkpoint held swapped Adam moments under the
    model-space keys, wrong after any reshard. The positions here follow the groups as rebuilt."""
    out: dict[int, tuple[int, int]] = {}
    for g, (fp32, low) in enumerate(zip(opt.model_fp32_groups, opt.model_float16_groups, strict=True)):
        for i, p in enumerate(fp32):
            out[id(p)] = (g, i)
        for j, p in enumerate(low):
            out[id(p)] = (g, len(fp32) + j)
    return out


_ORDERS: weakref.WeakKeyDictionary[Any, dict[int, tuple[int, int]]] = weakref.WeakKeyDictionary()


def owned_states(opt: MegatronOptimizer, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """The main shard ("param") and optimizer states of model parameter ``p`` in a distributed optimizer: what
    megatron's ``_get_main_param_and_optimizer_states`` returns, at the position :func:`_group_order` gives."""
    order = _ORDERS.get(opt)
    if order is None:
        order = _ORDERS[opt] = _group_order(opt)
    g, i = order[id(p)]
    main = opt.optimizer.param_groups[g]["params"][i]
    if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:  # the optimizer keeps the fp32 master copy
        inner = opt.optimizer
        plain = type(inner).__name__ == "HybridDeviceOptimizer"
        tensors = {k: inner.state[main][k] if plain else inner.get_unscaled_state(main, k) for k in inner.state[main]}
        tensors["param"] = tensors.pop("master_param")
        return tensors
    return {"param": main, **opt.optimizer.state[main]}


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


def _states(opt: MegatronOptimizer, entries: list[_Entry]) -> list[str]:
    """Adam moments always; the main parameter only when it is a separate (fp32) copy of a bf16 model."""
    separate_main = any(e.param.dtype != torch.float32 for e in entries)
    return [*ADAM_STATES, "param"] if separate_main else list(ADAM_STATES)


def boxes(shape: tuple[int, ...], start: int, end: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offset, size) of the boxes that tile the flat range [start, end) of a row-major tensor of
    ``shape``, in flat order: a partial first row, the whole rows, a partial last row, recursively
    (at most ``2·ndim − 1`` boxes)."""
    if start >= end:
        return
    if len(shape) <= 1:
        yield ((start,), (end - start,)) if shape else ((), ())
        return
    row = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, row), divmod(end, row)
    if r0 == r1:
        yield from (((r0, *o), (1, *s)) for o, s in boxes(shape[1:], c0, c1))
        return
    if c0:
        yield from (((r0, *o), (1, *s)) for o, s in boxes(shape[1:], c0, row))
        r0 += 1
    if r1 > r0:
        yield (r0, *(0 for _ in shape[1:])), (r1 - r0, *shape[1:])
    if c1:
        yield from (((r1, *o), (1, *s)) for o, s in boxes(shape[1:], 0, c1))


def _parts(sharded: ShardedTensor | ShardedTensorFactory, key: str, replica: Any) -> list[tuple[int, ShardedTensor]]:
    """(flat offset in the local parameter, ShardedTensor without data) of each part the model saves the
    parameter as under ``key``: the parameter itself, or each tensor its factory builds (found on a
    meta tensor: a part must be a contiguous view of the parameter)."""
    if isinstance(sharded, ShardedTensor):
        return [(0, dataclasses.replace(sharded, key=key, data=None, replica_id=replica))]
    probe = torch.empty(sharded.data.shape, device="meta")
    parts = []
    for sub in nested_values(sharded.build_fn(key, probe, replica, None)):
        view = sub.data
        if not (isinstance(sub, ShardedTensor) and view.is_contiguous() and (view is probe or view._base is probe)):
            raise NotImplementedError(f"{sharded.key}: its ShardedTensorFactory does not save contiguous parts")
        parts.append((view.storage_offset(), dataclasses.replace(sub, data=None)))
    return sorted(parts, key=lambda p: p[0])


# id(parameter) -> (a weak reference to it, its memo): an entry goes when its parameter does
_PIECES: dict[int, tuple[weakref.ref[Any], dict[tuple[Any, ...], list[_Piece]]]] = {}


def _memo_of(param: torch.Tensor) -> dict[tuple[Any, ...], list[_Piece]]:
    entry = _PIECES.get(id(param))
    if entry is None or entry[0]() is not param:

        def forget(ref: weakref.ref[Any], key: int = id(param)) -> None:
            if _PIECES.get(key, (None,))[0] is ref:
                del _PIECES[key]

        entry = _PIECES[id(param)] = (weakref.ref(param, forget), {})
    return entry[1]


def _pieces(e: _Entry, state: str, replica: Any) -> list[_Piece]:
    """The boxes of this rank's slice [e.start, e.end) of ``e``'s parameter, for one state. Memoised per
    parameter object (every save of a run asks for the same ones, and a factory's parts are found by
    building it): a factory's parts depend on what its function captured (an expert's index), fixed for
    the parameter it was made for; the entry's metadata is part of the key too."""
    sh = e.sharded
    memo = (type(sh), sh.key, tuple(sh.data.shape), sh.replica_id, repr(getattr(sh, "flattened_range", None)),
            *(getattr(sh, f, None) for f in ("global_shape", "global_offset", "axis_fragmentations", "prepend_axis_num",
                                             "allow_shape_mismatch")),
            e.start, e.end, state, replica)  # fmt: skip
    mine = _memo_of(e.param)
    if (hit := mine.get(memo)) is None:
        hit = mine[memo] = _pieces_of(e, state, replica)
    return hit


def _pieces_of(e: _Entry, state: str, replica: Any) -> list[_Piece]:
    out = []
    for base_start, base in _parts(e.sharded, f"optimizer.{state}.{e.sharded.key}", replica):
        lo, hi = max(e.start, base_start), min(e.end, base_start + math.prod(base.local_shape))
        at = lo
        for offset, shape in boxes(tuple(base.local_shape), lo - base_start, hi - base_start):
            n = math.prod(shape)
            out.append(_Piece(at, at + n, base, offset, shape))
            at += n
    return out


def _replica(opt: MegatronOptimizer, e: _Entry) -> Any:
    """The replica id of this rank's boxes: a distributed optimizer's DP ranks hold disjoint slices, so
    every DP rank's boxes are main replicas (DP coordinate 0); other ranks of a replicated optimizer
    hold copies (the model's own replica id)."""
    rid = e.sharded.replica_id
    if not _is_distributed(opt):
        return rid
    return (*rid[:-1], 0) if isinstance(rid, tuple) else 0


def _sharded(piece: _Piece, data: torch.Tensor) -> ShardedTensor:
    """``data`` (the piece's elements) as the box of its global tensor; prepended axes become explicit
    size-1 axes (megatron's uneven-sharding path takes no ``prepend_axis_num``)."""
    b, n = piece.base, piece.base.prepend_axis_num
    shape = (*(1 for _ in range(n)), *piece.shape)
    offset = (*b.global_offset[:n], *(g + o for g, o in zip(b.global_offset[n:], piece.offset)))
    return ShardedTensor(
        key=b.key,
        data=data.view(shape),
        dtype=data.dtype,
        local_shape=shape,
        global_shape=b.global_shape,
        global_offset=offset,
        axis_fragmentations=None,
        replica_id=b.replica_id,
        allow_shape_mismatch=b.allow_shape_mismatch,
    )


def _walk(optimizer: MegatronOptimizer, model_sharded: ShardedStateDict) -> Iterator[tuple[str, str, _Entry, _Piece]]:
    """(state, local key, entry, piece) for every box of every state this rank owns."""
    by_param = _param_index(model_sharded)
    for o, opt in enumerate(optimizers(optimizer)):
        entries = list(_entries(opt, by_param))
        for state in _states(opt, entries):
            for i, e in enumerate(entries):
                if e.end > e.start:
                    for j, piece in enumerate(_pieces(e, state, _replica(opt, e))):
                        yield state, f"{o}.{i}.{j}", e, piece


def _local(e: _Entry, state: str, piece: _Piece) -> torch.Tensor:
    """The piece's elements in the optimizer's flat slice (a view)."""
    return e.tensors[state].detach().view(-1)[piece.start - e.start : piece.end - e.start]


def sharded_optimizer_state(
    optimizer: MegatronOptimizer, model_sharded: ShardedStateDict
) -> tuple[ShardedStateDict, float]:
    """(``{state: {"<optimizer>.<entry>.<box>": ShardedTensor}}`` to save, Adam's step count).

    The tensors are views of this rank's optimizer state (fp32 copies only if the state is not fp32).
    Collective (a MAX of the step count over all ranks)."""
    out: ShardedStateDict = {}
    for state, name, e, piece in _walk(optimizer, model_sharded):
        out.setdefault(state, {})[name] = _sharded(piece, _local(e, state, piece).float())
    t = torch.tensor([local_adam_step(optimizer)], dtype=torch.float64, device=device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a rank may own no slice of some optimizer
    return out, float(t.item())


def loading_template(optimizer: MegatronOptimizer, model_sharded: ShardedStateDict) -> ShardedStateDict:
    """The same structure as :func:`sharded_optimizer_state` at this rank's layout, with empty tensors to
    load into: only the boxes of the slices this rank owns."""
    out: ShardedStateDict = {}
    for state, name, _, piece in _walk(optimizer, model_sharded):
        empty = torch.empty(piece.end - piece.start, dtype=torch.float32)
        out.setdefault(state, {})[name] = _sharded(piece, empty)
    return out


@torch.no_grad()
def load_optimizer_state(
    optimizer: MegatronOptimizer, model_sharded: ShardedStateDict, loaded: dict[str, Any], step: float
) -> None:
    """Copy the loaded boxes into this rank's optimizer slices (after :func:`ensure_state`)."""
    for state, name, e, piece in _walk(optimizer, model_sharded):
        dst = _local(e, state, piece)
        dst.copy_(loaded[state][name].reshape(-1).to(dst.dtype))
    set_adam_step(optimizer, step)
