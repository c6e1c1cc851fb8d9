"""The checkpoint folder without training: commit marker, atomic latest, retention, corruption."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_pretrain.checkpoint.store import CheckpointStore, verify
from elastic_pretrain.errors import UserError
from elastic_pretrain.launch.layout import last_committed_step
from elastic_pretrain.rundir import RunFiles


def _save(store: CheckpointStore, step: int) -> Path:
    tmp = store.prepare(step)
    (tmp / "model_optim" / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp / "trainer.json").write_text("{}")
    records = {"model_optim/__0_0.distcp": [100, __import__("zlib").crc32(b"x" * 100)]}
    return store.commit(step, records)


def test_commit_latest_and_retention(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    store.prepare(7)  # an uncommitted save never counts
    assert store.newest() is None
    for step in (10, 20, 30, 40, 50):
        _save(store, step)
    assert last_committed_step(RunFiles(tmp_path)) == 50 and store.newest().step == 50
    assert store.retain(keep_last=2, keep_every=20) == [10, 30]
    assert [c.step for c in store.committed()] == [20, 40, 50]
    store.clean_stale()
    assert not any(p.name.startswith(".") for p in store.root.iterdir() if p.is_dir())


def test_truncated_or_corrupt_file_is_named(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    ckpt = _save(store, 5)
    verify(ckpt)
    data = ckpt / "model_optim" / "__0_0.distcp"
    data.write_bytes(b"x" * 50)
    with pytest.raises(UserError, match=r"__0_0\.distcp: truncated"):
        verify(ckpt)
    data.write_bytes(b"y" * 100)
    with pytest.raises(UserError, match=r"__0_0\.distcp: corrupt"):
        verify(ckpt)
