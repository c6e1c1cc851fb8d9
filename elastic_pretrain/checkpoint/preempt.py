"""Preemption: a signal only sets a flag; the Trainer all-reduces it at the next step boundary, so
every rank saves the same step and exits 0 together (the Slurm contract, launch/layout.py).

Imports only the standard library's light modules: the node launcher (``launch/local.py``) imports
:data:`STOP_SIGNALS` before it blocks them, and a stop signal in that window is lost."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import FrameType

# SIGTERM: Slurm/Kubernetes stop; SIGUSR1/2: `--signal=B:<SIG>@<lead>`; SIGINT: Ctrl-C behaves the same.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class StopRequest:
    """Installed for the whole run, before the slow setup; ``requested`` turns True on the first stop signal.

    A launcher (``launch/local.py``) starts the ranks with the stop signals *blocked*: a signal that
    arrives while a rank is still importing torch stays pending and is delivered here, when the
    handler is installed and the signals are unblocked, so an early stop is not lost.

    Leaving restores the previous handlers, except in such a rank (stop signals blocked on entry):
    there the stop signals are *ignored* from then on, because the process only exits after this. A
    stop signal can reach a rank twice — under Slurm ``scancel --signal`` signals every process of the
    step, the ranks and their node launcher, which passes its own copy on — and a copy that lands after
    the save, once the handler is gone, would otherwise kill the rank (the default action; Python's
    exit also resets every handler it installed to the default) and turn a clean stop into a failure."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._launched = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested, self.signum = True, signum

    def __enter__(self) -> StopRequest:
        self._launched = set(STOP_SIGNALS) <= signal.pthread_sigmask(signal.SIG_BLOCK, [])
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a pending (early) signal arrives now
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            # SIG_IGN, unlike a Python handler, outlives the interpreter's exit
            signal.signal(sig, signal.SIG_IGN if self._launched else handler)
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
