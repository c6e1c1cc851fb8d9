"""Parallel checkpoint I/O: every rank writes, reads and checksums only its share.

Each DP rank saves and loads only its own Adam-state boxes; a replicated tensor is written by one rank of its
DP group and, on resume, read by one and broadcast (megatron-core's ``FullyParallel{Save,Load}StrategyWrapper``);
checksum verification splits the files over all ranks. The checkpoint collectives run in a gloo group of their
own with ``checkpoint.io_timeout_minutes``, apart from the training collectives' timeout.
docs/checkpoints.md, "Parallel I/O (`checkpoint/parallel_io.py`)".
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

from elastic_pretrain.checkpoint.snapshot import SaveStrategies, SnapshotSaveStrategy
from elastic_pretrain.checkpoint.store import verify
from elastic_pretrain.errors import UserError

_io_group: Any = None
_io_timeout_minutes: float | None = None


def io_group(timeout_minutes: float) -> Any:
    """The gloo group of checkpoint collectives (every rank), created on first use. Collective then."""
    global _io_group, _io_timeout_minutes
    if not dist.is_initialized():
        return None
    if _io_group is None or _io_timeout_minutes != timeout_minutes:
        from elastic_pretrain.parallel.strict import intended_gloo

        # gloo on GPU machines too: its collectives take CPU tensors (strict device mode is told so)
        _io_group = intended_gloo(dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes)))
        _io_timeout_minutes = timeout_minutes
    return _io_group


def reset() -> None:
    """Forget the group (teardown destroys every process group)."""
    global _io_group, _io_timeout_minutes
    _io_group, _io_timeout_minutes = None, None


def _dp_group() -> Any:
    from elastic_pretrain.parallel.mesh import data_parallel_group

    return data_parallel_group()


def save_strategy(base: Any = None, cached: bool = False) -> Any:
    """``base`` (default: the trainer's torch_dist strategy) with its writes spread over the DP group.

    ``cached``: the trainer's strategy for one state-dict structure (checkpoint/snapshot.py): its write
    distribution and save plan are computed on the first save and reused by the next ones."""
    if base is None:
        base = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    if not dist.is_initialized() or dist.get_world_size(_dp_group()) == 1:
        return base
    return FullyParallelSaveStrategyWrapper(base, _dp_group(), do_cache_distribution=cached)


def trainer_saves(timeout_minutes: float = 30.0) -> SaveStrategies:
    """The save strategies of a run's checkpoints: the torch_dist format written through
    :class:`~elastic_pretrain.checkpoint.snapshot.SnapshotWriter`, one strategy per state-dict structure,
    reuse agreed over the checkpoint I/O group."""

    def make() -> Any:
        base = SnapshotSaveStrategy("torch_dist", 1, thread_count=1, cached_metadata=True)
        return save_strategy(base, cached=True)

    return SaveStrategies(make, group=lambda: io_group(timeout_minutes))


def load_strategy() -> Any:
    """A torch_dist load strategy whose reads are spread over the data-parallel group."""
    base = TorchDistLoadShardedStrategy()
    if not dist.is_initialized() or dist.get_world_size(_dp_group()) == 1:
        return base
    return FullyParallelLoadStrategyWrapper(base, _dp_group())


def verify_spread(ckpt: Path, timeout_minutes: float) -> None:
    """Every rank checks its share of ``ckpt``'s files (size + CRC32); every rank raises the first error
    found by any rank. Collective over the checkpoint I/O group."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = None
    try:
        verify(ckpt, share=(rank, world))
    except UserError as err:
        error = str(err)
    errors: list[Any] = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error, group=io_group(timeout_minutes))
    first = next((e for e in errors if e), None)
    if first:
        raise UserError(first)
