"""Checkpoint cadence, retention, async writing and resume policy of a run."""

from __future__ import annotations

import dataclasses
from typing import Literal

from elastic_pretrain.config import ConfigError, field


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often a run saves, what it keeps, and whether a restart resumes.

    Checkpoints go to ``<run_dir>/checkpoints/step_<N>/`` (docs/checkpoints.md). A run always saves
    at its last step and when preempted (SIGTERM/SIGUSR1/SIGUSR2/Ctrl-C), whatever ``interval`` is.
    """

    interval: int = field(100, doc="Steps between checkpoints (0: only at the end and on preemption).")
    keep_last: int = field(2, doc="Committed checkpoints kept, newest first (>= 1).")
    keep_every: int = field(0, doc="Also keep every checkpoint whose step is a multiple of this, forever (0: none).")
    async_save: bool = field(
        False,
        doc="Write tensors in a background process while training continues; the step directory is "
        "committed at a later step boundary once every rank's writer has finished.",
    )
    async_writer: Literal["persistent", "fork"] = field(
        "persistent",
        doc="How an async save snapshots the tensors. 'persistent': copied into a staging buffer in shared memory "
        "(host memory of the rank's checkpoint share, kept for the run) and written by one writer process per rank; "
        "'fork': a writer forked per save (megatron's; copy-on-write, no buffer, slower training after each save).",
    )
    resume: Literal["auto", "never"] = field(
        "auto",
        doc="'auto': a run directory holding a committed checkpoint continues from the newest one; "
        "'never': start from scratch (refused if checkpoints exist, so nothing is overwritten by accident).",
    )
    resume_from: str | None = field(
        None, doc="Continue from this checkpoint directory (a step_<N> folder, possibly of another run)."
    )
    io_timeout_minutes: float = field(
        30.0,
        doc="Timeout of the checkpoint collectives (checksum verification, commit), separate from the training "
        "collectives' parallel.timeout_minutes: raise it for very large checkpoints on slow file systems.",
    )
    stop_at: int = field(
        0,
        doc="Save and exit (as if preempted, exit code 0) once this global step is reached (0: never). For splitting "
        "a run over jobs with a step budget, and for resume tests.",
    )

    def __post_init__(self) -> None:
        for name in ("interval", "keep_every", "stop_at"):
            if getattr(self, name) < 0:
                raise ConfigError(f"checkpoint.{name}: must be >= 0, got {getattr(self, name)}")
        if self.io_timeout_minutes <= 0:
            raise ConfigError(f"checkpoint.io_timeout_minutes: {self.io_timeout_minutes} must be > 0")
        if self.keep_last < 1:
            raise ConfigError(
                f"checkpoint.keep_last: {self.keep_last} must be >= 1 (the newest checkpoint is what a restart uses)"
            )
