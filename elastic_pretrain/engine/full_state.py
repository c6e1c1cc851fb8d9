"""Model + Adam state per parameter name, whatever engine, ZeRO stage or world size holds it.

:class:`FullState` is the fp32 value, ``exp_avg`` and ``exp_avg_sq`` of every trainable parameter (full shapes,
bare model names) and Adam's step count: what :mod:`elastic_pretrain.engine.convert` carries between engines and
what the DeepSpeed engine reshards through at another world size. Read from DeepSpeed files (its own
``zero_to_fp32`` merge, weights-only) or megatron's optimizer, installed into either; every copy is exact
(fp32 to fp32). docs/engines.md, "Checkpoints" (Resume at another world size or ZeRO stage; Conversion).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elastic_pretrain.checkpoint.store import MODEL_DIR
from elastic_pretrain.engine.weights import deepspeed_weights, import_deepspeed
from elastic_pretrain.errors import UserError

if TYPE_CHECKING:  # annotations only
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from megatron.core.optimizer import MegatronOptimizer

    from elastic_pretrain.model.looped import LoopedMoEModel

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass
class FullState:
    """Per bare parameter name: ``weights`` (fp32 values; also the model's buffers), ``exp_avg``, ``exp_avg_sq``
    (trainable parameters only; full shapes); ``step``: Adam's step count (bias correction)."""

    weights: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int

    def moments(self, key: str) -> dict[str, torch.Tensor]:
        return self.exp_avg if key == "exp_avg" else self.exp_avg_sq


# --- DeepSpeed ---------------------------------------------------------------------------------------


def read_deepspeed(step: Path) -> FullState:
    """The full state of a DeepSpeed-engine ``step_<N>`` (any ZeRO stage, any saved world size); weights-only."""
    weights = deepspeed_weights(step)
    try:
        moments, adam_step = _deepspeed_moments(step / MODEL_DIR)
    except UserError:
        raise
    except Exception as err:
        text = str(err).strip().splitlines()
        raise UserError(
            f"{step / MODEL_DIR}: cannot read the DeepSpeed optimizer state ({type(err).__name__}: "
            f"{text[0] if text else ''}); use another checkpoint"
        ) from err
    return FullState(weights=weights, exp_avg=moments["exp_avg"], exp_avg_sq=moments["exp_avg_sq"], step=adam_step)


def _deepspeed_moments(folder: Path) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """({moment: {name: full tensor}}, step) from every rank's ``*_optim_states.pt``.

    ZeRO 1/2 save each rank's slice of each flat parameter group (``single_partition_of_fp32_groups``, without
    the padding) and the torch optimizer's state of that slice (with the padding, which is at the end of the
    last rank's slice: trimmed to the fp32 slice); ZeRO-3 saves a flat group per rank whose optimizer state has
    the same layout. Either way the moments are laid out as the fp32 master weights, so DeepSpeed's merge of
    those (zero_to_fp32) applied to the moments yields them per parameter."""
    from elastic_pretrain.engine.safe_load import weights_only_loads

    import_deepspeed()
    from deepspeed.utils import zero_to_fp32 as z

    with weights_only_loads(), contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints progress
        model_states = z.parse_model_states(z.get_model_state_files(str(folder)))
        files = z.get_optim_files(str(folder))
        osds = [torch.load(f, map_location="cpu", weights_only=True)["optimizer_state_dict"] for f in files]
        stage, world = int(osds[0]["zero_stage"]), osds[0]["partition_count"]
        world = max(world) if isinstance(world, list) else int(world)
        if world != len(osds):
            raise UserError(f"{folder}: {len(osds)} optimizer files for world size {world}: use another checkpoint")
        out: dict[str, dict[str, torch.Tensor]] = {}
        if stage <= 2:
            fp32 = [o["single_partition_of_fp32_groups"] for o in osds]
            states = [o["base_optimizer_state"]["state"] for o in osds]
            adam_step = _step(states[0])
            paddings = osds[0].get("param_alignment_paddings")
            for key in MOMENTS:
                flat = [
                    [s[g][key][: f[g].numel()] if s else torch.zeros_like(f[g]) for g in range(len(f))]
                    for s, f in zip(states, fp32)
                ]
                merged: dict[str, Any] = {}
                z._zero2_merge_trainable_params(merged, world, flat, model_states, paddings)
                out[key] = _bare(merged)
        else:
            fp32 = [o["fp32_flat_groups"] for o in osds]
            states = [o["optimizer_state_dict"]["state"] for o in osds]
            adam_step = _step(states[0])
            for key in MOMENTS:
                flat = [
                    [s[g][key] if s else torch.zeros_like(f[g]) for g in range(len(f))] for s, f in zip(states, fp32)
                ]
                merged = {}
                z._zero3_merge_trainable_params(merged, world, flat, model_states)
                out[key] = _bare(z.to_torch_tensor(merged))
    return out, adam_step


def _step(state: dict[int, dict[str, Any]]) -> int:
    return int(float(state[0]["step"])) if state else 0


def _bare(merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # engine/deepspeed.py wraps the model (LoopedForDeepSpeed): its names start with "module."
    return {k.removeprefix("module."): v.contiguous().clone() for k, v in merged.items()}


@torch.no_grad()
def install_deepspeed(engine: DeepSpeedEngine, state: FullState) -> None:
    """Make ``engine`` (``deepspeed.initialize`` of engine/deepspeed.py's wrapper, any ZeRO stage and world size)
    hold ``state``: model weights, fp32 master weights, Adam moments and step count. Every rank calls it."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    net = engine.module.module
    params = dict(net.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    _check_names(state, trainable)
    zero3 = any(hasattr(p, "ds_id") for p in params.values())
    gather = deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0) if zero3 else None
    with gather or contextlib.nullcontext():
        for n, p in params.items():
            p.copy_(state.weights[n].to(p.dtype))
    for n, b in net.named_buffers():
        if n in state.weights:
            b.copy_(state.weights[n].to(b.dtype))
    opt = engine.optimizer
    _create_adam_state(opt, state.step, zero3)
    for n, p in trainable.items():
        safe_set_full_fp32_param(p, state.weights[n].float())
        for key in MOMENTS:
            safe_set_full_optimizer_state(p, state.moments(key)[n].float(), key)
    engine.global_steps = state.step
    engine.global_samples = state.step * engine.train_batch_size()


def _create_adam_state(opt: ZeROOptimizer, step: int, zero3: bool) -> None:
    """torch AdamW's state (``step``, zero moments) on each of this rank's flat fp32 partitions, linked to the
    parameters' fragments, so that ``safe_set_full_optimizer_state`` can write it (torch creates it lazily, at
    the first step, which the state must not wait for)."""
    flats = opt.fp32_partitioned_groups_flat if zero3 else opt.single_partition_of_fp32_groups
    for flat in flats:
        opt.optimizer.state[flat] = {
            "step": torch.tensor(float(step)),
            "exp_avg": torch.zeros_like(flat),
            "exp_avg_sq": torch.zeros_like(flat),
        }
    if not zero3:  # ZeRO 1/2 link each parameter's optimizer-state fragment once the state exists
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _check_names(state: FullState, trainable: dict[str, torch.Tensor]) -> None:
    for what, have in (("weights", state.weights), ("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq)):
        missing = sorted(set(trainable) - set(have))
        wrong = [n for n, p in trainable.items() if n in have and have[n].numel() != getattr(p, "ds_numel", p.numel())]
        if missing or wrong:
            raise UserError(
                f"the checkpoint's {what} do not fit the model (missing {missing[:3]}, wrong shape {wrong[:3]}): "
                "use a checkpoint of this model"
            )


# --- megatron ----------------------------------------------------------------------------------------


def _megatron_entries(net: LoopedMoEModel, optimizer: MegatronOptimizer) -> list[tuple[str, Any]]:
    """(parameter name, checkpoint/optim_state.py entry) of every parameter megatron's optimizer updates."""
    from elastic_pretrain.checkpoint import optim_state

    names = {id(p): n for n, p in net.named_parameters()}
    by_param = optim_state._param_index(net.sharded_state_dict())
    out = []
    for opt in optim_state.optimizers(optimizer):
        for e in optim_state._entries(opt, by_param):
            if e.end - e.start != e.param.numel():
                raise ValueError("full_state reads megatron's optimizer on one rank only")
            out.append((names[id(e.param)], e))
    return out


@torch.no_grad()
def read_megatron(net: LoopedMoEModel, optimizer: MegatronOptimizer) -> FullState:
    """The full state of megatron-core's optimizer over ``net`` on a one-rank mesh (after ``load_tensors``)."""
    from elastic_pretrain.checkpoint import optim_state

    weights = {
        n: t.detach().float().clone()
        for n, t in net.state_dict().items()
        if isinstance(t, torch.Tensor) and not n.endswith("_extra_state")
    }
    moments: dict[str, dict[str, torch.Tensor]] = {k: {} for k in MOMENTS}
    for name, e in _megatron_entries(net, optimizer):
        shape = e.param.shape
        weights[name] = (
            e.tensors["param"].detach().float().view(shape).clone()
            if "param" in e.tensors
            else e.param.detach().float().clone()
        )
        for key in MOMENTS:
            moments[key][name] = (
                e.tensors[key].view(shape).clone() if key in e.tensors else torch.zeros(shape, dtype=torch.float32)
            )
    return FullState(
        weights=weights,
        exp_avg=moments["exp_avg"],
        exp_avg_sq=moments["exp_avg_sq"],
        step=int(optim_state.local_adam_step(optimizer)),
    )


@torch.no_grad()
def install_megatron(net: LoopedMoEModel, optimizer: MegatronOptimizer, state: FullState) -> None:
    """Make megatron-core's optimizer over ``net`` (one-rank mesh) and ``net`` itself hold ``state``."""
    from elastic_pretrain.checkpoint import optim_state

    optim_state.ensure_state(optimizer)
    missing, unexpected = net.load_state_dict(state.weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise UserError(
            f"the checkpoint's weights do not fit the model (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}): use a checkpoint of this model"
        )
    for name, e in _megatron_entries(net, optimizer):
        if name not in state.exp_avg:
            raise UserError(f"the checkpoint has no optimizer state for {name}: use a checkpoint of this model")
        e.tensors["param"].view(-1).copy_(state.weights[name].reshape(-1))
        for key in MOMENTS:
            e.tensors[key].view(-1).copy_(state.moments(key)[name].reshape(-1))
    optim_state.set_adam_step(optimizer, float(state.step))
