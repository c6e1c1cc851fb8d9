"""Stop messages say what happened, with real signals on a 2-rank launch (``train --nproc-per-node 2``).

One run directory, three starts: SIGTERM to rank 1 only (the stop names rank 1, not ``stop_at``);
SIGTERM to the launcher process itself (said, and passed on: the trainers stop); SIGTERM to
``elastic-pretrain train`` before the ranks have even started training (remembered: they stop at
their first step boundary instead of training to the end)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from elastic_pretrain.checkpoint.preempt import stop_reason
from tests.checkpoint.launch import Launch

RUN = ["train.steps=200", "checkpoint.keep_last=5"]


def _stopped(launch: Launch, reason: str) -> int:
    match = re.search(rf"stopped \({re.escape(reason)}\) at step (\d+)/200: checkpoint saved", "".join(launch.out))
    assert match, launch.text()
    return int(match.group(1))


@pytest.mark.parametrize(
    ("signums", "reason"),
    [([15, 15], "SIGTERM"), ([0, 15], "SIGTERM on rank 1"), ([15, 0, 15, 0], "SIGTERM on ranks 0, 2"),
     ([10, 15], "SIGUSR1 on rank 0, SIGTERM on rank 1"), ([0, 0], "stop_at"), ([15], "SIGTERM")],
)  # fmt: skip
def test_stop_reason_words(signums: list[int], reason: str) -> None:
    assert stop_reason(signums) == reason


@pytest.mark.slow
@pytest.mark.long  # three 2-rank starts; a signalled stop is in CI through tests/slurm/ and test_stopped_marker.py
@pytest.mark.usefixtures("prepared")
@pytest.mark.timeout(2400)
def test_stop_messages_name_the_signal_and_the_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = lambda: json.loads((run / "summary.json").read_text())  # noqa: E731

    first = Launch(run, *RUN)
    first.wait_for(r"step +2/200")
    first.signal(first.rank_pid(1))  # a signal that reaches one rank only
    assert first.finish() == 0, first.text()
    step = _stopped(first, "SIGTERM on rank 1")
    assert summary()["stopped"] == "SIGTERM on rank 1" and not (run / "FINISHED").exists()
    # what the batch script reads when the signal did not come through it (docs/slurm.md)
    marker = json.loads((run / "STOPPED").read_text())
    assert (marker["step"], marker["reason"]) == (step, "SIGTERM on rank 1"), marker

    second = Launch(run, *RUN)
    second.wait_for(rf"resumed from .*step_{step} ")
    launcher = second.launcher()
    second.signal(launcher)  # the launcher (torchrun's agent) itself
    assert second.finish() == 0, second.text()
    assert f"the launcher (pid {launcher}) got SIGTERM from pid " in "".join(second.err), second.text()
    step = _stopped(second, "SIGTERM")

    third = Launch(run, *RUN)
    third.launcher()  # as soon as the launcher exists: the ranks are still importing torch, or not started
    third.signal(third.proc.pid)
    assert third.finish() == 0, third.text()
    assert "elastic-pretrain train: got SIGTERM: the trainers save at the next step and exit" in "".join(third.err)
    assert _stopped(third, "SIGTERM") == step + 1  # the first step boundary, not the end of the run
    assert summary()["stopped"] == "SIGTERM" and not (run / "FINISHED").exists()
    assert json.loads((run / "STOPPED").read_text())["step"] == step + 1  # the second start's, replaced
