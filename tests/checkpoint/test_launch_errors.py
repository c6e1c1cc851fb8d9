"""A user error under ``train --nproc-per-node 2`` prints once, one line, exit 2 — no launcher traceback.

Two kinds: an error every rank raises (a corrupt newest checkpoint, found by rank 0's check and
raised everywhere) and an error of one rank only (rank 1's RNG file is not a tensor file: the
checkpoint's marker was rewritten to match, as someone else's checkpoint may be); rank 0 then finds
its collective broken and stays quiet."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elastic_pretrain.checkpoint.store import COMMIT_FILE, crc32_file
from tests.checkpoint.runs import train

# long: the same launcher and message path is in CI on two Slurm nodes (tests/slurm/test_real_trainer.py)
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.usefixtures("prepared"), pytest.mark.timeout(1800)]


def _one_error_line(stderr: str) -> str:
    for noise in ("Traceback", "ChildFailedError", "exitcode", "RuntimeError", "closing signal"):
        assert noise not in stderr, stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("elastic-pretrain train: error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_user_errors_under_torchrun_print_once_and_exit_2(tmp_path: Path) -> None:
    run = tmp_path / "run"
    steps = ["train.steps=2", "checkpoint.interval=1"]
    train(run, 2, *steps)
    ckpts = run / "checkpoints"
    victim = max((ckpts / "step_2" / "model_optim").glob("*.distcp"), key=os.path.getsize)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    every_rank = _one_error_line(train(run, 2, "train.steps=3", expect=2).stderr)
    assert f"{victim.name}: corrupt" in every_rank and f"--resume-from {ckpts / 'step_1'}" in every_rank

    rng = ckpts / "step_1" / "rng" / "rank_00001.pt"
    rng.write_bytes(b"not a torch file")
    marker = json.loads((ckpts / "step_1" / COMMIT_FILE).read_text())
    marker["files"]["rng/rank_00001.pt"] = [rng.stat().st_size, crc32_file(rng)]
    (ckpts / "step_1" / COMMIT_FILE).write_text(json.dumps(marker))
    one_rank = _one_error_line(train(run, 2, "train.steps=3", "--resume-from", str(ckpts / "step_1"), expect=2).stderr)
    assert f"{rng}: unreadable RNG state" in one_rank
