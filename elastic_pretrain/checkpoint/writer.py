"""Writing a rank's tensor files: in the trainer (a synchronous save) or in a persistent writer process that
reads a staging buffer kept across saves (an async save).

Each file is written in the writing process, checksummed as written, then fsynced (no process per file).
Instead of megatron's fork per save, whose copy-on-write page faults the next steps pay, the training thread
copies the tensors once into a reused shared-memory buffer for one writer started once (:class:`PersistentWriter`).
Kept over DCP's ``async_save``, whose sync save missed the ≥ 0.5x ``torch.save`` target (issue #34 item 3).
docs/checkpoints.md, "Async save" (Why not megatron's fork per save) and "Ours or the public APIs".
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from typing import Any, Literal

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
    TemporalAsyncCaller,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook

from elastic_pretrain.checkpoint.file_write import WriteBucket
from elastic_pretrain.checkpoint.helper_manager import protected_spawn
from elastic_pretrain.checkpoint.writer_main import Slot, writer_main

log = logging.getLogger(__name__)

AsyncWriter = Literal["persistent", "fork"]


# --- the staging buffer and the persistent writer --------------------------------------------------------


ALIGN = 64  # bytes: every staged tensor starts at a multiple (any dtype's alignment)


class Staging:
    """One shared-memory byte buffer holding every tensor the rank writes, kept while the shapes and dtypes
    stay the same. One buffer, not one per tensor: each shared tensor holds a file descriptor in both
    processes, and a large model's rank writes thousands of tensors."""

    def __init__(self) -> None:
        self.slots: list[Slot] = []
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []  # each slot as a tensor of the buffer (made once per buffer)
        self.allocated = 0  # how many times a buffer was allocated (the first save, and every change)

    def place(self, buckets: list[WriteBucket]) -> tuple[list[WriteBucket], torch.Tensor | None, list[torch.Tensor]]:
        """Where every tensor of ``buckets`` goes in the buffer; (the buckets with each tensor replaced by its
        :data:`Slot`, the buffer when newly allocated else None, the tensors to :meth:`copy` into it)."""
        live = [t for _, _, (_, items) in buckets for _, t in items]
        fresh = None
        if [(shape, dtype) for _, shape, dtype in self.slots] != [(tuple(t.shape), t.dtype) for t in live]:
            self.slots, offset = [], 0
            for t in live:
                self.slots.append((offset, tuple(t.shape), t.dtype))
                offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
            self.buffer = fresh = torch.empty(max(offset, 1), dtype=torch.uint8).share_memory_()
            self.views = [self.buffer[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                          for (o, _, _), t in zip(self.slots, live)]  # fmt: skip
            self.allocated += 1
        out, slots = [], iter(self.slots)
        for path, key, (bytes_data, items) in buckets:
            out.append((path, key, (bytes_data, [(item, next(slots)) for item, _ in items])))
        return out, fresh, live

    def copy(self, live: list[torch.Tensor]) -> None:
        """The snapshot: every tensor's values into its place in the buffer."""
        with torch.no_grad():
            for dst, src in zip(self.views, live):
                dst.copy_(src)

    def stage(self, buckets: list[WriteBucket]) -> tuple[list[WriteBucket], torch.Tensor | None]:
        """:meth:`place` and :meth:`copy` at once."""
        slots, fresh, live = self.place(buckets)
        self.copy(live)
        return slots, fresh


class PersistentWriter(AsyncCaller):
    """megatron's ``AsyncCaller`` with one writer process for the whole run and a reused staging buffer
    (module docstring). Takes the requests of :class:`~elastic_pretrain.checkpoint.snapshot.SnapshotWriter`."""

    def __init__(self, background: bool = True) -> None:
        self.staging = Staging()
        self.background = background  # copy CPU tensors into the buffer on a thread (module docstring)
        self.process: Any = None
        self.requests: Any = None
        self.done: Any = None
        self.in_flight: int | None = None  # call index of the write the process is doing
        self.results_queue: Any = None  # the request's (megatron's Manager queue)
        self.copying: threading.Thread | None = None  # the staging copy in progress
        self.copy_error: str | None = None
        self.guard: Any = None  # the optimizer-step hook that waits for that copy

    def _start(self) -> None:
        if self.process is not None and self.process.is_alive():
            return
        if self.process is not None:  # it died (its failed write was reported): a new one, sent fresh buffers
            log.warning("the checkpoint writer process died (exit code %s): starting another", self.process.exitcode)
            self.staging = Staging()
        ctx = torch.multiprocessing.get_context("spawn")  # torch's pickler: shared tensors go as handles
        self.requests, self.done = ctx.Queue(), ctx.Queue()
        # a dead writer leaves its queue's feeder thread blocked on a full pipe; joining it (at garbage
        # collection or exit) would hang the trainer. A live writer reads every message before it exits.
        self.requests.cancel_join_thread()
        self.process = ctx.Process(target=writer_main, args=(os.getpid(), self.requests, self.done), daemon=True)
        with protected_spawn():  # stop signals blocked (kept through exec), resource tracker first, no __main__ rerun
            self.process.start()
        # at exit without close(): SIGKILL it first — multiprocessing's exit handler (registered before this
        # one, so run after it) would SIGTERM the daemon, which has SIGTERM blocked, and wait for it forever
        atexit.register(self._kill)

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        from elastic_pretrain.checkpoint.snapshot import snapshot_request

        if async_req.async_fn is None:
            return  # nothing to write on this rank
        transform_list, rank, buckets, results_queue = snapshot_request(async_req)
        self._wait(blocking=True)  # one write at a time: the staging buffer is being read until it ends
        self._start()
        slots, fresh, live = self.staging.place(buckets)
        if fresh is not None:
            self.requests.put(("buffer", fresh))
        message = ("write", async_req.call_idx, transform_list, rank, slots, results_queue)
        self.in_flight, self.results_queue = async_req.call_idx, results_queue
        if self.background and all(t.device.type == "cpu" for t in live):
            # the snapshot on a thread, while the next step's forward and backward run (they read the saved
            # tensors, never write them); any optimizer step waits for it first
            self.copy_error = None
            self.guard = register_optimizer_step_pre_hook(self._before_optimizer_step)
            self.copying = threading.Thread(target=self._copy_and_send, args=(live, message), daemon=True,
                                            name="checkpoint-staging")  # fmt: skip
            self.copying.start()
        else:  # on a GPU the copy is the device-to-host copy, on this thread (see module docstring)
            self.staging.copy(live)
            self.requests.put(message)

    def _copy_and_send(self, live: list[torch.Tensor], message: tuple[Any, ...]) -> None:
        try:
            self.staging.copy(live)
        except BaseException as err:  # reported by staged() on the training thread
            self.copy_error = f"the checkpoint staging copy failed: {type(err).__name__}: {err}"
            return
        self.requests.put(message)

    def _before_optimizer_step(self, *_: Any) -> None:
        self.staged()

    def staged(self) -> None:
        """Wait until the snapshot of the save in flight is taken: after this the saved tensors may change.
        Every optimizer step calls it (a hook while a copy runs); so does anything else that writes them."""
        if self.copying is None:
            return
        self.copying.join()
        self.copying = None
        self.guard.remove()
        self.guard = None
        if self.copy_error is not None:  # the writer never got the request: fail the save as a failed write
            self.results_queue.put(RuntimeError(self.copy_error))
            self.in_flight = None

    def _wait(self, blocking: bool) -> bool:
        """Whether this rank's write is still running (``blocking``: wait for it). A writer that died or failed
        outside the write is reported as megatron's writer reports a failed write (into the results queue),
        so that finalize raises it on every rank instead of this rank alone."""
        self.staged()
        while self.in_flight is not None:
            try:
                call_idx, error = self.done.get(block=blocking, timeout=1.0)
            except queue.Empty:
                if self.process.is_alive():
                    if not blocking:
                        return True
                    continue
                code = self.process.exitcode
                call_idx, error = self.in_flight, f"the checkpoint writer process died (exit code {code})"
            if call_idx == self.in_flight:
                if error:
                    self.results_queue.put(RuntimeError(error))
                self.in_flight = None
        return False

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        running = self._wait(blocking)
        return not running if no_dist else bool(self.sync_all_async_calls(int(running)))

    def close(self, abort: bool = False) -> None:
        self.staged()
        if self.process is None:
            return
        if abort or not self.process.is_alive():
            self.process.kill()
        else:
            self.requests.put(None)
        self.process.join(timeout=60)
        self._kill()
        atexit.unregister(self._kill)
        self.process = None

    def _kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join()

    def __del__(self) -> None:  # megatron's AsyncCaller.__del__ raises; the process is a daemon
        pass


class WriterQueue(AsyncCallsQueue):
    """megatron's ``AsyncCallsQueue`` whose requests go to one :class:`PersistentWriter` (``persistent``) or,
    as megatron does, to a process forked per save (``fork``: the copy-on-write snapshot)."""

    def __init__(self, writer: AsyncWriter = "persistent", background: bool = True) -> None:
        super().__init__(persistent=False)
        self.writer_kind = writer
        self.writer = PersistentWriter(background) if writer == "persistent" else None

    def _get_async_caller(self) -> AsyncCaller:
        return self.writer if self.writer is not None else TemporalAsyncCaller()

    def staged(self) -> None:
        """Wait until the save in flight has its snapshot (PersistentWriter.staged; a fork has it at once)."""
        if self.writer is not None:
            self.writer.staged()

    def close(self, abort: bool = False) -> None:
        try:
            super().close(abort=abort)
        finally:
            if self.writer is not None:
                self.writer.close(abort=abort)
