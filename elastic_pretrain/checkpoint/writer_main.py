"""The persistent checkpoint writer's process (checkpoint/writer.py: PersistentWriter spawns it). A module of
its own with no heavy imports: the spawned interpreter imports it to find :func:`writer_main`, which ties the
process to its rank's life before anything slow (torch) is imported."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from elastic_pretrain.checkpoint.helper_manager import die_with_parent

if TYPE_CHECKING:
    import torch

Slot = tuple[int, tuple[int, ...], "torch.dtype"]  # a staged tensor: (byte offset in the buffer, shape, dtype)
WRITER_NICE = 10  # the writer's niceness above its rank's


def writer_main(parent_pid: int, requests: Any, done: Any) -> None:
    """The persistent writer: takes staging buffers and write requests until ``None``."""
    die_with_parent(parent_pid)  # before importing torch (seconds on a loaded node): a rank killed then takes it along
    import torch

    from elastic_pretrain.checkpoint.file_write import write_buckets

    torch.set_num_threads(1)
    os.nice(WRITER_NICE)  # training first: the write has until the next save (which waits for it) to finish
    buffer: Any = None  # the staging buffer (shared memory) and a memoryview of it
    view: Any = None
    while (msg := requests.get()) is not None:
        if msg[0] == "buffer":
            buffer = msg[1]
            view = memoryview(buffer.numpy())
            continue
        _, call_idx, transform_list, rank, slots, results_queue = msg
        error = None
        try:
            buckets = [(p, k, (b, [(item, staged_tensor(view, s)) for item, s in items])) for p, k, (b, items) in slots]
            write_buckets(transform_list, rank, buckets, results_queue, parallel=False)
        except BaseException as err:  # write_buckets reports its own errors; this is anything else
            error = f"{type(err).__name__}: {err}"
        done.put((call_idx, error))


def staged_tensor(view: memoryview, slot: Slot) -> torch.Tensor:
    """The writer's tensor of ``slot`` in the buffer (``view``: a memoryview of it): the buffer's memory, but
    a storage of just its elements, so that ``torch.save`` writes those and no more."""
    import torch

    offset, shape, dtype = slot
    count = 1
    for n in shape:
        count *= n
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(view, dtype=dtype, count=count, offset=offset).view(shape)
