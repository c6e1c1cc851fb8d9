"""The run directory's ``STOPPED`` marker (rundir.py, docs/slurm.md): written by the logging rank when a
stop *signal* ended a start after its save, never for ``checkpoint.stop_at``, and removed when the next
start begins. The batch script requeues on it when the signal reached the trainer but not the script
(tests/slurm/test_cluster.py drives that end to end); a 2-rank launch checks the real signal path in
tests/checkpoint/test_stop_signals.py (``--long``)."""

from __future__ import annotations

import json
from pathlib import Path

from elastic_pretrain.rundir import RunFiles
from elastic_pretrain.train.trainer import SummaryWriter, TrainState


def test_a_signal_stop_writes_stopped_and_the_next_start_removes_it(mesh1, tmp_path: Path) -> None:
    files = RunFiles(tmp_path)
    SummaryWriter(tmp_path, mesh1).on_stop(TrainState(step=7, tokens=7 * 512), "SIGTERM on rank 1")
    assert json.loads(files.stopped.read_text()) == {"step": 7, "tokens": 3584, "reason": "SIGTERM on rank 1"}
    assert json.loads(files.summary.read_text())["stopped"] == "SIGTERM on rank 1"

    SummaryWriter(tmp_path, mesh1, resumed_step=7)  # the next start, resuming at step 7
    assert not files.stopped.exists(), "an earlier start's stop must not speak for this one"


def test_stop_at_is_not_a_signal_stop(mesh1, tmp_path: Path) -> None:
    SummaryWriter(tmp_path, mesh1).on_stop(TrainState(step=3, tokens=1), "stop_at")
    files = RunFiles(tmp_path)
    assert json.loads(files.summary.read_text())["stopped"] == "stop_at"
    assert not files.stopped.exists(), "a requeue would stop again at once: stop_at must not ask for one"
