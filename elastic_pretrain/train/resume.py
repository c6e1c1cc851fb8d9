"""What a run directory's newest checkpoint means for ``train`` before anything is built (issue 33).

Measured against the job's ``train.steps``, the newest committed checkpoint says: fewer steps, resume; exactly
``train.steps`` with ``FINISHED``, nothing to train (one line, exit 0); more, refused; a changed model shape,
refused. Raising ``train.steps`` trains further *at the end of the run's first schedule* (the checkpoint holds
it). Reads only the file system and small JSON files: the launching process stays light (no torch).
docs/run-directory.md, "Training further, and a new run".
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from elastic_pretrain.checkpoint.store import CheckpointStore, read_trainer_state, resume_source
from elastic_pretrain.errors import UserError
from elastic_pretrain.job import JobConfig, public_dict, shape_refusal
from elastic_pretrain.rundir import CheckpointFiles, RunFiles

_NEW_RUN = "for a new run give another name (name=NEW) or --run-dir runs/NEW"


def _where(job: JobConfig, source: Path, step: int) -> str:
    if CheckpointFiles(source).run_dir == job.run_path:
        return f"{job.run_path} has trained {step} steps"
    return f"--resume-from {source} is at step {step}"


def past_steps_message(job: JobConfig, source: Path, step: int) -> str:
    """The checkpoint is at ``step`` > ``train.steps``."""
    return (
        f"{_where(job, source, step)}, more than train.steps={job.train.steps}: to train it further raise "
        f"train.steps above {step}; {_NEW_RUN}"
    )


def finished_message(job: JobConfig, source: Path, step: int) -> str:
    """The checkpoint is at ``train.steps``: the run is finished."""
    return (
        f"{_where(job, source, step)} = train.steps: finished, nothing to train. To train it further raise "
        f"train.steps (e.g. train.steps={step + max(1, step // 3)}); {_NEW_RUN}"
    )


def check_steps_left(source: Path | None, meta: dict[str, Any], job: JobConfig) -> None:
    """In each rank, from the verified checkpoint's ``trainer.json``: refuse one past ``train.steps``."""
    step = int(meta.get("trainer", {}).get("step", 0)) if source else 0
    if source is not None and step > job.train.steps:
        raise UserError(past_steps_message(job, source, step))


def check_before_launch(job: JobConfig) -> str | None:
    """Before any rank starts: the line to print when the run is finished (nothing to train), else None.
    Raises the one-line refusal for a checkpoint past ``train.steps`` or a changed model shape."""
    source = resume_source(job.checkpoint, CheckpointStore(RunFiles(job.run_path).checkpoints))
    step = CheckpointFiles(source).step if source is not None else None
    if source is None or step is None:  # a fresh run, or a --resume-from folder not named step_<N>: the ranks check it
        return None
    try:
        saved = read_trainer_state(source).get("config", {})
    except UserError:
        saved = None  # unreadable: the ranks verify the checkpoint and say what is wrong with it
    refusal = shape_refusal(source, saved, job) if isinstance(saved, dict) else None
    if refusal:
        raise UserError(refusal)
    if step > job.train.steps:
        raise UserError(past_steps_message(job, source, step))
    finished = RunFiles(job.run_path).finished.exists() and CheckpointFiles(source).run_dir == job.run_path
    # at train.steps without FINISHED (a crash after the last save): the ranks validate and write it
    return finished_message(job, source, step) if step == job.train.steps and finished else None


def resumable(ckpt: Path, job: JobConfig) -> dict[str, Any]:
    """``checkpoint/manager.py:check_resumable`` for ``job`` (its public config, its model-shape rule): ``ckpt``
    verified and its ``trainer.json``, or one line refusing it. Collective: the ranks call it, not the launcher."""
    from elastic_pretrain.checkpoint.manager import check_resumable  # torch: imported on the ranks only

    return check_resumable(ckpt, public_dict(job), functools.partial(shape_refusal, job=job))
