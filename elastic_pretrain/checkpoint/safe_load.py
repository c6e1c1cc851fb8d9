"""Loading a checkpoint never unpickles arbitrary objects.

DCP reads ``.metadata`` with plain ``pickle.load`` and byte items with a full-pickle ``torch.load``;
:func:`restricted_unpickling` swaps both for a load: an unpickler resolving only the exact ``(module, name)``
pairs a DCP metadata file holds — exact, because protocol 4 resolves a dotted name as an attribute path — and
``weights_only=True``. :func:`load_sharded` is the one caller of ``dist_checkpointing.load`` on a checkpoint
from disk, and turns DCP's ``CheckpointException`` (a ``BaseException``) into a one-line :class:`UserError`.
docs/security.md, "Checkpoint metadata (`model_optim/.metadata`, byte items, `common.pt`)".
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import default_planner, filesystem
from torch.distributed.checkpoint.api import CheckpointException

from elastic_pretrain.checkpoint.spec_keys import map_spec_keys
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import inside, is_plain_name

log = logging.getLogger(__name__)

_DCP = "torch.distributed.checkpoint"
METADATA_FILE = ".metadata"  # DCP's name (filesystem._metadata_fn)
# Every global a real metadata file refers to (torch 2.13 DCP, megatron-core 0.16.1 torch_dist,
# sync and async saves), and nothing else. Constructing any of these has no side effect.
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            (f"{_DCP}.metadata", n)
            for n in (
                "Metadata",
                "MetadataIndex",
                "ChunkStorageMetadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "TensorProperties",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        *(
            (f"{_DCP}.planner", n)
            for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
        ),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # looks a layout up by name in torch's namespace
        ("collections", "OrderedDict"),
        ("builtins", "slice"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a plain DCP save
        ("pathlib", "PurePosixPath"),
        *(("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # "." in name: protocol 4 would walk attributes (module.os.system); never needed by metadata
        if "." not in name and (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class _SafePickle:
    """Stands in for the ``pickle`` module inside torch.distributed.checkpoint.filesystem."""

    def __getattr__(self, name: str) -> Any:
        if "load" in name.lower() or "unpickler" in name.lower():  # only our load below reads a pickle
            raise AttributeError(f"pickle.{name} is not available while loading a checkpoint")
        return getattr(pickle, name)

    @staticmethod
    def load(f: Any) -> Any:
        return _MetadataUnpickler(f).load()


def load_metadata(f: Any) -> Any:
    """A DCP ``.metadata`` file's object through the restricted unpickler (used by tools and tests)."""
    return _MetadataUnpickler(f).load()


def _check_metadata(meta: Any, path: Path) -> None:
    """The metadata is DCP's, and every data file it names is a plain file name inside ``path``:
    ``../../home/you/.ssh/id_rsa`` would be read into the weights (and saved again with them)."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(meta, Metadata):
        raise ValueError(f"holds a {type(meta).__name__}, not checkpoint metadata")
    storage = meta.storage_data if isinstance(meta.storage_data, dict) else {}
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not is_plain_name(rel) or not inside(path / str(rel), path):
            raise ValueError(f"names the data file {rel!r}, which is not a file inside the checkpoint")
    _check_extents(meta, path)


def _check_extents(meta: Any, path: Path) -> None:
    """Every item the metadata places in a data file lies inside that file, and the tensors it declares fit
    in the files (DCP writes each tensor's bytes whole): so the sizes in ``.metadata`` are bounded by what is
    on disk, and a model built to match them (:func:`declared_tensors`) is too."""
    sizes: dict[str, int] = {}
    for info in meta.storage_data.values():
        rel = info.relative_path
        if rel not in sizes:
            data = path / rel
            sizes[rel] = data.stat().st_size if data.is_file() else -1
            if sizes[rel] < 0:
                raise ValueError(f"names the data file {rel!r}, which is missing or not a regular file")
        offset, length = info.offset, info.length
        ints = isinstance(offset, int) and isinstance(length, int)
        if not (ints and min(offset, length) >= 0 and offset + length <= sizes[rel]):
            raise ValueError(f"places {length!r} bytes at {offset!r} in {rel} ({sizes[rel]:,} bytes)")
    declared = sum(math.prod(md.size) * md.properties.dtype.itemsize for md in _tensors(meta).values())
    if declared > sum(sizes.values()):
        raise ValueError(
            f"declares {declared:,} bytes of tensors, but its data files hold {sum(sizes.values()):,} bytes"
        )


def _tensors(meta: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: md for k, md in meta.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}


def declared_tensors(path: Path) -> dict[str, int]:
    """Element count per tensor of the checkpoint's ``.metadata`` in ``path`` (checked as every load checks
    it: restricted unpickling, data files inside ``path``, sizes within the files); a one-line UserError
    otherwise. Reads the metadata only (kilobytes), no tensor."""
    try:
        with open(path / METADATA_FILE, "rb") as f:
            meta = load_metadata(f)
        _check_metadata(meta, path)
    except Exception as err:
        raise _metadata_error(path, err) from None
    return {k: math.prod(md.size) for k, md in _tensors(meta).items()}


def _metadata_error(path: Path, err: BaseException) -> UserError:
    return UserError(
        f"{path / METADATA_FILE}: cannot load ({_one_line(err)}); the checkpoint is damaged or not one "
        "of ours: use another checkpoint"
    )


def _load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
    obj = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


@contextlib.contextmanager
def restricted_unpickling() -> Iterator[None]:
    """Within this block, checkpoint metadata and byte items cannot instantiate arbitrary objects."""
    saved_pickle, saved_load_bytes = filesystem.pickle, default_planner.DefaultLoadPlanner.load_bytes
    filesystem.pickle = _SafePickle()  # type: ignore[assignment]
    default_planner.DefaultLoadPlanner.load_bytes = _load_bytes  # type: ignore[method-assign]
    try:
        yield
    finally:
        filesystem.pickle = saved_pickle
        default_planner.DefaultLoadPlanner.load_bytes = saved_load_bytes  # type: ignore[method-assign]


def _one_line(err: BaseException) -> str:
    """The root cause of a load failure in one line (DCP wraps per-rank failures with tracebacks)."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1]}" if text else type(err).__name__


# what a collective says when a peer process died or hung (gloo, NCCL, the store): not a user error
_COMM_MARKERS = (
    "gloo/transport",
    "Connection reset by peer",
    "Connection closed by peer",
    "NCCL",
    "DistNetworkError",
    "DistBackendError",
    "Socket Timeout",
    "timed out",
)


def is_comm_failure(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps) is a broken collective — a peer rank died or hung — rather than a
    damaged checkpoint. Such a load failure is re-raised as is (the job fails and Slurm requeues it), not
    reported as a user error (which stops the job for good: "use another checkpoint" would be wrong)."""
    seen: BaseException | None = err
    for _ in range(8):  # the cause chain: DCP's CheckpointException wraps each rank's exception
        if seen is None:
            return False
        if isinstance(seen, torch.distributed.DistError) or any(m in str(seen) for m in _COMM_MARKERS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def load_sharded(sharded_state_dict: dict[str, Any], path: Path, *, what: str, strategy: Any = None) -> dict[str, Any]:
    """``dist_checkpointing.load`` of ``path`` with restricted unpickling; any failure is one UserError
    naming ``path`` and ``what`` was being loaded. ``strategy``: megatron's sharded load strategy (e.g. the
    fully parallel one of ``checkpoint/parallel_io.py``); None is megatron's default. Collective."""
    from megatron.core import dist_checkpointing

    # First the metadata on its own: inside DCP a refusal is logged with a traceback before it is raised
    try:
        with open(path / METADATA_FILE, "rb") as f:
            meta = load_metadata(f)
        _check_metadata(meta, path)
    except Exception as err:  # missing, truncated, a refused global, a data file outside, ...
        raise _metadata_error(path, err) from None
    # a checkpoint of the other layer spec (TE on a GPU, local on CPU) names MoE pre-MLP norms its way
    if renamed := map_spec_keys(sharded_state_dict, meta.state_dict_metadata.keys()):
        log.info("%s: %d keys read under the other layer spec's names (e.g. %s as %s)", path, len(renamed), *renamed[0])
    try:
        with torch.no_grad(), restricted_unpickling():
            return dict(dist_checkpointing.load(sharded_state_dict, str(path), sharded_strategy=strategy))
    except UserError:
        raise
    except (Exception, CheckpointException) as err:  # megatron/DCP wrap the cause; keep one line
        if is_comm_failure(err):  # a peer died mid-load: not the checkpoint's fault, let the job requeue
            raise
        raise UserError(
            f"{path}: cannot load {what} ({_one_line(err)}); the checkpoint is damaged or not one of ours: "
            "use another checkpoint"
        ) from err
