"""The run directory: every file a run holds, named once. The contract between the trainer, the
checkpointer, the sbatch script (``slurm/train.sbatch`` spells the same names in bash), the CLI and the
experiments; no other module builds a path inside a run directory by hand.

This module is at the bottom of the package: it imports nothing from it (tests/test_layering.py).

``<run_dir>/`` (``runs/<name>`` unless ``run_dir`` is set)::

    config.yaml               the resolved job, secrets redacted (job.write_resolved; rank 0 at start)
    history.jsonl             one JSON line per trained step, appended (train/trainer.py SummaryWriter)
    summary.json              final validation loss per ℓ, counters, layout, the history (at the end/stop)
    FINISHED                  JSON {step, tokens}: training completed; a run with it is never requeued
    STOPPED                   JSON {step, tokens, reason}: this start stopped on a stop signal after saving
                              (removed at the next start); the batch script requeues even when the signal
                              reached the trainer but not the script
    mlflow_run_id             text: the MLflow run id, written when tracking closes (optional)
    mlflow/                   the local MLflow store and the tracker's files (tracking/: mlflow.db,
                              run.json, artifacts/, staging/, quality_budget/); artifact locations in
                              mlflow.db are relative to this folder (tracking/store.py)
    eval/step_<N>/            ``elastic-pretrain eval`` reports of checkpoint step_<N> (eval.md, quality.png,
                              adaptive.png): beside the checkpoints, which rotation deletes, not in them
    hang/rank_<R>.txt         stack dump of every thread when rank R's step hung (train/watchdog.py)
    profile/rank_<R>.json     torch profiler trace of rank R's profiled window (train/profiling.py)
    checkpoints/
        .tmp-step_<N>/        a save being written (every rank writes its part here)
        .trash-step_<N>/      a checkpoint being deleted (renamed first: never half a committed one)
        step_<N>/             a committed checkpoint (:class:`CheckpointFiles`)
        latest                text ``step_<N>``, replaced atomically after step_<N> is committed
        index.json            the committed checkpoints (``elastic-pretrain checkpoints --json``), at the end
    slurm/                    written by ``elastic-pretrain submit`` / ``cancel`` and the batch script
        train.sbatch          the rendered script that was submitted
        job.yaml              the resolved job as submitted (presets, overrides): what every (re)start trains
        train-<id>.log        stdout+stderr of Slurm job <id>, every (re)start appended (a requeue keeps the id)
        job_id                the Slurm job id of the latest submission
        CANCELLED             marker: ``cancel`` was run, the batch script must not requeue

``step_<N>/``::

    model_optim/              model + optimizer tensors, megatron-core dist_checkpointing (torch_dist)
    trainer.json              the named stateful objects' states, Adam's step, config, layout
    rng/rank_<R>.pt           RNG states of rank R (plain tensors; loaded with weights_only=True)
    COMMITTED                 JSON: step, size and CRC32 of every file above; written last
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
COMMIT_FILE = "COMMITTED"
TRAINER_FILE = "trainer.json"
MODEL_DIR = "model_optim"
RNG_DIR = "rng"
STEP_DIR = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    return f"step_{step}"


@dataclasses.dataclass(frozen=True)
class CheckpointFiles:
    """Paths inside one checkpoint directory ``step_<N>`` (or the ``.tmp-step_<N>`` it is written in)."""

    path: Path

    @property
    def trainer(self) -> Path:
        return self.path / TRAINER_FILE

    @property
    def tensors(self) -> Path:
        return self.path / MODEL_DIR

    @property
    def rng_dir(self) -> Path:
        return self.path / RNG_DIR

    def rng(self, rank: int) -> Path:
        return self.rng_dir / f"rank_{rank:05d}.pt"

    @property
    def committed(self) -> Path:
        return self.path / COMMIT_FILE

    @property
    def step(self) -> int | None:
        """N of ``step_<N>``; None for another name."""
        m = STEP_DIR.match(self.path.name)
        return int(m.group(1)) if m else None

    @property
    def run_dir(self) -> Path | None:
        """The folder holding the ``checkpoints/`` this checkpoint is in; None for a step folder elsewhere (a
        bare copy). Whether that folder is a run directory is for the caller to check (``config.yaml``)."""
        return self.path.parent.parent if self.path.parent.name == CHECKPOINTS_DIR else None


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """Paths inside one run directory (see the module docstring for who writes what)."""

    run_dir: Path

    # --- the trainer's files -------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def history(self) -> Path:
        return self.run_dir / "history.jsonl"

    @property
    def summary(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def finished(self) -> Path:
        return self.run_dir / "FINISHED"

    @property
    def stopped(self) -> Path:
        return self.run_dir / "STOPPED"

    @property
    def mlflow_run_id(self) -> Path:
        return self.run_dir / "mlflow_run_id"

    @property
    def mlflow(self) -> Path:
        return self.run_dir / "mlflow"

    @property
    def hang_dir(self) -> Path:
        return self.run_dir / "hang"

    def hang_dump(self, rank: int) -> Path:
        return self.hang_dir / f"rank_{rank}.txt"

    @property
    def profile_dir(self) -> Path:
        return self.run_dir / "profile"

    def profile_trace(self, rank: int) -> Path:
        return self.profile_dir / f"rank_{rank}.json"

    def eval_dir(self, checkpoint: str) -> Path:
        """``elastic-pretrain eval``'s report of the checkpoint folder named ``checkpoint`` (``step_<N>``): outside
        ``checkpoints/``, since rotation deletes checkpoints, not their evaluations."""
        return self.run_dir / "eval" / checkpoint

    # --- checkpoints -------------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR

    @property
    def latest(self) -> Path:
        return self.checkpoints / LATEST_FILE

    @property
    def checkpoint_index(self) -> Path:
        return self.checkpoints / "index.json"

    def step_dir(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    # --- Slurm ---------------------------------------------------------------------------------------------
    @property
    def slurm_dir(self) -> Path:
        return self.run_dir / "slurm"

    @property
    def script(self) -> Path:
        return self.slurm_dir / "train.sbatch"

    @property
    def job_snapshot(self) -> Path:
        return self.slurm_dir / "job.yaml"

    def job_log(self, job_id: str) -> Path:
        """The log of Slurm job ``job_id`` (``--output`` ``train-%j.log``)."""
        return self.slurm_dir / f"train-{job_id}.log"

    @property
    def job_id(self) -> Path:
        return self.slurm_dir / "job_id"

    @property
    def cancelled(self) -> Path:
        return self.slurm_dir / "CANCELLED"
