"""The committed checkpoints of a run as rows: ``elastic-pretrain checkpoints`` prints them, and the trainer
writes them to ``checkpoints/index.json`` (and MLflow) when a run ends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastic_pretrain.checkpoint.store import CheckpointStore, read_trainer_state, verify
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import write_atomic
from elastic_pretrain.rundir import RunFiles


def checkpoint_index(run_dir: Path, *, check: bool = False) -> list[dict[str, Any]]:
    """One row per committed checkpoint (step, path, bytes, tokens, layout, latest) — the
    ``checkpoints`` listing, also logged to MLflow as ``checkpoints/index.json``."""
    store = CheckpointStore(RunFiles(run_dir).checkpoints)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    latest = store.read_latest()
    rows = []
    for c in store.committed():
        meta = read_trainer_state(c.path, require=("trainer",))
        if check:
            verify(c.path)
        rows.append(
            {
                "step": c.step,
                "path": str(c.path),
                "bytes": c.size_bytes,
                "tokens": meta["trainer"]["tokens"],
                "layout": meta.get("layout", {}),
                "latest": c.path.name == latest,
            }
        )
    return rows


def write_index(run_dir: Path) -> Path | None:
    """``checkpoints/index.json`` (when the run has a checkpoints folder); returns its path."""
    index = RunFiles(run_dir).checkpoint_index
    if not index.parent.is_dir():
        return None
    return write_atomic(index, json.dumps(checkpoint_index(run_dir), indent=1), root=run_dir)
