"""Reading a run directory's Slurm-side state. The run directory's files are named in
:mod:`elastic_pretrain.rundir` (``RunFiles``, imported here for the launch code and its tests)."""

from __future__ import annotations

import re
from pathlib import Path

from elastic_pretrain.rundir import RunFiles

__all__ = ["RunFiles", "last_committed_step", "read_text_or_none"]

_STEP_RE = re.compile(r"^(?:step_)?(\d+)$")


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
