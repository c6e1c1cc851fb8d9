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
from elastic_pretrain.engine.weights import is_deepspeed
from elastic_pretrain.errors import UserError


def convert(step: Path, out_run: Path, *, zero_stage: int = 2) -> Path:
    """Write ``step`` (either engine) as the other engine's committed checkpoint under ``out_run``; its path."""
    from elastic_pretrain.checkpoint.tensors import load_model
    from elastic_pretrain.config import build
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
    from elastic_pretrain.engine.deepspeed import param_groups
    from elastic_pretrain.engine.weights import import_deepspeed

    deepspeed = import_deepspeed()
    os.environ.setdefault("LOCAL_RANK", "0")
    from elastic_pretrain.engine.deepspeed import LoopedForDeepSpeed

    net.train()
    engine, *_ = deepspeed.initialize(model=LoopedForDeepSpeed(net), model_parameters=param_groups(net),
                                      config=ds_config(job, 1, n_params=sum(p.numel() for p in net.parameters())))
    engine.save_checkpoint(str(tmp), tag=MODEL_DIR, save_latest=False)
