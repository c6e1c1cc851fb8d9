"""Last-loop KV cache as a trained mode (``model.kv_training: last_loop``).

At inference with the ELR last-loop cache, pass j of a token attends to the *final-pass* K/V of earlier tokens
plus its own pass-j K/V; same-pass training never shows the model that pattern. So a forward is a no-grad run
keeping each layer's final K/V (:class:`FinalKV`), then the graded run with :func:`mixed_attention`; per token
it equals last-loop inference after a parallel prefill. The same attention serves per-token depth
(:class:`StoppedKV`). docs/kv-training.md, "The trained mode".
Shape legend: T tokens, B batch, H query heads, G key/value groups, d head width, D hidden.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from torch import Tensor


@dataclasses.dataclass
class FinalKV:
    """Final-pass K/V per core layer (keyed by megatron layer number); ``capture``: being filled."""

    kv: dict[int, tuple[Tensor, Tensor]] = dataclasses.field(default_factory=dict)
    capture: bool = True

    def past(self, number: int, k_TBGd: Tensor, v_TBGd: Tensor) -> tuple[Tensor, Tensor]:
        """The K/V the tokens present to later queries at layer ``number``, given this pass's own K/V."""
        return self.kv[number]


@dataclasses.dataclass
class StoppedKV(FinalKV):
    """Per-token depth (``decider.backbone: per_token``): ``kv`` holds, per core layer, each token's K/V of
    the last pass it ran; ``stopped_TB`` marks the tokens that stopped before the current pass. At each
    pass the stopped tokens keep their entries and the active ones take this pass's K/V (graded tensors:
    the loss of a later token differentiates through a stopped token's K/V into the pass that made them).
    Mutated pass by pass, so a pass cannot be recomputed in backward (``train.recompute: pass`` is refused)."""

    capture: bool = False
    stopped_TB: Tensor | None = None

    def past(self, number: int, k_TBGd: Tensor, v_TBGd: Tensor) -> tuple[Tensor, Tensor]:
        prev = self.kv.get(number)
        if prev is not None and self.stopped_TB is not None:
            mask = self.stopped_TB[:, :, None, None]
            k_TBGd, v_TBGd = torch.where(mask, prev[0], k_TBGd), torch.where(mask, prev[1], v_TBGd)
        self.kv[number] = (k_TBGd, v_TBGd)
        return k_TBGd, v_TBGd


def project_kv(layer: Any, h_TBD: Tensor, rope: Tensor) -> tuple[Tensor, Tensor]:
    """The K/V (after RoPE) the attention half of ``layer`` computes from hidden states ``h_TBD``."""
    attn = layer.self_attention
    _, k_TBGd, v_TBGd = attn.get_query_key_value_tensors(layer.input_layernorm(h_TBD), None)
    return apply_rotary_pos_emb(k_TBGd, rope, config=attn.config, cp_group=attn.pg_collection.cp), v_TBGd


def mixed_attention(layer: Any, h_TBD: Tensor, rope: Tensor, kv: FinalKV, number: int) -> Tensor:
    """The attention half of a megatron ``TransformerLayer`` (norm, QKV, RoPE, scores, projection,
    residual) where query t sees the K/V ``kv.past`` gives for tokens s < t (their final-pass K/V; under
    per-token depth a stopped token's frozen K/V) and its own K/V. → hidden ``[T, B, D]``."""
    attn = layer.self_attention
    residual = h_TBD
    q_TBHd, k_TBGd, v_TBGd = attn.get_query_key_value_tensors(layer.input_layernorm(h_TBD), None)
    cp = attn.pg_collection.cp
    q_TBHd = apply_rotary_pos_emb(q_TBHd, rope, config=attn.config, cp_group=cp)
    k_TBGd = apply_rotary_pos_emb(k_TBGd, rope, config=attn.config, cp_group=cp)
    kf_TBGd, vf_TBGd = kv.past(number, k_TBGd, v_TBGd)
    ctx_TBD = _past_and_self_attention(
        q_TBHd, k_TBGd, v_TBGd, kf_TBGd, vf_TBGd, scale=attn.core_attention.softmax_scale
    )
    out_with_bias = attn.linear_proj(ctx_TBD)
    with layer.bias_dropout_add_exec_handler():
        return layer.self_attn_bda(layer.training, layer.config.bias_dropout_fusion)(
            out_with_bias, residual, layer.hidden_dropout
        )


def _past_and_self_attention(
    q_TBHd: Tensor, k_TBGd: Tensor, v_TBGd: Tensor, kf_TBGd: Tensor, vf_TBGd: Tensor, *, scale: float
) -> Tensor:
    """softmax over [final keys s < t, own key t] of q·k·scale, times the matching values. → ``[T, B, H·d]``."""
    t, b, h, d = q_TBHd.shape
    rep = h // k_TBGd.shape[2]

    def heads(x_TBGd: Tensor) -> Tensor:  # → B H T d
        return x_TBGd.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)

    q = q_TBHd.permute(1, 2, 0, 3)
    past = torch.matmul(q, heads(kf_TBGd).transpose(-1, -2)).float() * scale  # B H T(query) T(key)
    own = (q * heads(k_TBGd)).sum(-1, keepdim=True).float() * scale  # B H T 1
    strictly_before = torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-1)
    past = past.masked_fill(~strictly_before, float("-inf"))
    probs = torch.softmax(torch.cat([past, own], dim=-1), dim=-1).to(q.dtype)
    ctx = torch.matmul(probs[..., :t], heads(vf_TBGd)) + probs[..., t:] * heads(v_TBGd)
    return ctx.permute(2, 0, 1, 3).reshape(t, b, h * d)
