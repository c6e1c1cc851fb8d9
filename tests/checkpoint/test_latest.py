"""A stale ``latest`` is reported and repaired; a corrupt newest checkpoint names the previous one.

``latest`` is a hint; the newest committed ``step_<N>`` is what a run resumes from. When ``latest``
names a missing, uncommitted or older step, ``checkpoints`` warns and marks the real one, and a
resumed run rewrites it before training (docs/checkpoints.md)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from elastic_pretrain import cli
from elastic_pretrain.checkpoint.latest import latest_problem, read_latest, repair_latest
from elastic_pretrain.checkpoint.store import TRAINER_FILE, CheckpointStore
from tests.checkpoint.runs import train


def _commit(store: CheckpointStore, step: int) -> None:
    """A committed step_<N> written by the store itself (trainer.json only: no tensors needed here)."""
    tmp = store.prepare(step)
    (tmp / TRAINER_FILE).write_text(json.dumps({"trainer": {"step": step, "tokens": 100 * step}, "layout": {}}))
    store.commit(step, {})


def _listing(run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    assert cli.main(["checkpoints", str(run)]) == 0
    out, err = capsys.readouterr()
    return out, err


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("step_3", "which does not exist"),  # deleted by hand (or by another tool)
        ("uncommitted", "which is not committed (no COMMITTED marker"),
        ("older", "but a newer one was committed after it"),  # a crash after the rename, before `latest`
        ("missing", "latest is missing"),
    ],
)
def test_stale_latest_is_reported_then_repaired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, why: str
) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    for step in (1, 2, 3):
        _commit(store, step)
    out, err = _listing(tmp_path, capsys)
    assert err == "" and out.rstrip().endswith("step_3  <- latest")
    if damage == "step_3":
        shutil.rmtree(store.step_dir(3))
    elif damage == "uncommitted":
        os.remove(store.step_dir(3) / "COMMITTED")
    elif damage == "older":
        store.latest_file.write_text("step_1\n")
    else:
        store.latest_file.unlink()
    newest = 3 if damage in ("older", "missing") else 2
    out, err = _listing(tmp_path, capsys)
    assert why in err and f"the newest committed checkpoint is step_{newest}" in err
    assert len(err.strip().splitlines()) == 1 and "<- latest\n" not in out
    assert f"step_{newest}  <- latest committed (the latest file is stale)" in out
    assert repair_latest(store) is not None and read_latest(store) == f"step_{newest}"
    assert latest_problem(store) is None and repair_latest(store) is None
    out, err = _listing(tmp_path, capsys)
    assert err == "" and out.rstrip().endswith(f"step_{newest}  <- latest")


@pytest.mark.slow
@pytest.mark.usefixtures("prepared")
def test_corrupt_newest_checkpoint_names_the_previous_one_and_resume_repairs_latest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, 1, "train.steps=3", "checkpoint.interval=1", "checkpoint.keep_last=5")
    store = CheckpointStore(run / "checkpoints")
    victim = max((store.step_dir(3) / "model_optim").glob("*.distcp"), key=os.path.getsize)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    refused = train(run, 1, "train.steps=4", expect=2)
    error = refused.stderr.strip().splitlines()[-1]
    assert f"{victim.name}: corrupt" in error
    assert error.endswith(f"; to continue from the previous committed checkpoint: --resume-from {store.step_dir(2)}")
    store.latest_file.write_text("step_9\n")  # and a stale `latest` (a checkpoint deleted by hand)
    resumed = train(run, 1, "train.steps=4", "--resume-from", str(store.step_dir(2)))  # the advice, followed
    assert f"resumed from {store.step_dir(2)} (step 2" in resumed.stdout
    assert "latest names step_9, which does not exist; the newest committed checkpoint is step_3: repaired" in (
        resumed.stdout
    )
    assert read_latest(store) == "step_4" and (run / "FINISHED").is_file()
