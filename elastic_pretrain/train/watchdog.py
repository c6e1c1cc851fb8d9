"""Hang watchdog: a rank whose loop makes no progress for ``train.hang_timeout_s`` dumps every Python
thread's stack to ``<run_dir>/hang/rank_<r>.txt`` and exits non-zero, so the launcher (torchrun, then
the sbatch script) ends the job and Slurm requeues it; the rerun resumes from the last committed
checkpoint. A rank blocked in a collective on a hung peer stops making progress too, so every rank
dumps: the hung one names the frame it is stuck in, the others name the collective they wait in.

Progress is a finished step, evaluation or rollback (the watchdog is a Trainer callback); a save
counts with the step it follows, so the timeout must exceed the slowest step plus a save.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_pretrain.errors import UserError
from elastic_pretrain.files import atomic_file
from elastic_pretrain.rundir import RunFiles

HANG_EXIT_CODE = 124  # like timeout(1): the sbatch script requeues on any non-zero exit (slurm.on_failure=requeue)
GRACE_S = 15.0  # at most this long for the dump to reach MLflow before the process exits anyway
# Every rank stopped beating at about the same moment and fires within a poll of the others; exiting at
# once would break its peers' collectives, and they would die of that error before writing their dumps.
EXIT_DELAY_S = 5.0


def format_stacks() -> str:
    """Every Python thread's stack, innermost frame last, thread names included."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n' + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


class HangWatchdog:
    """Callback (any Trainer callback method counts as progress) owning a daemon thread that fires once."""

    def __init__(
        self,
        timeout_s: float,
        run_dir: Path,
        rank: int,
        on_fire: Callable[[Path, str], None] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.timeout_s, self.rank, self.on_fire = timeout_s, rank, on_fire
        self.run_dir, self.path = run_dir, RunFiles(run_dir).hang_dump(rank)
        self.step, self.last = 0, time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(poll_s,), name="hang-watchdog", daemon=True)
        if timeout_s > 0:
            self._thread.start()

    def beat(self, step: int | None = None) -> None:
        self.last = time.monotonic()
        if step is not None:
            self.step = step

    def on_step(self, state: Any, result: Any, step_s: float) -> None:
        self.beat(state.step)

    def on_eval(self, state: Any, val: dict[int, float]) -> None:
        self.beat()

    def on_rollback(self, state: Any) -> None:
        self.beat(state.step)

    def on_end(self, state: Any, val: dict[int, float]) -> None:
        self._done.set()

    def on_stop(self, state: Any, reason: str) -> None:
        self._done.set()

    def _run(self, poll_s: float) -> None:
        while not self._done.wait(poll_s):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        line = (
            f"hang watchdog: rank {self.rank} on {socket.gethostname()} (pid {os.getpid()}): no step finished "
            f"for {idle:.0f}s after step {self.step} (train.hang_timeout_s={self.timeout_s:g}); "
            f"stacks in {self.path}; exiting {HANG_EXIT_CODE}"
        )
        try:  # hang/ below the run directory, no link followed (files.py); the exit below happens regardless
            with atomic_file(self.path, root=self.run_dir) as f:
                f.write((line + "\n\n" + format_stacks() + "\n\nfaulthandler:\n").encode())
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
        except (OSError, UserError) as err:
            line += f" (no stack dump: {err})"
        print(line, file=sys.stderr, flush=True)
        threading.Timer(GRACE_S, os._exit, args=(HANG_EXIT_CODE,)).start()  # reporting never keeps it alive
        started = time.monotonic()
        if self.on_fire is not None:
            with contextlib.suppress(Exception):
                self.on_fire(self.path, line)
        time.sleep(max(0.0, EXIT_DELAY_S - (time.monotonic() - started)))
        os._exit(HANG_EXIT_CODE)
