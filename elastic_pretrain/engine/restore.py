"""A model from a committed checkpoint of either engine, in one process: what ``eval``, ``generate``, export,
the experiments and ``convert-checkpoint`` load. Above ``checkpoint/`` (which stores tensors and builds no
model), ``parallel/`` (which builds it) and the DeepSpeed weights reader (engine/weights.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from elastic_pretrain.checkpoint.store import is_deepspeed, read_trainer_state, resolve_checkpoint, verify
from elastic_pretrain.checkpoint.tensors import check_model_fits, load_tensors
from elastic_pretrain.config import build
from elastic_pretrain.engine.weights import load_deepspeed_weights
from elastic_pretrain.job import JobConfig
from elastic_pretrain.parallel.config import ParallelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.rundir import CheckpointFiles

if TYPE_CHECKING:  # annotations only
    from elastic_pretrain.model.looped import LoopedMoEModel


def load_model(ckpt: Path) -> tuple[JobConfig, LoopedMoEModel]:
    """(JobConfig, LoopedMoEModel in eval mode) from a committed checkpoint (a ``step_<N>`` directory, or
    a run directory: its newest committed step), whatever layout saved it; only model tensors are read.

    Needs an initialised one-process mesh (``init_mesh(ParallelConfig(), seed=...)``)."""
    ckpt = resolve_checkpoint(Path(ckpt))
    verify(ckpt)
    meta = read_trainer_state(ckpt)
    job = build(JobConfig, meta["config"])
    check_model_fits(ckpt, job.model, job.decider)  # the config is the checkpoint's: bound it before building
    net = build_model(job.model, ParallelConfig(), decider=job.decider)  # a decider job's decider rides along
    if is_deepspeed(ckpt):  # engine=deepspeed wrote it (weights-only read; engine/weights.py)
        load_deepspeed_weights(net, ckpt)
    else:
        load_tensors(net, None, CheckpointFiles(ckpt).tensors, what="model tensors")
    # the ELR conditioning heads are on exactly in the mixed phase (as in the trainer's session)
    net.set_modes(conditioning=meta.get("controller", {}).get("phase") == "mixed" and net.loop_conditioning is not None)
    return job, net.eval()
