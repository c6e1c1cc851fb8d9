"""Read-ahead of the training batches: step k+1's micro-batches are read (and pinned, with CUDA) in one
background thread while step k runs (issue 31, item 3; ``data.prefetch``).

On a cluster file system a shard read takes milliseconds to seconds, which would keep the GPU idle.
:class:`PrefetchedBatches` wraps :class:`~elastic_pretrain.data.loader.TokenBatches` with the same contract;
the decision a reader must know: its ``state_dict`` is what training *consumed*, never what was read ahead, so
resume stays exact, and a read ahead that does not match the next request is dropped (a lost read, never a
wrong batch). docs/data.md, "Reading ahead (`data.prefetch`)".
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
import weakref
from collections import deque
from typing import Any

import torch

from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.loader import TokenBatches

# what one step reads: None for this rank's share (next_step), else the global slots (next_step_slots)
Request = tuple[int, ...] | None


@dataclasses.dataclass
class _Read:
    """One step's read, queued for the reader thread (or done in place with ``data.prefetch: 0``)."""

    request: Request
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    cancelled: bool = False
    tokens: list[torch.Tensor] | None = None
    state: dict[str, Any] | None = None  # the loader's state once these batches are consumed
    error: Exception | None = None


def _read(batches: TokenBatches, read: _Read, pin: bool) -> None:
    """Run ``read`` on ``batches`` (which it advances); the outcome, error included, goes into ``read``."""
    try:
        if not read.cancelled:
            tokens = batches.next_step() if read.request is None else batches.next_step_slots(list(read.request))
            read.tokens = [t.pin_memory() for t in tokens] if pin else tokens
            read.state = batches.state_dict()
    except Exception as e:  # re-raised on the training thread by the call that takes this read
        read.error = e
    finally:
        read.done.set()


def _reader(batches: TokenBatches, reads: queue.SimpleQueue[_Read | None], device: int | None) -> None:
    """The reader thread: the queued reads in order, until a ``None``."""
    if device is not None:
        torch.cuda.set_device(device)  # pinned memory is allocated through the current device's context
    while (read := reads.get()) is not None:
        _read(batches, read, device is not None)


class PrefetchedBatches:
    """``batches`` with up to ``depth`` steps read ahead in a background thread (0: read on the calling thread)."""

    def __init__(self, batches: TokenBatches, *, depth: int) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth {depth} must be >= 0")
        self.batches, self.depth = batches, depth
        # the device the training thread uses (parallel/mesh.py set it); None: no CUDA, nothing pinned
        self.device: int | None = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._ahead: deque[_Read] = deque()  # reads queued or done, not yet handed out, in order
        self._consumed = batches.state_dict()
        self._reads: queue.SimpleQueue[_Read | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop = weakref.finalize(self, self._reads.put, None)  # collected or at exit: the thread ends

    # --- the loader's contract ---------------------------------------------------------------------------
    @property
    def micro_batch_size(self) -> int:
        return self.batches.micro_batch_size

    @property
    def num_micro_batches(self) -> int:
        return self.batches.num_micro_batches

    @property
    def global_batch_size(self) -> int:
        return self.batches.global_batch_size

    check_state = staticmethod(TokenBatches.check_state)

    def next_step(self) -> list[torch.Tensor]:
        """This rank's micro-batches of the next step (as :meth:`TokenBatches.next_step`); reads ahead."""
        tokens = self._take(None)
        self._fill([None] * self.depth)
        return tokens

    def next_step_slots(self, slots: list[int], *, ahead: list[int] | None = None) -> list[torch.Tensor]:
        """Slots ``slots`` of the next step (as :meth:`TokenBatches.next_step_slots`); then reads the step
        after's ``ahead`` slots while this step runs (None: nothing is read ahead)."""
        tokens = self._take(tuple(slots))
        upcoming: list[Request] = [tuple(ahead)] if ahead is not None else []
        self._fill(upcoming[: self.depth])
        return tokens

    def state_dict(self) -> dict[str, Any]:
        """The state after the last batches handed out (what training consumed), not the reader's."""
        return copy.deepcopy(self._consumed)

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Continue from ``state`` (as :meth:`TokenBatches.load_state_dict`); the reads ahead are dropped."""
        self._drop()
        self.batches.load_state_dict(state, strict=strict)
        self._consumed = self.batches.state_dict()

    def close(self) -> None:
        """Drop the reads ahead and end the reader thread (after the read in progress); later calls read in place."""
        self._drop()
        self.depth = 0
        self._stop()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # --- reading ahead -----------------------------------------------------------------------------------
    def _take(self, request: Request) -> list[torch.Tensor]:
        if self._ahead and self._ahead[0].request != request:
            self._drop()  # read ahead for another request (a phase switch dealt other slots): read it again
        read = self._ahead.popleft() if self._ahead else None
        if read is None:
            read = _Read(request)
            _read(self.batches, read, self.device is not None)
        read.done.wait()
        if read.error is not None:
            self._drop()  # the loader goes back to the consumed position: a retry reads the same step
            raise read.error
        assert read.tokens is not None and read.state is not None
        self._consumed = read.state
        return read.tokens

    def _fill(self, upcoming: list[Request]) -> None:
        """Have exactly ``upcoming`` (the next steps' requests, in order) read ahead."""
        queued = [r.request for r in self._ahead]
        if queued != upcoming[: len(queued)]:
            self._drop()
            queued = []
        for request in upcoming[len(queued) :]:
            read = _Read(request)
            self._ahead.append(read)
            self._start().put(read)

    def _start(self) -> queue.SimpleQueue[_Read | None]:
        if self._thread is None:
            self._thread = threading.Thread(target=_reader, args=(self.batches, self._reads, self.device),
                                            name="prefetch-batches", daemon=True)  # fmt: skip
            self._thread.start()
        return self._reads

    def _drop(self) -> None:
        """Forget the reads ahead: cancel the queued ones, wait for the one in progress (it moves the loader),
        and put the loader back at the consumed position (also after a failed read, which may have moved it)."""
        for read in self._ahead:
            read.cancelled = True
        for read in self._ahead:
            read.done.wait()
        self._ahead.clear()
        self.batches.position = self._consumed["position"]


def prefetched(
    cfg: DataConfig, *, micro_batch_size: int, num_micro_batches: int, dp_rank: int, dp_size: int, seed: int
) -> PrefetchedBatches:
    """The training loop's batches: a :class:`TokenBatches` read ``cfg.prefetch`` steps ahead."""
    batches = TokenBatches(
        cfg,
        micro_batch_size=micro_batch_size,
        num_micro_batches=num_micro_batches,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
    )
    return PrefetchedBatches(batches, depth=cfg.prefetch)
