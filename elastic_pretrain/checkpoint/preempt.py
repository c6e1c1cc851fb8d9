"""Preemption: a signal only sets a flag; the Trainer all-reduces it at the next step boundary, so
every rank saves the same step and exits 0 together (the Slurm contract, launch/layout.py)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

# SIGTERM: Slurm/Kubernetes stop; SIGUSR1/2: `--signal=B:<SIG>@<lead>`; SIGINT: Ctrl-C behaves the same.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class StopRequest:
    """Installed for the duration of training; ``requested`` turns True on the first stop signal."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested, self.signum = True, signum

    def __enter__(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "stop_at"


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
