"""Loss and perplexity after each core layer k of a non-looped stack (``schedule.exit_axis: layer``).

Shape legend: N sequences, T sequence length, B batch, V vocabulary.

TLM's axis (seeds/001: "all twenty layer prefixes produce a working model"): the exit after core layer k is
the prelude, core layers 1..k, the coda, the shared final norm and the shared output layer — read by
``LoopedMoEModel.run_layers``, the path training supervises too. Its cost per token is the forward FLOPs of
the stack with k of its N core layers: ``flops_per_token(cfg, k / N)`` (eval/quality.py counts a fraction
of the one core pass, and every core layer costs the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from elastic_pretrain.eval.quality import (
    AttentionContext,
    CurvePoint,
    LoopEval,
    QualityCurve,
    flops_per_token,
    token_ce,
)

if TYPE_CHECKING:
    from elastic_pretrain.model.looped import LoopedMoEModel


@torch.no_grad()
def evaluate_layers(
    model: LoopedMoEModel, tokens_NT1: torch.Tensor, layers: Sequence[int] | None = None, *, batch_size: int = 8
) -> dict[int, LoopEval]:
    """Per-token loss (nats, real vocabulary) after each core layer k in ``layers`` (default 1..N), one pass
    per batch. ``LoopEval.loops`` holds k."""
    cfg = model.cfg
    n = cfg.core_layers_built
    wanted = sorted(set(range(1, n + 1) if layers is None else layers))
    if cfg.max_loops != 1 or not wanted or not 1 <= wanted[0] <= wanted[-1] <= n:
        raise ValueError(f"layer exits {wanted} need a non-looped stack (L_max = {cfg.max_loops}) and k in 1..{n}")
    was_training = model.training
    model.eval()
    sums = dict.fromkeys(wanted, 0.0)
    count = 0
    try:
        for start in range(0, tokens_NT1.shape[0], batch_size):
            chunk = tokens_NT1[start : start + batch_size]
            ids, labels = chunk[:, :-1], chunk[:, 1:]
            per = model(ids, loops=1, exits=wanted, exit_axis="layer")
            for k in wanted:
                sums[k] += float(token_ce(per[k], labels).double().sum())
            count += labels.numel()
    finally:
        model.train(was_training)
    return {k: LoopEval(loops=k, loss=sums[k] / count, tokens=count) for k in wanted}


def layer_compute(
    model: LoopedMoEModel, k: int, *, seq_len: int, attention_context: AttentionContext = "causal"
) -> float:
    """Forward FLOPs per token of the exit after core layer k."""
    cfg = model.cfg
    return flops_per_token(cfg, k / cfg.core_layers_built, seq_len=seq_len, padded_vocab=model.padded_vocab,
                           attention_context=attention_context)


def layer_quality_curve(
    model: LoopedMoEModel, tokens_NT1: torch.Tensor, *, name: str = "layer exits", batch_size: int = 8,
    attention_context: AttentionContext = "causal",
) -> QualityCurve:
    """Every layer exit k = 1..N at its relative compute FLOPs(k) / FLOPs(N); ``CurvePoint.loops`` holds k."""
    seq_len = tokens_NT1.shape[1] - 1
    evals = evaluate_layers(model, tokens_NT1, batch_size=batch_size)
    n = model.cfg.core_layers_built
    fmax = layer_compute(model, n, seq_len=seq_len, attention_context=attention_context)
    ctx = attention_context
    points = tuple(
        CurvePoint(loops=k, loss=e.loss, relative_compute=layer_compute(model, k, seq_len=seq_len,
                                                                        attention_context=ctx) / fmax)
        for k, e in evals.items()
    )
    return QualityCurve(name=name, points=points, flops_max=fmax)
