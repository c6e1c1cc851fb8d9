"""Preemption: a signal only sets a flag; the Trainer all-reduces it at the next step boundary, so
every rank saves the same step and exits 0 together (the Slurm contract, launch/layout.py)."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Iterator
from multiprocessing.managers import SyncManager
from types import FrameType
from typing import Any

# SIGTERM: Slurm/Kubernetes stop; SIGUSR1/2: `--signal=B:<SIG>@<lead>`; SIGINT: Ctrl-C behaves the same.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class StopRequest:
    """Installed for the whole run, before the slow setup; ``requested`` turns True on the first stop signal.

    A launcher (``launch/local.py``) starts the ranks with the stop signals *blocked*: a signal that
    arrives while a rank is still importing torch stays pending and is delivered here, when the
    handler is installed and the signals are unblocked, so an early stop is not lost."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested, self.signum = True, signum

    def __enter__(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a pending (early) signal arrives now
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "stop_at"


def stop_reason(signums: list[int]) -> str:
    """Why the ranks stop, from each rank's signal number (0: none; all 0: ``checkpoint.stop_at``):
    ``SIGTERM`` when every rank got it, else ``SIGTERM on rank 1`` / ``SIGTERM on ranks 0, 2``."""
    if not any(signums):
        return "stop_at"
    got: dict[int, list[int]] = {}
    for rank, signum in enumerate(signums):
        if signum:
            got.setdefault(signum, []).append(rank)
    if len(got) == 1 and len(next(iter(got.values()))) == len(signums):
        return signal.Signals(next(iter(got))).name
    return ", ".join(
        f"{signal.Signals(signum).name} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        for signum, ranks in sorted(got.items(), key=lambda kv: kv[1][0])
    )


@contextlib.contextmanager
def stop_signals_ignored() -> Iterator[None]:
    """Ignore the stop signals while starting helper processes that must outlive them.

    The batch script forwards the stop signal to every process of the job step, helpers included.
    A spawned helper execs a fresh interpreter, which resets a handler to the default action
    (terminate) but keeps SIG_IGN. Use it before StopRequest is installed (nothing is lost)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent_pid: int) -> None:
    """Initializer of a helper process: SIGKILL it when the process that started it dies.

    SIGKILL, not SIGTERM: helpers run with the stop signals ignored (above). Without this, a rank
    killed with ``kill -9`` (OOM killer, a lost node's watchdog) leaves its helper running forever,
    holding the launcher's output pipes open."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def start_helper_manager() -> SyncManager:
    """A multiprocessing Manager (spawned, as megatron's own) that ignores the stop signals and dies with
    this process. The caller keeps the returned object alive for as long as it uses the manager."""
    manager = SyncManager(ctx=mp.get_context("spawn"))
    with stop_signals_ignored():
        manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
    return manager
