"""The stop-signal chain of one node, on this machine, without Slurm: the node launcher
(``python -m elastic_pretrain.launch.local``, torchrun's agent in a process of ours, as slurm/train.sbatch
runs it on each node) and one rank with the trainer's ``StopRequest`` (stop_rank.py, no torch), signalled
at chosen points.

Under Slurm, ``scancel --signal`` (the batch script's forward, or a signal to the job step only) reaches
every process of the step: each rank directly, and the launcher, which passes its own copy on to its
ranks. So a rank can get a stop signal before its handler exists (it must wait, blocked) and a second
copy after it has saved and left its handler (it must not die of it: the launcher would exit 1 and the
batch script would read a failed trainer instead of a stop). Each case is deterministic: the test waits
for the rank to reach the point, and a signal is pending or delivered when ``kill`` returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elastic_pretrain.launch.local import children
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # each case starts a launcher, which imports torch (a few seconds)

RANK = Path(__file__).resolve().parent / "stop_rank.py"
TIMEOUT_S = 120


class Node:
    """A running node launcher with one stop_rank.py rank working in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        cmd = [sys.executable, "-m", "elastic_pretrain.launch.local", "--standalone", "--nproc-per-node", "1",
               "--signals-to-handle", "SIGHUP,SIGQUIT", str(RANK), str(folder)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)  # fmt: skip

    def wait_for(self, what: str | Callable[[], bool]) -> None:
        check = (lambda: (self.folder / what).exists()) if isinstance(what, str) else what
        deadline = time.monotonic() + TIMEOUT_S
        while not check():
            assert self.proc.poll() is None, f"the launcher ended before {what}:\n{self.output()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def rank(self) -> int:
        self.wait_for("started")
        return int((self.folder / "started").read_text())

    def pending(self, pid: int, sig: int) -> bool:
        """``sig`` is pending (blocked, not yet delivered) in process ``pid``."""
        status = Path(f"/proc/{pid}/status").read_text()
        masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd", "ShdPnd"))]
        return any(mask >> (sig - 1) & 1 for mask in masks)

    def touch(self, name: str) -> None:
        (self.folder / name).write_text("")

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not end within {TIMEOUT_S} s:\n{self.output()}")

    def output(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return (self.proc.communicate()[0] or "")[-6000:]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    node = Node(tmp_path)
    yield node
    if node.proc.poll() is None:
        for pid in [*children(node.proc.pid), node.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        node.proc.wait()


def test_a_stop_signal_before_the_handler_waits_for_it(node: Node) -> None:
    """Signalled while the rank has no handler yet (still importing, in a real trainer), directly and
    through the launcher: each signal stays pending and becomes the stop once the handler is in."""
    rank = node.rank()
    os.kill(rank, signal.SIGUSR1)
    os.kill(node.proc.pid, signal.SIGUSR2)  # the launcher passes it on
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # before the handler: pending, neither lost nor fatal
        node.wait_for(lambda s=sig: node.pending(rank, s))
    node.touch("go")
    node.touch("install")
    assert node.finish() == 0, node.output()
    assert (node.folder / "STOPPED").read_text() in ("SIGUSR1", "SIGUSR2")


def test_a_second_copy_after_the_save_does_not_kill_the_rank(node: Node) -> None:
    """The Slurm failure: the step's SIGTERM reached the rank, which saved and stopped; the launcher's
    copy of the same signal came after the rank had left its handler. It must not kill the rank
    (exit -15: the launcher exits 1, and the batch script reads a failed trainer instead of a stop)."""
    rank = node.rank()
    node.touch("install")
    node.wait_for("ready")
    os.kill(rank, signal.SIGTERM)  # slurmstepd's copy: the rank stops
    node.wait_for("exiting")  # saved, STOPPED written, handler gone
    os.kill(rank, signal.SIGTERM)  # the launcher's copy, late: delivered (or ignored) when kill returns
    node.touch("go")
    assert node.finish() == 0, node.output()
    assert (node.folder / "STOPPED").read_text() == "SIGTERM"
