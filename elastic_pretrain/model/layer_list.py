"""A ``ModuleList`` that megatron-core's distributed checkpointing recurses into.

megatron's default ``sharded_state_dict`` calls ``sharded_state_dict`` on each child that has one
and treats every other child as plain, fully *replicated* tensors. A plain ``torch.nn.ModuleList``
has no such method, so the TransformerLayers inside it would lose their tensor-parallel and
expert-parallel sharding: every TP/EP rank would save its own slice under the same key and shape,
only rank 0's slice would be written, and the rest would be dropped without an error.
:class:`LayerList` keys each element ``<prefix><index>.`` and asks it for its own sharded state.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.transformer.utils import sharded_state_dict_default


class LayerList(torch.nn.ModuleList):
    """``torch.nn.ModuleList`` + megatron ``sharded_state_dict`` (same state-dict keys).

    ``start``: the global index of the first element. A pipeline stage holds layers
    ``start .. start+len-1`` of the whole model and keys them by their global index (``core.2.…``), so
    a checkpoint's keys do not depend on the pipeline layout. Positional indexing stays local.
    """

    def __init__(self, modules: list[torch.nn.Module] | None = None, *, start: int = 0) -> None:
        super().__init__()
        for i, module in enumerate(modules or []):
            self.add_module(str(start + i), module)

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            return LayerList(list(self._modules.values())[idx])
        return list(self._modules.values())[idx]

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> ShardedStateDict:
        out: ShardedStateDict = {}
        for name, module in self.named_children():
            out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata))
        return out
