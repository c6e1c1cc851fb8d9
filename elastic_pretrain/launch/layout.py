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
import re
from pathlib import Path

_STEP_RE = re.compile(r"^(?:step_)?(\d+)$")


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
    """Step of ``checkpoints/latest`` (a ``step_<N>`` text file or symlink); ``None`` if there is none."""
    latest = files.latest
    if latest.is_symlink():
        text = Path(latest.readlink()).name
    elif latest.is_file():
        text = latest.read_text().strip()
    else:
        return None
    m = _STEP_RE.match(Path(text).name)
    return int(m.group(1)) if m else None


def read_text_or_none(path: Path) -> str | None:
    """Stripped contents of a small marker file, ``None`` if it does not exist or is empty."""
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text or None
