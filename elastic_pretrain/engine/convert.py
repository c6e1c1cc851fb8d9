"""Model weights between a DeepSpeed-engine checkpoint and a megatron-engine one (both directions).

``elastic-pretrain checkpoints convert <step_N> --out <dir>`` reads a committed checkpoint of either engine and
writes a committed ``<dir>/checkpoints/step_<N>`` of the other one: the model weights (fp32 master values on
the DeepSpeed side, all ZeRO stages), ``trainer.json`` with ``engine`` switched, and the commit marker and
``latest``. The optimizer state is not carried over (Adam moments start at zero; docs/engines.md): the result
evaluates and generates like its source (``eval``, ``generate``; the test checks the loss per ℓ) and can seed
a new run (``checkpoint.resume_from``) on the other engine. Reading a DeepSpeed checkpoint is weights-only
(engine/safe_load.py). Runs in one process (a one-rank mesh).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from elastic_pretrain.checkpoint.store import MODEL_DIR, TRAINER_FILE, CheckpointStore, read_trainer_state, verify
from elastic_pretrain.errors import UserError


def is_deepspeed(step: Path) -> bool:
    """A step directory written by ``engine: deepspeed`` (DeepSpeed's model-states files)."""
    return any((step / MODEL_DIR).glob("*_model_states.pt"))


def deepspeed_weights(step: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of a DeepSpeed-engine ``step_<N>`` (ZeRO 1/2/3), weights-only."""
    from elastic_pretrain.engine.deepspeed import import_deepspeed
    from elastic_pretrain.engine.safe_load import weights_only_loads

    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with weights_only_loads():
            state = get_fp32_state_dict_from_zero_checkpoint(str(step), tag=MODEL_DIR)
    except Exception as err:
        raise UserError(
            f"{step / MODEL_DIR}: cannot read the DeepSpeed model weights ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); use another checkpoint"
        ) from err
    # engine/deepspeed.py wraps the model (LoopedForDeepSpeed): its names start with "module."
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_deepspeed_weights(net: torch.nn.Module, step: Path) -> None:
    """``net`` (the bare looped model, one rank) from a DeepSpeed-engine checkpoint's weights."""
    state = deepspeed_weights(step)
    missing, unexpected = net.load_state_dict(state, strict=False)
    # megatron's modules list an ``_extra_state`` entry per layer (None on the local spec); DeepSpeed keeps only
    # parameters and buffers
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise UserError(
            f"{step}: the DeepSpeed weights do not fit the model of its trainer.json (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}): use another checkpoint"
        )


def convert(step: Path, out_run: Path, *, zero_stage: int = 2) -> Path:
    """Write ``step`` (either engine) as the other engine's committed checkpoint under ``out_run``; its path."""
    from elastic_pretrain.config import build
    from elastic_pretrain.eval.commands import load_model
    from elastic_pretrain.job import JobConfig

    verify(step)
    meta = read_trainer_state(step)
    source = "deepspeed" if is_deepspeed(step) else "megatron"
    target = "megatron" if source == "deepspeed" else "deepspeed"
    _job, net = load_model(step)
    config = dict(meta["config"])
    config["engine"] = target
    config["parallel"] = {**config.get("parallel", {}), "tensor": 1, "pipeline": 1, "expert": 1}
    if target == "deepspeed":
        config["deepspeed"] = {**config.get("deepspeed", {}), "zero_stage": zero_stage}
    job = build(JobConfig, config)  # the converted config must itself be a valid job
    n = int(meta["trainer"]["step"])
    store = CheckpointStore(out_run / "checkpoints")
    if store.step_dir(n).exists():
        raise UserError(f"{store.step_dir(n)} exists: choose another --out")
    tmp = store.prepare(n)
    if target == "megatron":
        from megatron.core import dist_checkpointing

        dist_checkpointing.save({"model": net.sharded_state_dict()}, str(tmp / MODEL_DIR))
    else:
        _save_deepspeed(job, net, tmp)
    converted = {**meta, "config": config, "layout": {"world_size": 1, "tp": 1, "ep": 1, "pp": 1, "dp": 1},
                 "converted_from": {"engine": source, "path": str(step), "optimizer": "not converted"}}
    (tmp / TRAINER_FILE).write_text(json.dumps(converted, indent=1))
    return store.commit(n, {}, rank=0)


def _save_deepspeed(job: Any, net: torch.nn.Module, tmp: Path) -> None:
    """``net`` as a one-rank DeepSpeed checkpoint in ``tmp/model_optim`` (fresh optimizer state)."""
    import os

    from elastic_pretrain.engine.config import ds_config
    from elastic_pretrain.engine.deepspeed import import_deepspeed, param_groups

    deepspeed = import_deepspeed()
    os.environ.setdefault("LOCAL_RANK", "0")
    from elastic_pretrain.engine.deepspeed import LoopedForDeepSpeed

    net.train()
    engine, *_ = deepspeed.initialize(model=LoopedForDeepSpeed(net), model_parameters=param_groups(net),
                                      config=ds_config(job, 1, n_params=sum(p.numel() for p in net.parameters())))
    engine.save_checkpoint(str(tmp), tag=MODEL_DIR, save_latest=False)
