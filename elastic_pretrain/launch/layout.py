"""Reading a run directory's Slurm-side state. The run directory's files are named in
:mod:`elastic_pretrain.rundir` (``RunFiles``)."""

from __future__ import annotations

from elastic_pretrain.rundir import RunFiles


def last_committed_step(files: RunFiles) -> int | None:
    """The newest committed step, the one a resumed run continues from; ``None`` if there is none.

    Not ``latest`` as written: it may be stale (naming a missing or uncommitted step), and the store
    decides the same way ``train`` does (``checkpoint/latest.py`` says what is wrong with it)."""
    from elastic_pretrain.checkpoint.store import CheckpointStore

    newest = CheckpointStore(files.checkpoints).newest()
    return newest.step if newest else None
