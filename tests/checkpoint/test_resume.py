"""Resume is bitwise at world size 2 (EP=2, DP=2): N steps uninterrupted == a run whose rank 1 is
``kill -9``-ed in the middle of a save, resumed — per-step losses, final parameters and Adam state,
across the default job's fixed -> mixed switch (switch_at 0.75: step 5 of 6). World size 1 is covered,
kill by kill, in test_crash.py; a clean stop (``checkpoint.stop_at``: save, exit 0, no FINISHED) in
tests/eval/test_decider_job.py and, by SIGTERM on a 2-node Slurm job, in tests/slurm/test_real_trainer.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elastic_pretrain.checkpoint.store import FAULT_ENV
from tests.checkpoint.runs import CLI, differing, history, tensors, train
from tests.conftest import REPO

# long: bitwise resume is in CI through test_crash.py, test_late_switch.py and the Slurm preemption test
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.usefixtures("prepared"), pytest.mark.timeout(1800)]
STEPS = 6


def test_kill_and_resume_is_bitwise_equal_at_world_size_2(tmp_path: Path) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    steps = f"train.steps={STEPS}"
    train(full, 2, steps)
    # a save every step; rank 1 dies while the save of step 5 waits for its marker (rank 0 in the commit)
    killed = train(split, 2, steps, "checkpoint.interval=1", env={FAULT_ENV: "before_marker:1:5"}, expect=1)
    assert "checkpoint step 4 committed" in killed.stdout and not (split / "FINISHED").exists()
    assert (split / "checkpoints" / "latest").read_text().strip() == "step_4"
    last = train(split, 2, steps)
    assert "step_4 (step 4" in last.stdout and (split / "FINISHED").is_file()
    a, b = history(full), history(split)
    assert [h["step"] for h in b] == list(range(1, STEPS + 1))
    assert a == b  # per-step losses (JSON floats round-trip exactly)
    x = tensors(full / "checkpoints" / f"step_{STEPS}", tmp_path / "x.pt")
    y = tensors(split / "checkpoints" / f"step_{STEPS}", tmp_path / "y.pt")
    assert any(k.startswith("optimizer.exp_avg_sq.") for k in x)
    assert differing(x, y) == []
    listing = subprocess.run([CLI, "checkpoints", str(split), "--verify"], cwd=REPO, capture_output=True, text=True)
    assert listing.returncode == 0 and "step_6" in listing.stdout and "latest" in listing.stdout
