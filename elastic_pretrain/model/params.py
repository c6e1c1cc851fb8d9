"""Parameter counts of a :class:`ModelConfig` by arithmetic (no torch): what a recipe documents and the
layout checks use. ``tests/model/test_params.py`` compares them with the built model's real count.

*Active* parameters are those one token's forward pass at L_max touches: every parameter except the experts
the router does not pick. A loop pass reuses its layer's parameters, so looping adds compute, not parameters.
What each part holds: docs/recipes.md, the paragraph "What `count_parameters` counts".
"""

from __future__ import annotations

import dataclasses

from elastic_pretrain.model.config import DeciderConfig, ModelConfig
from elastic_pretrain.model.vocab import padded_vocab_size


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model (all ranks together)."""

    total: int
    active: int  # touched by one token at L_max (experts: top-k of each MoE MLP)
    embedding: int  # input embedding + output layer (once when tied)
    experts: int  # all expert weights (what expert parallelism shards)
    attention: int  # all attention modules with their input norms

    @property
    def non_expert(self) -> int:
        """What every expert-parallel rank holds in full (before TP/PP sharding)."""
        return self.total - self.experts


def norm_params(cfg: ModelConfig, width: int) -> int:
    return width * (2 if cfg.normalization == "LayerNorm" else 1)  # LayerNorm has a bias


def attention_params(cfg: ModelConfig) -> int:
    """One attention module with its input norm (and QK-norm)."""
    d_h = cfg.hidden_size // cfg.num_heads
    qkv = cfg.hidden_size * (cfg.num_heads + 2 * cfg.query_groups) * d_h
    proj = cfg.num_heads * d_h * cfg.hidden_size
    qk = 2 * norm_params(cfg, d_h) if cfg.qk_norm else 0
    return norm_params(cfg, cfg.hidden_size) + qkv + proj + qk


def expert_params(cfg: ModelConfig) -> int:
    """One SwiGLU expert (gate and up projections fused into fc1, then fc2)."""
    return 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size


def moe_mlp_params(cfg: ModelConfig) -> int:
    """One MoE MLP with its pre-MLP norm and router (``experts_built`` experts)."""
    return norm_params(cfg, cfg.hidden_size) + cfg.experts_built * (cfg.hidden_size + expert_params(cfg))


def dense_mlp_params(cfg: ModelConfig) -> int:
    return norm_params(cfg, cfg.hidden_size) + 3 * cfg.hidden_size * cfg.ffn_hidden_size


def count_parameters(cfg: ModelConfig) -> ParamCounts:
    """Total and active parameter counts of the model ``cfg`` builds (vocabulary padded as built)."""
    vocab = padded_vocab_size(cfg.vocab_size, 1)
    embedding = vocab * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    attn = attention_params(cfg)
    attentions_per_core = 1 if cfg.attention == "tied" else cfg.max_loops
    edges = cfg.prelude_layers + cfg.coda_layers
    edge_mlp = moe_mlp_params(cfg) if cfg.edge_mlp == "moe" else dense_mlp_params(cfg)
    moe_layers = cfg.core_layers_built + (edges if cfg.edge_mlp == "moe" else 0)
    conditioning = (2 * cfg.max_loops + 1 + cfg.hidden_size) * cfg.hidden_size if cfg.loop_conditioning else 0
    attention = (edges + cfg.core_layers_built * attentions_per_core) * attn
    total = (
        embedding
        + attention
        + edges * edge_mlp
        + cfg.core_layers_built * moe_mlp_params(cfg)
        + norm_params(cfg, cfg.hidden_size)  # final norm
        + conditioning
    )
    experts = moe_layers * cfg.experts_built * expert_params(cfg)
    unused = moe_layers * (cfg.experts_built - cfg.moe_top_k) * expert_params(cfg)
    return ParamCounts(total=total, active=total - unused, embedding=embedding, experts=experts, attention=attention)


def decider_parameters(cfg: DeciderConfig, model: ModelConfig) -> int:
    """The iteration decider of a decider job (``model/decider.py``): two LayerNorms of width D, fc1
    (2D -> H, bias), a pass embedding (L_max x H) and fc2 (H -> 1, bias)."""
    d, h = model.hidden_size, cfg.hidden_size
    return 4 * d + (2 * d + 1) * h + model.max_loops * h + h + 1


def format_count(n: int) -> str:
    """``1234567890`` -> ``1.23 B`` (recipes and the config check print counts this way)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)
