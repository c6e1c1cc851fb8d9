"""A checkpoint of one engine as the other's: DeepSpeed-engine <-> megatron-engine (both directions).

``elastic-pretrain convert-checkpoint <step_N> --out <dir>`` writes a committed checkpoint of the other engine:
weights, by default the Adam state (engine/full_state.py), ``trainer.json`` with ``engine`` switched and the RNG
files, so the result *resumes* as its source would have continued; ``--weights-only`` starts Adam afresh. It runs
in one process; either side reshards on resume. Reading a DeepSpeed checkpoint is weights-only.
docs/engines.md, "Checkpoints" (Conversion).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_pretrain.checkpoint.store import (
    MODEL_DIR,
    RNG_DIR,
    TRAINER_FILE,
    CheckpointStore,
    is_deepspeed,
    read_trainer_state,
    verify,
)
from elastic_pretrain.engine.full_state import (
    FullState,
    install_deepspeed,
    install_megatron,
    read_deepspeed,
    read_megatron,
)
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import copy_file, is_plain_name, write_atomic
from elastic_pretrain.rundir import CheckpointFiles

if TYPE_CHECKING:  # annotations only: convert-checkpoint imports what it runs when it runs
    from megatron.core.optimizer import MegatronOptimizer

    from elastic_pretrain.job import JobConfig
    from elastic_pretrain.model.looped import LoopedMoEModel


def convert(step: Path, out_run: Path, *, zero_stage: int = 2, optimizer: bool = True) -> Path:
    """Write ``step`` (either engine) as the other engine's committed checkpoint under ``out_run``; its path.
    ``optimizer``: carry the Adam state over (else the result's optimizer starts fresh)."""
    from elastic_pretrain.config import build
    from elastic_pretrain.engine.restore import load_model
    from elastic_pretrain.job import JobConfig

    marker = verify(step)
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
    state = _read_state(step, source, _job, net, float(meta.get("adam_step", 0.0))) if optimizer else None
    save = _save_megatron if target == "megatron" else _save_deepspeed
    adam_step = save(job, net, tmp, state)
    copy_rng(step, tmp, marker)
    converted = {
        **meta,
        "config": config,
        "adam_step": adam_step,
        "layout": {**meta.get("layout", {}), "world_size": 1, "tp": 1, "ep": 1, "pp": 1, "dp": 1},
        "converted_from": {
            "engine": source,
            "path": str(step),
            "optimizer": "converted" if optimizer else "not converted",
        },
    }
    write_atomic(tmp / TRAINER_FILE, json.dumps(converted, indent=1), root=tmp)
    return store.commit(n, {}, rank=0)


def copy_rng(step: Path, tmp: Path, marker: dict[str, Any]) -> list[str]:
    """Copy the RNG files (plain tensors, loaded weights_only; used only at the same layout) that the source's
    ``COMMITTED`` lists, each a regular file: anything else in ``rng/`` is not part of the checkpoint, and a
    link (``rng/rank_00009.pt -> ~/secret``) would copy what it points at into a checkpoint the user shares
    (issue 35). Returns the names copied."""
    copied = []
    for rel in sorted(marker["files"]):
        parts = Path(rel).parts
        if len(parts) == 2 and parts[0] == RNG_DIR and is_plain_name(parts[1]):
            copy_file(step / rel, tmp / rel, root=tmp)  # a link is refused, not followed
            copied.append(rel)
    return copied


def _read_state(step: Path, source: str, job: JobConfig, net: LoopedMoEModel, adam_step: float) -> FullState:
    """The source checkpoint's weights and Adam state per parameter."""
    if source == "deepspeed":
        return read_deepspeed(step)
    from elastic_pretrain.checkpoint.tensors import load_tensors

    optimizer = _megatron_optimizer(job, net)
    load_tensors(net, optimizer, CheckpointFiles(step).tensors, adam_step=adam_step)
    return read_megatron(net, optimizer)


def _megatron_optimizer(job: JobConfig, net: LoopedMoEModel) -> MegatronOptimizer:
    """megatron-core's DDP + optimizer over ``net`` on the one-rank mesh, as train/session.py builds them."""
    from elastic_pretrain.train.session import build_optimizer, wrap_ddp

    net.train()
    return build_optimizer(job, wrap_ddp(job, net))[0]


def _save_megatron(job: JobConfig, net: LoopedMoEModel, tmp: Path, state: FullState | None) -> float:
    """``net`` (and ``state``) as a one-rank megatron checkpoint in ``tmp/model_optim``; Adam's step count."""
    from megatron.core import dist_checkpointing

    from elastic_pretrain.checkpoint import parallel_io
    from elastic_pretrain.checkpoint.tensors import save_tensors

    if state is None:
        dist_checkpointing.save({"model": net.sharded_state_dict()}, str(tmp / MODEL_DIR))
        return 0.0
    optimizer = _megatron_optimizer(job, net)
    install_megatron(net, optimizer, state)
    _, adam_step = save_tensors(net, optimizer, tmp / MODEL_DIR, parallel_io.save_strategy())
    return adam_step


def _save_deepspeed(job: JobConfig, net: LoopedMoEModel, tmp: Path, state: FullState | None) -> float:
    """``net`` (and ``state``; else a fresh optimizer) as a one-rank DeepSpeed checkpoint in ``tmp/model_optim``;
    Adam's step count."""
    import os

    from elastic_pretrain.engine.config import ds_config
    from elastic_pretrain.engine.deepspeed import param_groups
    from elastic_pretrain.engine.weights import import_deepspeed

    deepspeed = import_deepspeed()
    os.environ.setdefault("LOCAL_RANK", "0")
    from elastic_pretrain.engine.deepspeed import LoopedForDeepSpeed

    net.train()
    engine, *_ = deepspeed.initialize(
        model=LoopedForDeepSpeed(net),
        model_parameters=param_groups(net),
        config=ds_config(job, 1, n_params=sum(p.numel() for p in net.parameters())),
    )
    if state is not None:
        install_deepspeed(engine, state)
    engine.save_checkpoint(str(tmp), tag=MODEL_DIR, save_latest=False)
    return float(engine.global_steps)
