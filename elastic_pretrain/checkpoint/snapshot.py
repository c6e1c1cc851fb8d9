"""What an asynchronous save blocks training for, and what keeps that small.

The writer must see the tensors as they were at the hand-off, whatever training does to them afterwards.
:class:`SnapshotWriter` hands views (every parameter, every Adam box) to the writer without megatron's clone,
each written as just its elements; :class:`SaveStrategies` keeps megatron's cached distribution and save plan
while the state dict's *structure* (a fingerprint agreed by one integer all-reduce) is unchanged. Kept over
megatron's public ``dist_checkpointing.save``, which took 3.7x our sync save's time (issue #34 item 3).
docs/checkpoints.md, "Async save" ("What the training thread does") and "Ours or the public APIs".
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from elastic_pretrain.checkpoint.file_write import write_buckets
from elastic_pretrain.internals import write_preloaded_data, write_results_queue

WriteBucket = tuple[Any, str, tuple[list[Any], list[Any]]]  # filesystem_async.WriteBucket: one file's writes


def is_view(t: torch.Tensor) -> bool:
    """A CPU tensor that does not own its whole storage (``torch.save`` would write all of it)."""
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


def elements_only(t: torch.Tensor) -> torch.Tensor:
    """``t``, or when it is a CPU view, a tensor over the same memory whose storage is just its elements, so
    that ``torch.save`` writes those and no more — no copy (byte-identical to saving a clone; tested). A view
    that is not contiguous is cloned."""
    if t.device.type != "cpu" or not is_view(t):
        return t
    if not t.is_contiguous():
        return t.clone()
    flat = t.detach().reshape(-1).view(torch.uint8).numpy()  # bytes of just the elements (numpy: any dtype)
    return torch.from_numpy(flat).view(t.dtype).view(t.shape)


def compact(buckets: list[WriteBucket]) -> list[WriteBucket]:
    """``buckets`` with every CPU view replaced by a tensor of just its elements (what the file holds)."""
    out = []
    for path, storage_key, (bytes_data, tensor_data) in buckets:
        tensors = [(item, elements_only(t)) for item, t in tensor_data]
        out.append((path, storage_key, (bytes_data, tensors)))
    return out


def _write_snapshot(
    parent_pid: int, transform_list: list[Any], use_msc: bool, rank: int, buckets: list[WriteBucket], results_queue: Any
) -> None:
    """The writer: compact the views (in a forked writer: from its copy-on-write snapshot), then write every
    file in this process, checksumming it as it is written (checkpoint/writer.py). In a forked writer torch
    gets one thread: a copy there must not enter an OpenMP pool that the fork left behind (a synchronous save
    runs this in the trainer itself, whose threads stay as they are)."""
    forked = os.getpid() != parent_pid
    if forked:
        torch.set_num_threads(1)
    if use_msc:  # multistorageclient URLs: megatron's writer (forks per file; the commit checksums the files)
        write_preloaded_data()(transform_list, use_msc, rank, compact(buckets), results_queue)
        return
    write_buckets(transform_list, rank, compact(buckets), results_queue, parallel=not forked)


def snapshot_request(request: Any) -> tuple[list[Any], int, list[WriteBucket], Any]:
    """(transform list, rank, write buckets, results queue) of an async request :class:`SnapshotWriter`
    made, for a writer that runs it elsewhere (checkpoint/writer.py: PersistentWriter)."""
    fn = request.async_fn
    if not (isinstance(fn, partial) and fn.func is _write_snapshot and len(fn.args) == 3):
        raise RuntimeError(f"not a SnapshotWriter request ({fn!r}): save with checkpoint/parallel_io.py's strategies")
    _, transform_list, use_msc = fn.args
    if use_msc:
        raise RuntimeError("checkpoint.async_writer=persistent does not write multistorageclient URLs: use fork")
    rank, buckets, results_queue = request.async_fn_args
    return transform_list, rank, buckets, results_queue


class SnapshotWriter(filesystem_async.FileSystemWriterAsync):
    """megatron-core 0.16.1's ``FileSystemWriterAsync`` without the clone of CPU views before the fork; the
    writer compacts them instead (:func:`_write_snapshot`)."""

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        # megatron's prepare_write_data (filesystem_async.py), with ``ten.detach()`` for ``_clone_if_needed``
        bins = self.thread_count // 2 if self.separation_hint is not None else self.thread_count
        item_buckets = filesystem_async._split_by_size_and_type(bins, plan.items)
        prefix = plan.storage_data.prefix
        self.write_buckets: list[WriteBucket] = []  # type: ignore[misc]
        for group_name, group_buckets in filesystem_async._split_by_separation_hint(
            item_buckets, self.separation_hint
        ).items():
            for bucket in group_buckets:
                bytes_data = [(i, planner.resolve_data(i)) for i in bucket if i.type == WriteItemType.BYTE_IO]
                tensor_data = [(i, planner.resolve_data(i).detach()) for i in bucket if i.type != WriteItemType.BYTE_IO]
                if bytes_data or tensor_data:
                    name = f"{group_name}{prefix}{len(self.write_buckets)}{DEFAULT_SUFFIX}"
                    path = os.path.join(self.checkpoint_dir, name)
                    self.write_buckets.append((path, name, (bytes_data, tensor_data)))
        assert len(self.write_buckets) <= self.thread_count, (len(self.write_buckets), self.thread_count)
        self.results_queue = write_results_queue() if self.write_buckets else None
        global _last_writer
        _last_writer = self

    def get_save_function_and_args(self) -> tuple[Any, Any, list[Any]]:
        save_fn, preload_fn, args = super().get_save_function_and_args()
        if save_fn is None:
            return save_fn, preload_fn, args
        transform_list = [self.transforms] if hasattr(self, "transforms") else []
        return partial(_write_snapshot, os.getpid(), transform_list, self.use_msc), preload_fn, args

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata`` as the first save of a structure does. megatron keeps every rank's local plan
        in it (``all_local_plans``); a cached plan has been through the writer and carries its file prefix
        (``_StoragePrefix``), which our loader's unpickler does not admit (checkpoint/safe_load.py) and no
        reader needs: the plans are written without it."""
        plans = getattr(metadata, "all_local_plans", None)
        if plans:
            metadata = copy.copy(metadata)
            metadata.all_local_plans = [dataclasses.replace(p, storage_data=None) for p in plans]  # type: ignore[attr-defined]
        super().finish(metadata, results)


@contextlib.contextmanager
def _writer(cls: type) -> Iterator[None]:
    """megatron's ``TorchDistSaveShardedStrategy.async_save`` builds its writer from the module's
    ``FileSystemWriterAsync``: that name is ``cls`` for the duration (saves run on the training thread only)."""
    if getattr(mcore_torch, "FileSystemWriterAsync", None) is not filesystem_async.FileSystemWriterAsync:
        raise RuntimeError("megatron-core's torch strategy no longer builds FileSystemWriterAsync: update snapshot.py")
    mcore_torch.FileSystemWriterAsync = cls  # type: ignore[misc]
    try:
        yield
    finally:
        mcore_torch.FileSystemWriterAsync = filesystem_async.FileSystemWriterAsync  # type: ignore[misc]


_NONES: dict[int, bytes] = {}  # torch.save([None] * n), by n


def _torch_save(obj: Any) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


_last_writer: SnapshotWriter | None = None  # the writer megatron's async_save made last (training thread only)


@dataclasses.dataclass
class _Plan:
    """What a save of one structure writes, from the last full save: the files' write items and the tensors
    they read (views of the live parameters and Adam state), and where those tensors' memory was."""

    memory: list[tuple[Any, ...]]
    buckets: list[WriteBucket]


def _memory(sharded_state_dict: Any) -> list[tuple[Any, ...]]:
    """Where every tensor of a (preprocessed) sharded state dict is: address, shape, strides, dtype, device."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for v in nested_values(sharded_state_dict)
            if isinstance(v, ShardedTensor) and isinstance(t := v.data, torch.Tensor)]  # fmt: skip


class SnapshotSaveStrategy(TorchDistSaveShardedStrategy):
    """The torch_dist save strategy with :class:`SnapshotWriter` (a synchronous save is the same request,
    executed at once), and a **repeat save** once megatron has validated its cached plan for the structure.

    A repeat save skips megatron's translation to torch DCP, planning and write buckets — a third of what an
    async save costs the training thread: the state dict's structure is the one the plan was made for
    (:class:`SaveStrategies` checked it on every rank) and every tensor is at the same address with the same
    shape and strides as in the last full save (checked here), so the last full save's write items and
    tensors — views of that same memory — are this save's, and only the sharded objects (values: pickled
    again) and the file names (this checkpoint's directory) change. Files byte-identical to a full save's
    (tested); ``.metadata`` is megatron's cached global metadata, as in megatron's own cached saves. A tensor
    anywhere at another address (a parameter or Adam state reallocated) takes the full path."""

    plan: _Plan | None = None
    repeats = 0  # saves that took the repeat path

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        global _last_writer
        memory = _memory(sharded_state_dict)
        if self.plan is not None and self.plan.memory == memory and self.validated_cache_reuse:
            self.repeats += 1
            return self._repeat(sharded_state_dict, checkpoint_dir, self.plan)
        _last_writer = None
        with _writer(SnapshotWriter):
            request = super().async_save(sharded_state_dict, checkpoint_dir)
        made, _last_writer = _last_writer, None
        # megatron reuses its plan once a second save planned the same (validated_cache_reuse): so do we
        ready = self.validated_cache_reuse and not self.use_msc_enabled()
        self.plan = _Plan(memory, list(made.write_buckets or [])) if made is not None and ready else None
        return request

    @staticmethod
    def use_msc_enabled() -> bool:
        from megatron.core.msc_utils import MultiStorageClientFeature

        return bool(MultiStorageClientFeature.is_enabled())

    def _repeat(self, sharded_state_dict: Any, checkpoint_dir: Any, plan: _Plan) -> Any:
        """megatron's async_save request for the cached plan, without translating or planning again."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, is_main_replica
        from megatron.core.dist_checkpointing.strategies.state_dict_saver import _DistWrapper

        objects: dict[str, list[Any]] = {}  # megatron's grouping (_replace_state_dict_keys_with_sharded_keys)
        for v in nested_values(sharded_state_dict):
            if isinstance(v, ShardedObject) and (is_main_replica(v.replica_id) or not self.keep_only_main_replica):
                objects.setdefault(v.unique_key, []).append(v.data)

        def pickled(key: str) -> io.BytesIO:  # megatron's _mcore_to_torch_sharded_object
            data = objects[key]
            if all(d is None for d in data):  # a layer without extra state (every one on a CPU): bytes kept
                if (kept := _NONES.get(len(data))) is None:
                    kept = _NONES[len(data)] = _torch_save(data)
                return io.BytesIO(kept)
            return io.BytesIO(_torch_save(data))

        writer = SnapshotWriter(checkpoint_dir, separation_hint=self.separation_hint, thread_count=self.thread_count,
                                use_msc=False)  # fmt: skip
        coordinator = 0
        dist_wrapper = _DistWrapper(None, True, coordinator)
        writer.set_up_storage_writer(dist_wrapper.is_coordinator)
        os.makedirs(checkpoint_dir, exist_ok=True)
        writer.write_buckets = [
            (os.path.join(writer.checkpoint_dir, name), name,
             ([(item, pickled(item.index.fqn)) for item, _ in bytes_data], tensor_data))
            for _, name, (bytes_data, tensor_data) in plan.buckets
        ]  # fmt: skip
        writer.results_queue = write_results_queue() if writer.write_buckets else None
        metadata = self.cached_global_metadata if dist_wrapper.is_coordinator else None
        # megatron's private method, called through its class so that tests/test_private_names.py sees it
        return TorchDistSaveShardedStrategy._get_save_and_finalize_callbacks(
            self, writer, (writer, metadata, dist_wrapper)
        )


_FIELDS: dict[type, tuple[str, ...]] = {}  # a sharded class's dataclass fields, but its data


def _meta(state: ShardedBase) -> tuple[Any, ...]:
    """``state``'s metadata: every dataclass field but the data and callables (a factory's functions), as
    values where they compare by value, else as their repr."""
    names = _FIELDS.get(type(state))
    if names is None:
        names = _FIELDS[type(state)] = tuple(f.name for f in dataclasses.fields(state) if f.name != "data")  # type: ignore[arg-type]
    out = []
    for name in names:
        v = getattr(state, name)
        if not callable(v) or isinstance(v, torch.dtype):
            out.append((name, v if isinstance(v, _PLAIN) else repr(v)))
    return tuple(out)


_PLAIN = (str, int, float, bool, tuple, type(None), torch.dtype)  # (a tuple of these: offsets, replica ids)


def fingerprint(state: Any, path: str = "") -> list[tuple[Any, ...]]:
    """Everything about ``state`` (a sharded state dict) that validation, distribution and planning read:
    the nesting, every sharded entry's metadata and its data's shape and dtype — not the values."""
    if isinstance(state, dict):
        return [row for k in sorted(state, key=str) for row in fingerprint(state[k], f"{path}/{k}")]
    if isinstance(state, list):
        return [row for i, v in enumerate(state) for row in fingerprint(v, f"{path}/{i}")]
    if isinstance(state, ShardedBase):
        data = getattr(state, "data", None)
        shape = (tuple(data.shape), data.dtype) if isinstance(data, torch.Tensor) else None
        return [(path, type(state).__name__, _meta(state), shape)]
    return [(path, type(state).__name__)]


def _everywhere(flag: bool, group: Any) -> bool:
    """True when ``flag`` is True on every rank (one integer all-reduce). Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


class SaveStrategies:
    """One save strategy per state-dict structure: reused (with megatron's cached write distribution and save
    plan, without re-validating the sharding) while every rank's structure is the one it was built for.

    ``make(cached)``: a fresh strategy; ``group``: the gloo group that agrees on reuse (every rank)."""

    def __init__(self, make: Callable[[], Any], group: Callable[[], Any] = lambda: None) -> None:
        self.make, self.group = make, group
        self.strategy: Any = None
        self.structure: list[tuple[Any, ...]] | None = None
        self.rebuilt = 0  # how many times the structure was (re)validated: the first save, and every change

    def for_state(self, sharded_state_dict: Any) -> tuple[Any, bool]:
        """(the strategy to save ``sharded_state_dict`` with, whether to validate its sharding). Collective."""
        structure = fingerprint(sharded_state_dict)
        if _everywhere(self.strategy is not None and structure == self.structure, self.group()):
            return self.strategy, False
        self.strategy, self.structure = self.make(), structure
        self.rebuilt += 1
        return self.strategy, True
