"""Loading a checkpoint never unpickles arbitrary objects.

torch.distributed.checkpoint (under megatron's ``torch_dist`` format) reads its ``.metadata`` file
with plain ``pickle.load`` and every byte item (megatron's ``_extra_state`` objects) with
``torch.load(weights_only=False)``. :func:`restricted_unpickling` swaps both for the duration of a
load: the metadata goes through an unpickler that accepts only the checkpoint-metadata classes of
torch.distributed.checkpoint plus ``torch.Size``/dtypes, and byte items load with
``weights_only=True``. megatron's own ``common.pt`` already loads through ``torch.load``'s default
(``weights_only=True`` since torch 2.6). Everything else we write is JSON or plain tensors.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import default_planner, filesystem

_ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)
_ALLOWED_NAMES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "slice"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type) or module.endswith("metadata"):
                return obj
        if (module, name) in _ALLOWED_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class _SafePickle:
    """Stands in for the ``pickle`` module inside torch.distributed.checkpoint.filesystem."""

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)

    @staticmethod
    def load(f: Any) -> Any:
        return _MetadataUnpickler(f).load()


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
