"""Checkpoint keys that differ between megatron's TE and local layer specs, mapped at load time (issue 30, item 5).

megatron's local spec saves its norms under the TE spec's names so that one checkpoint serves both, but also
for MoE layers, where TE keeps a real ``pre_mlp_layernorm``: a MoE layer's pre-MLP norm (and its Adam moments)
is named differently in a GPU and a CPU checkpoint. :func:`map_spec_keys` renames, in the load request, each key
the checkpoint lacks whose other spec's name it declares, so a GPU run evaluates, exports and converts on a CPU
machine and a CPU run resumes on a GPU. docs/checkpoints.md, "A checkpoint of the other layer spec".
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor

# (local-spec key suffix, TE-spec key suffix) of a MoE layer's pre-MLP norm
ALIASES: tuple[tuple[str, str], ...] = (
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_bias", ".pre_mlp_layernorm.bias"),
)


def _alias(key: str, saved: Collection[str]) -> str | None:
    """The other spec's name of ``key`` when the checkpoint declares it."""
    for local, te in ALIASES:
        for mine, other in ((local, te), (te, local)):
            if key.endswith(mine) and (alias := key[: -len(mine)] + other) in saved:
                return alias
    return None


def map_spec_keys(sharded_state_dict: Any, saved: Collection[str]) -> list[tuple[str, str]]:
    """Rename in place every ShardedTensor key of ``sharded_state_dict`` that ``saved`` (the checkpoint's
    keys) lacks and holds under the other layer spec's name; returns the (wanted, saved) pairs renamed.
    The state-dict names (the dict keys a load returns) stay those of the model asking."""
    renamed = []
    for t in nested_values(sharded_state_dict):
        if isinstance(t, ShardedTensor) and t.key not in saved and (alias := _alias(t.key, saved)) is not None:
            renamed.append((t.key, alias))
            t.key = alias
    return renamed
