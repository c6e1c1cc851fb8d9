"""Reading a run directory's Slurm-side state. The run directory's files are named in
:mod:`elastic_pretrain.rundir` (``RunFiles``)."""

from __future__ import annotations

from pathlib import Path

from elastic_pretrain.rundir import RunFiles


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
