"""Preemption: a signal only sets a flag; the Trainer all-reduces it at the next step boundary, so
every rank saves the same step and exits 0 together (the Slurm contract, launch/layout.py)."""

from __future__ import annotations

import signal
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
