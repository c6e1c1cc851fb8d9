"""``checkpoints/latest`` is a hint for people and tools; the newest *committed* ``step_<N>`` is what a run
resumes from (``manager.resume_source``). A crash between a commit's rename and the ``latest`` update,
or a checkpoint deleted by hand, leaves the hint stale: :func:`latest_problem` says so in one line and
:func:`repair_latest` rewrites it (atomically) — a resumed run does that before it trains."""

from __future__ import annotations

from pathlib import Path

from elastic_pretrain.checkpoint.store import CheckpointStore
from elastic_pretrain.files import read_bounded, write_atomic


def read_latest(store: CheckpointStore) -> str | None:
    """The directory name ``latest`` names (a ``step_<N>`` text file or symlink); None without one."""
    path = store.latest_file
    if path.is_symlink():
        return Path(path.readlink()).name
    try:  # a FIFO or a device there is a one-line error, not a hang (files.py)
        return read_bounded(path, "latest").decode("utf-8", "replace").strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def latest_problem(store: CheckpointStore) -> str | None:
    """What is wrong with ``latest`` (one line naming the newest committed step), or None if it is right."""
    named, newest = read_latest(store), store.newest()
    if newest is not None and named == newest.path.name:
        return None
    if named is None:
        return f"latest is missing; the newest committed checkpoint is {newest.path.name}" if newest else None
    committed = {c.path.name for c in store.committed()}
    if named in committed:
        why = "but a newer one was committed after it (a crash before latest was updated)"
    elif (store.root / named).is_dir():
        why = "which is not committed (no COMMITTED marker: its save never finished)"
    else:
        why = "which does not exist"
    truth = f"the newest committed checkpoint is {newest.path.name}" if newest else "no checkpoint is committed"
    return f"latest names {named}, {why}; {truth}"


def repair_latest(store: CheckpointStore) -> str | None:
    """Point ``latest`` at the newest committed step if it does not; returns what was repaired (rank 0 only)."""
    problem, newest = latest_problem(store), store.newest()
    if problem is None or newest is None:
        return None
    write_atomic(store.latest_file, newest.path.name + "\n", root=store.root.parent)
    return f"{store.latest_file}: {problem}: repaired"
