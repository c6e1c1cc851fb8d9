"""The multiprocessing Manager through which megatron's checkpoint writers report (``checkpoint/manager.py``,
``start_write_results_queue``): a helper process of each saving rank that must outlive a stop signal and
must stay cheap. A forwarded stop signal reaches every process of a Slurm job step, and a dead Manager fails
the preemption save: the helper is spawned with the stop signals *blocked* (not ``SIG_IGN``, which discards a
pending one), ignores them itself, and dies with its rank (``PR_SET_PDEATHSIG``). Its queue carries pickled
bytes, so it never imports torch; this module imports the standard library only.
docs/slurm.md, "Contract with the trainer" (the paragraph on helper processes).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import types
from collections.abc import Iterator
from multiprocessing import resource_tracker
from multiprocessing.managers import BaseProxy, SyncManager
from multiprocessing.reduction import ForkingPickler
from typing import Any

from elastic_pretrain.checkpoint.preempt import STOP_SIGNALS

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class PickledQueueProxy(BaseProxy):
    """A Manager queue whose items cross as pickled bytes: ``put``/``get``/``get_nowait`` as on
    ``queue.Queue``; the Manager process never unpickles an item."""

    _exposed_ = ("put", "get", "qsize", "empty")

    def _call(self, method: str, args: tuple[Any, ...] = ()) -> Any:
        call: Any = self._callmethod  # typeshed types its result as None
        return call(method, args)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self._call("put", (bytes(ForkingPickler.dumps(item)), block, timeout))

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        return ForkingPickler.loads(self._call("get", (block, timeout)))

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        return int(self._call("qsize"))

    def empty(self) -> bool:
        return bool(self._call("empty"))


class HelperManager(SyncManager):
    """``SyncManager`` whose ``Queue()`` is a :class:`PickledQueueProxy` (megatron calls ``put`` and
    ``get_nowait`` only)."""


HelperManager.register("Queue", queue.Queue, PickledQueueProxy)


def _helper_init(parent_pid: int) -> None:
    """Initializer of the helper process (its main thread, before it serves): ignore the stop signals
    (they are still blocked, inherited: a pending one is discarded here) and die with the parent.

    SIGKILL, not SIGTERM, as the parent-death signal: the stop signals are ignored here."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    die_with_parent(parent_pid)


def die_with_parent(parent_pid: int) -> None:
    """In a helper process: be SIGKILLed when the rank that started it dies (``kill -9`` of a rank must not
    leave it running, holding the launcher's output pipes open); exit now if that already happened."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


@contextlib.contextmanager
def protected_spawn() -> Iterator[None]:
    """Around a spawn start of a helper process (this Manager, the persistent checkpoint writer): the stop
    signals blocked in the starting thread (the child keeps the mask through ``exec``; a stop reaching this
    process meanwhile stays pending, or another thread's handler takes it) and the parent's ``__main__``
    hidden from the child (:func:`_main_hidden`)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        # the spawn start launches multiprocessing's resource tracker first, if not running yet, and then
        # unblocks SIGINT/SIGTERM (bpo-33613), which would leave the helper's start unprotected: launch it
        # here (it inherits the block: USR1/USR2 stay blocked there, it ignores INT/TERM itself), block again
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        with _main_hidden():
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def start_helper_manager() -> HelperManager:
    """Start the helper (spawned, as megatron's own Manager); the caller keeps the returned object alive
    for as long as it uses the manager. A stop signal that reaches this process meanwhile is kept
    pending in the starting thread (or taken by another thread's handler) and delivered afterwards."""
    manager = HelperManager(ctx=mp.get_context("spawn"))
    with protected_spawn():
        manager.start(initializer=_helper_init, initargs=(os.getpid(),))
    return manager


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """A spawned child first runs the parent's ``__main__`` again (as ``__mp_main__``): a script that
    imports torch and megatron at its top (tests/dist, bench) would cost the helper seconds of CPU. The
    helper needs nothing from it (its target, initializer and proxy types live in named modules), so
    the start sees a bare ``__main__``; restored right after (the start is synchronous)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main
