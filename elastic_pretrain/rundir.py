"""The run directory: every file a run holds, named once (:class:`RunFiles`, :class:`CheckpointFiles`).

The contract between the trainer, the checkpointer, the sbatch script (``slurm/train.sbatch`` spells the same
names in bash), the CLI and the experiments; no other module builds a path inside a run directory by hand.
This module is at the bottom of the package: it imports nothing from it (tests/test_layering.py).
The layout, file by file, who writes each and why: docs/run-directory.md (the tables at the top).
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
    def train_lock(self) -> Path:
        return self.run_dir / "trainer.lock"

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
