"""Model and optimizer tensors of a checkpoint (``step_<N>/model_optim/``): the one place that saves and
loads them.

Saved through megatron-core ``dist_checkpointing`` with layout-independent keys, so a checkpoint loads at
another TP/EP/DP layout, and into one process (eval, generate, export, experiments). Every load goes
through :func:`load_tensors`: resume (model + Adam state), a decider job's base model (model minus the
decider) and ``engine/restore.py:load_model`` (model only) differ in what they ask for, not in how it is
read. Storage only: building the model to load into is the caller's (engine/restore.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import dist_checkpointing

from elastic_pretrain.checkpoint import optim_state, parallel_io
from elastic_pretrain.checkpoint.safe_load import load_sharded
from elastic_pretrain.checkpoint.snapshot import SaveStrategies
from elastic_pretrain.errors import UserError
from elastic_pretrain.parallel.overlap import settle_param_gather
from elastic_pretrain.rundir import CheckpointFiles

if TYPE_CHECKING:  # annotations only: checkpoint/ stores tensors and builds no model
    from megatron.core.optimizer import MegatronOptimizer

    from elastic_pretrain.model.config import DeciderConfig, ModelConfig
    from elastic_pretrain.model.looped import LoopedMoEModel


def save_tensors(
    net: LoopedMoEModel, optimizer: MegatronOptimizer, path: Path, strategy: Any, use_async: bool = False
) -> tuple[Any, float]:
    """Model + Adam state (model space) to ``path`` through dist_checkpointing; returns (the async request,
    or None when synchronous; Adam's step count). Collective.

    ``strategy``: a megatron save strategy, or the trainer's :class:`SaveStrategies` (which skips the
    sharding validation and reuses the save plan while the state dict's structure is unchanged)."""
    settle_param_gather(optimizer)  # parallel.param_gather=overlap: the step's all-gathers may be in flight
    model_sd = net.sharded_state_dict()
    optim_sd, adam_step = optim_state.sharded_optimizer_state(optimizer, model_sd)
    state = {"model": model_sd, "optimizer": optim_sd}
    validate = True
    if isinstance(strategy, SaveStrategies):
        strategy, validate = strategy.for_state(state)
    request = dist_checkpointing.save(
        state, str(path), sharded_strategy=strategy, async_sharded_save=use_async, validate_access_integrity=validate
    )
    return request, adam_step


def load_tensors(
    net: LoopedMoEModel,
    optimizer: MegatronOptimizer | None,
    path: Path,
    *,
    adam_step: float = 0.0,
    exclude: str | None = None,
    what: str = "model/optimizer tensors",
) -> None:
    """Load ``path`` into ``net`` at this process's layout (reshards over TP/EP/DP). Collective.

    ``optimizer``: also its Adam state (with ``adam_step``); None reads model tensors only. ``exclude``: a
    parameter-name prefix that keeps its initialisation (a decider job's ``decider.``); every other
    parameter must be in the checkpoint. Reads are spread over the data-parallel group (parallel_io)."""
    settle_param_gather(optimizer)  # an all-gather in flight would overwrite the loaded parameters
    model_sd = net.sharded_state_dict()
    if exclude:
        model_sd = {k: v for k, v in model_sd.items() if not k.startswith(exclude)}
    request: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        optim_state.ensure_state(optimizer)
        request["optimizer"] = optim_state.loading_template(optimizer, model_sd)
    loaded = load_sharded(request, path, what=what, strategy=parallel_io.load_strategy())
    with torch.no_grad():
        missing, unexpected = net.load_state_dict(loaded["model"], strict=not exclude)
        left = [k for k in missing if not (exclude and k.startswith(exclude))] + list(unexpected)
        if left:
            raise UserError(f"{path}: {what} do not match the model ({left[0]} ...)")
        if optimizer is not None:
            # a fresh sharded view: megatron's load rewrites the one it was given in place
            fresh = net.sharded_state_dict()
            optim_state.load_optimizer_state(optimizer, fresh, loaded["optimizer"], adam_step)


@dataclasses.dataclass
class ModelTensors:
    """The model and its optimizer as one checkpointed object: sharded tensors under ``model_optim/``, and
    (:meth:`save` returns it, :meth:`load` takes it) the small state beside them in ``trainer.json``."""

    net: LoopedMoEModel
    optimizer: MegatronOptimizer

    def save(self, path: Path, strategy: Any, use_async: bool) -> tuple[Any, dict[str, Any]]:
        request, adam_step = save_tensors(self.net, self.optimizer, path, strategy, use_async)
        return request, {"adam_step": adam_step}

    def load(self, path: Path, state: dict[str, Any]) -> None:
        load_tensors(self.net, self.optimizer, path, adam_step=float(state["adam_step"]))


def check_model_fits(ckpt: Path, model: ModelConfig, decider: DeciderConfig | None = None) -> None:
    """Refuse, in one line and before anything is allocated, a model config that builds more parameters than
    ``ckpt``'s tensor files hold. eval, generate, export, convert and a decider job build the model from the
    config saved in the checkpoint's ``trainer.json``: one asking for a 17 GB model was allocated, and only
    then found that no tensor fits (issue 35). The sizes compared are the metadata's (bounded by the data
    files: ``safe_load.declared_tensors``) or, for a DeepSpeed checkpoint, the files' own."""
    from elastic_pretrain.checkpoint.safe_load import declared_tensors
    from elastic_pretrain.checkpoint.store import is_deepspeed
    from elastic_pretrain.model.params import count_parameters, decider_parameters, format_count

    need = count_parameters(model).total + (decider_parameters(decider, model) if decider is not None else 0)
    files = CheckpointFiles(ckpt)
    if is_deepspeed(ckpt):  # no metadata: at least 2 bytes (bf16) per parameter are in the files
        held = sum(p.stat().st_size for p in files.tensors.iterdir() if p.is_file()) // 2
    else:
        held = sum(n for key, n in declared_tensors(files.tensors).items() if not key.startswith("optimizer."))
    if need > held:
        raise UserError(
            f"{files.trainer}: its model config (hidden_size={model.hidden_size}, {model.num_experts} experts, "
            f"{model.core_layers} core layers...) builds {format_count(need)} parameters, but the checkpoint's "
            f"tensors hold {format_count(held)}: the config does not describe these tensors; it was not written "
            "by elastic-pretrain: use another checkpoint"
        )
