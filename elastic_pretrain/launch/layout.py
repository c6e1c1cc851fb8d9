"""The files a run directory holds: the contract between the trainer, the sbatch script and the CLI.

Written by the trainer (rank 0):
    checkpoints/step_<N>/     a committed checkpoint (written elsewhere, then renamed into place)
    checkpoints/latest        text file ``step_<N>``, replaced atomically after step_<N> is complete
    FINISHED                  written once training has completed; a run with it is never requeued
    mlflow_run_id             text file holding the MLflow run id (optional)
Written by ``elastic-pretrain submit`` / ``cancel`` and the batch script:
    slurm/train.sbatch        the rendered script that was submitted
    slurm/train.log           stdout+stderr of every (re)start of the job, appended
    slurm/job_id              the Slurm job id of the latest submission
    slurm/CANCELLED           marker: ``cancel`` was run, the batch script must not requeue
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """Paths inside one run directory (see the module docstring for who writes what)."""

    run_dir: Path

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def latest(self) -> Path:
        return self.checkpoints / "latest"

    @property
    def finished(self) -> Path:
        return self.run_dir / "FINISHED"

    @property
    def mlflow_run_id(self) -> Path:
        return self.run_dir / "mlflow_run_id"

    @property
    def slurm_dir(self) -> Path:
        return self.run_dir / "slurm"

    @property
    def script(self) -> Path:
        return self.slurm_dir / "train.sbatch"

    @property
    def log(self) -> Path:
        return self.slurm_dir / "train.log"

    @property
    def job_id(self) -> Path:
        return self.slurm_dir / "job_id"

    @property
    def cancelled(self) -> Path:
        return self.slurm_dir / "CANCELLED"


def last_committed_step(files: RunFiles) -> int | None:
    """The newest committed step, the one a resumed run continues from; ``None`` if there is none.

    Not ``latest`` as written: it may be stale (naming a missing or uncommitted step), and the store
    decides the same way ``train`` does (``checkpoint/latest.py`` says what is wrong with it)."""
    from elastic_pretrain.checkpoint.store import CheckpointStore

    newest = CheckpointStore(files.checkpoints).newest()
    return newest.step if newest else None


def read_text_or_none(path: Path) -> str | None:
    """Stripped contents of a small marker file, ``None`` if it does not exist or is empty."""
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text or None
