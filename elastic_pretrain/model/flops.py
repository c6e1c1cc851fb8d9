"""FLOPs per token of a forward of the looped model at ℓ loops, and relative compute (FLOPs(ℓ) / FLOPs(L_max)).

Only the matrix multiplications count, 2 FLOPs per multiply-add (norms, softmax, RoPE, the embedding lookup
and the per-pass conditioning vector are O(D) against O(D²)); ``ctx="causal"`` counts the mean (T+1)/2 keys a
query sees, ``"full"`` the T×T scores megatron's unfused attention multiplies (what the test checks against
``torch.utils.flop_counter``). The formula: docs/evaluation.md, "FLOPs per token and relative compute".

Shape legend: T sequence length, V vocabulary, D hidden, F FFN width, E experts, W expert width.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.model.vocab import padded_vocab_size

AttentionContext = Literal["causal", "full"]


def _attention_context(seq_len: int, attention_context: AttentionContext) -> float:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return (seq_len + 1) / 2 if attention_context == "causal" else float(seq_len)


def attention_flops(cfg: ModelConfig, ctx: float, query_groups: int | None = None) -> float:
    """One attention half per token: q/k/v and output projections plus the ctx-dependent matmuls."""
    d = cfg.hidden_size
    d_h = d // cfg.num_heads
    groups = cfg.num_heads if query_groups is None else query_groups
    return 2 * d * (d + 2 * groups * d_h) + 2 * d * d + 4 * ctx * d


def dense_mlp_flops(cfg: ModelConfig) -> float:
    return 2 * 3 * cfg.hidden_size * cfg.ffn_hidden_size  # SwiGLU: fc1 to 2F, fc2 from F


def moe_mlp_flops(cfg: ModelConfig) -> float:
    """Router over the built experts + top-k experts (flattening keeps this equal; Foil, seeds/000:
    "holding expert parameters and expert compute per token fixed")."""
    d = cfg.hidden_size
    return 2 * d * cfg.experts_built + cfg.moe_top_k * 2 * 3 * d * cfg.moe_ffn_hidden_size


@dataclasses.dataclass(frozen=True)
class FlopsBreakdown:
    """FLOPs per token of one forward, split by where they are spent."""

    edges: float  # prelude + coda (run once)
    core_pass: float  # one pass through every core layer
    output: float  # output layer
    loops: float  # passes counted (may be fractional: mean passes per token under adaptive depth)

    @property
    def total(self) -> float:
        return self.edges + self.loops * self.core_pass + self.output


def flops_breakdown(
    cfg: ModelConfig,
    loops: float,
    *,
    seq_len: int,
    padded_vocab: int | None = None,
    attention_context: AttentionContext = "causal",
) -> FlopsBreakdown:
    """The terms of :func:`flops_per_token`; ``loops`` may be a mean number of passes (adaptive depth)."""
    if not 0 <= loops <= cfg.max_loops:
        raise ValueError(f"loops={loops} is outside [0, {cfg.max_loops}]")
    vocab = padded_vocab_size(cfg.vocab_size, 1) if padded_vocab is None else padded_vocab
    attn = attention_flops(cfg, _attention_context(seq_len, attention_context))
    edge_mlp = moe_mlp_flops(cfg) if cfg.edge_mlp == "moe" else dense_mlp_flops(cfg)
    edges = (cfg.prelude_layers + cfg.coda_layers) * (attn + edge_mlp)
    core_pass = cfg.core_layers_built * (attn + moe_mlp_flops(cfg))
    return FlopsBreakdown(edges=edges, core_pass=core_pass, output=2 * cfg.hidden_size * vocab, loops=loops)


def flops_per_token(
    cfg: ModelConfig,
    loops: float,
    *,
    seq_len: int,
    padded_vocab: int | None = None,
    attention_context: AttentionContext = "causal",
) -> float:
    """Matmul FLOPs per token of a forward at ``loops`` passes (formula in the module docstring)."""
    return flops_breakdown(
        cfg, loops, seq_len=seq_len, padded_vocab=padded_vocab, attention_context=attention_context
    ).total


def relative_compute(
    cfg: ModelConfig, loops: float, *, seq_len: int, attention_context: AttentionContext = "causal"
) -> float:
    """FLOPs(ℓ) / FLOPs(L_max)."""
    return flops_per_token(cfg, loops, seq_len=seq_len, attention_context=attention_context) / flops_per_token(
        cfg, cfg.max_loops, seq_len=seq_len, attention_context=attention_context
    )
