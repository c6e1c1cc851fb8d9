"""Crash safety, one ``kill -9`` after another, at every point of a save (world size 1, async saves).

A chain of attempts on one run directory: each attempt resumes from the newest committed checkpoint
and is killed (SIGKILL, no clean-up) at the next point of the next save. After every kill, ``latest``
names a readable checkpoint, the newest committed step is the expected one, and no helper process of
the killed rank is left behind. The last attempt finishes; every checkpoint the chain wrote — by four
different processes, asynchronously — equals bitwise the one an uninterrupted run wrote synchronously,
and so do the per-step losses. Then the run directory refuses a changed model shape (one line) and a
corrupted file (naming it)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from elastic_pretrain.checkpoint.manager import resume_source
from elastic_pretrain.checkpoint.store import FAULT_ENV, CheckpointStore, verify
from elastic_pretrain.errors import UserError
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.train.resume import resumable
from tests.checkpoint.runs import COMMON, differing, history, tensors, train
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prepared"), pytest.mark.timeout(1800)]
STEPS = 5
RUN = [f"train.steps={STEPS}", "checkpoint.interval=1", "checkpoint.keep_last=10"]
# (fault point, step of the save it kills, committed steps after the kill, what `latest` names)
CHAIN = [
    ("before_tensors", 1, [], None),
    ("before_marker", 2, [1], "step_1"),
    ("after_marker", 3, [1, 2], "step_2"),
    ("after_rename", 4, [1, 2, 3, 4], "step_3"),  # step_4 complete; `latest` not yet updated
]


def _survivors(tag: str) -> list[int]:
    """Processes (the killed rank's helpers) that still carry this test's environment tag."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if tag.encode() in env.read_bytes():
                found.append(int(env.parent.name))
        except OSError:
            continue
    return found


def test_kill_9_at_every_save_point_then_resume(tmp_path: Path) -> None:
    full, run = tmp_path / "full", tmp_path / "chain"
    train(full, 1, *RUN)
    store = CheckpointStore(run / "checkpoints")
    tag = f"EP_CRASH_TEST={tmp_path}"
    for point, step, committed, latest in CHAIN:
        env = {FAULT_ENV: f"{point}:0:{step}", "EP_CRASH_TEST": str(tmp_path)}
        train(run, 1, *RUN, "checkpoint.async_save=true", env=env, expect=-9)
        assert [c.step for c in store.committed()] == committed, point
        assert (store.latest_file.read_text().strip() if store.latest_file.exists() else None) == latest, point
        if latest:
            verify(store.root / latest)
        deadline = time.monotonic() + 20
        while _survivors(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _survivors(tag) == [], f"helper processes outlived the rank killed at {point}"
    last = train(run, 1, *RUN, "checkpoint.async_save=true")
    assert "step_4 (step 4" in last.stdout and (run / "FINISHED").is_file()
    assert [c.step for c in store.committed()] == [1, 2, 3, 4, 5]
    a, b = history(full), history(run)
    assert a == b and [h["step"] for h in b] == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        x = tensors(full / "checkpoints" / f"step_{step}", tmp_path / "x.pt")
        y = tensors(run / "checkpoints" / f"step_{step}", tmp_path / "y.pt")
        assert differing(x, y) == [], f"step_{step}"
        meta = [json.loads((d / "checkpoints" / f"step_{step}" / "trainer.json").read_text()) for d in (full, run)]
        for key in ("trainer", "scheduler", "controller", "data", "adam_step"):
            assert meta[0][key] == meta[1][key] or key == "trainer", (step, key)

    # a changed model shape: refused before anything is built, one line naming the key, nothing lost
    changed = train(run, 1, *RUN, "model.hidden_size=64", expect=2)
    error = changed.stderr.strip().splitlines()[-1]
    assert "Traceback" not in changed.stderr and error.startswith("elastic-pretrain train: error: ")
    assert "model.hidden_size: 96 -> 64" in error and "step_5" in error
    # a corrupted file of the newest checkpoint: the error names the file (same path as the CLI's)
    victim = max((run / "checkpoints" / "step_5" / "model_optim").glob("*.distcp"), key=os.path.getsize)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", [f"run_dir={run}", "parallel=single", *COMMON, *RUN])
    with pytest.raises(UserError, match=rf"{victim.name}: corrupt"):
        resumable(resume_source(job.checkpoint, store), job)
    assert [c.step for c in store.committed()] == [1, 2, 3, 4, 5]
