"""One trainer per run directory (train/runlock.py): a second trainer of the same run directory is refused in one
line before it writes anything, the lock is per process and released at the end, and a link in the lock's place
is refused without being followed. Found when an experiment rerun trained runs its own queue was training."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_pretrain.errors import UserError
from elastic_pretrain.rundir import RunFiles
from elastic_pretrain.train.runlock import RunLock, describe_holder
from tests.conftest import REPO


def test_a_second_holder_is_told_who_holds_the_lock_until_it_is_released(tmp_path: Path) -> None:
    path = RunFiles(tmp_path).train_lock
    first, second = RunLock(path), RunLock(path)
    assert first.acquire() is None
    holder = second.acquire()  # flock is per open file: a second open is refused even in this process
    assert holder is not None and f"pid {os.getpid()} on {socket.gethostname()}" in holder
    first.release()
    assert second.acquire() is None
    second.release()


def test_a_link_in_the_locks_place_is_refused_and_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours\n")
    run = tmp_path / "run"
    run.mkdir()
    RunFiles(run).train_lock.symlink_to(outside)
    with pytest.raises(UserError, match="is a symbolic link"):
        RunLock(RunFiles(run).train_lock).acquire()
    assert outside.read_text() == "not yours\n"


@pytest.mark.parametrize("note", [b"", b"\xff\xfe", b'{"pid": "x"}', b"[1, 2]", b'{"pid": 1, "host": {}}'])
def test_a_foreign_note_is_described_without_trusting_it(note: bytes) -> None:
    assert describe_holder(note).startswith("another trainer")
    assert describe_holder(b'{"pid": 7, "host": "n\\u001b[31m1", "since": "t"}') == (
        "another trainer (pid 7 on n?[31m1, since t)"
    )


def test_train_into_a_held_run_directory_is_refused_before_writing(tmp_path: Path) -> None:
    if not (REPO / "cache/stdlib-code/manifest.json").is_file():
        cmd = [sys.executable, "-m", "elastic_pretrain.cli", "prepare-data", "stdlib-code"]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=300)
    run = tmp_path / "run"
    run.mkdir()
    held = RunLock(RunFiles(run).train_lock)
    assert held.acquire() is None
    try:
        cmd = [sys.executable, "-m", "elastic_pretrain.cli", "train", "jobs/tiny-cpu.yaml", "--run-dir", str(run),
               "parallel=single", "train.steps=2", "train.warmup_steps=0", "tracking.backend=none"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:
        held.release()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"run directory {run} is being trained by another trainer (pid {os.getpid()}" in out
    assert "Traceback" not in out
    assert sorted(p.name for p in run.iterdir()) == ["trainer.lock"]  # no config, checkpoint or history written
