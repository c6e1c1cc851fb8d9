"""Held-out loss per loop count: the one evaluator of training validation, ``elastic-pretrain eval`` and
the experiments.

Shape legend: N sequences, T sequence length (each row holds T+1 tokens: inputs ``[:, :-1]``, labels
``[:, 1:]``).

The loss is the model's own: ``forward`` with ``labels`` (megatron's vocab-parallel cross-entropy,
the training loss). The padded vocabulary's logits are -inf (``LoopedMoEModel.logits``), so this is
the cross-entropy over the real vocabulary, the distribution ``generate`` samples from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

from elastic_pretrain.eval.curves import CurvePoint, QualityCurve
from elastic_pretrain.model.flops import AttentionContext, flops_per_token
from elastic_pretrain.parallel.device import device, to_device
from elastic_pretrain.parallel.mesh import all_reduce_sum, pipeline_group
from elastic_pretrain.parallel.pipeline import MicroBatch, Pipeline, run_pipeline
from elastic_pretrain.schedule import DepthPlan, ExitAxis

if TYPE_CHECKING:  # annotations only
    from elastic_pretrain.model.looped import LoopedMoEModel

Runs = list[tuple[int, tuple[int, ...]]]  # (ℓ of one run, the exits it reports)


@torch.no_grad()
def loss_by_loops(
    model: torch.nn.Module,
    tokens_NT1: torch.Tensor,
    loops: Sequence[int] | None = None,
    pipeline: Pipeline | None = None,
    *,
    batch_size: int = 8,
    exit_axis: ExitAxis = "loop",
) -> dict[int, float]:
    """Per-token cross-entropy at every ℓ in ``loops`` (default 1..L_max) on ``tokens_NT1``.

    ``model``: the model, or its DDP wrapper (or the DeepSpeed engine, ``engine: deepspeed``). In a
    distributed job every rank passes its own rows and the result is over all of them (summed over
    data-parallel ranks; every rank must have the same number of rows, so that the MoE all-to-alls of an
    expert-parallel group pair up); ``pipeline`` (``parallel.pipeline`` > 1) runs the passes through the
    pipeline schedule, the losses come from the last stage.

    One L_max run with an exit at every ℓ — or, when an ℓ-pass run is not the prefix of a longer one
    (``one_exit_per_run``: the loop-count conditioning conditions each ℓ on its own target, and
    ``model.kv_training: last_loop`` attends to the run's final K/V), one run per ℓ.

    ``exit_axis="layer"`` (TLM's axis, ``schedule.exit_axis``): ``loops`` are core layers k of a non-looped
    stack (default 1..N), all read out of one pass as in training (``LoopedMoEModel.run_layers``).
    """
    inner: Any = model
    while not hasattr(inner, "cfg") and hasattr(inner, "module"):  # DDP, or DeepSpeed's engine around its wrapper
        inner = inner.module
    net: LoopedMoEModel = inner
    layer = exit_axis == "layer"
    deepest = net.cfg.core_layers_built if layer else net.cfg.max_loops
    wanted = sorted(set(range(1, deepest + 1) if loops is None else loops))
    if layer and (net.cfg.max_loops != 1 or not 1 <= wanted[0] <= wanted[-1] <= deepest):
        raise ValueError(
            f"layer exits {wanted} need a non-looped stack (L_max = {net.cfg.max_loops}) and k in 1..{deepest}"
        )
    if not layer:
        for ell in wanted:
            net.cfg.check_loops(ell)
    runs: Runs = (
        [(1, tuple(wanted))]
        if layer
        else [(ell, (ell,)) for ell in wanted]
        if net.one_exit_per_run
        else [(wanted[-1], tuple(wanted))]
    )
    was_training = model.training
    model.eval()
    if pipeline is None:  # through the pipeline, its schedule flags the first micro-batch itself
        net.set_is_first_microbatch()  # TE layers re-quantize their FP8 weights: the optimizer may have moved them
    try:
        if pipeline is not None:
            sums, count = _pipeline_sums(pipeline, tokens_NT1, runs, wanted, batch_size)
        else:
            sums, count = _sums(model, tokens_NT1, runs, wanted, batch_size, exit_axis)
    finally:
        clear_aux_losses_tracker()  # the MoE layers logged aux losses of these forwards: not training's
        model.train(was_training)
    all_reduce_sum(sums)
    all_reduce_sum(count)
    all_reduce_sum(sums, pipeline_group())  # only the last pipeline stage computed losses
    all_reduce_sum(count, pipeline_group())
    return {ell: float(sums[i] / count) for i, ell in enumerate(wanted)}


def _sums(
    model: torch.nn.Module, tokens_NT1: torch.Tensor, runs: Runs, loops: list[int], batch_size: int, exit_axis: ExitAxis
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-exit CE sums and the token count of these rows, one process (or one rank of TP/EP/DP)."""
    sums = torch.zeros(len(loops), dtype=torch.float64, device=device())
    count = torch.zeros(1, dtype=torch.float64, device=device())
    for start in range(0, tokens_NT1.shape[0], batch_size):
        batch = to_device(tokens_NT1[start : start + batch_size])
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        for ell, exits in runs:
            losses = model(inputs, labels=labels, loops=ell, exits=exits, exit_axis=exit_axis)
            for e in exits:
                sums[loops.index(e)] += losses[e].double().sum()
        count += labels.numel()
    return sums, count


def _pipeline_sums(
    pipeline: Pipeline, tokens_NT1: torch.Tensor, runs: Runs, loops: list[int], batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-exit CE sums and token count of this replica's rows, through the pipeline (sums on the last stage)."""
    sums = torch.zeros(len(loops), dtype=torch.float64, device=device())
    count = torch.zeros(1, dtype=torch.float64, device=device())
    batches = [to_device(b) for b in tokens_NT1.split(batch_size)]
    for ell, exits in runs:
        plan = DepthPlan(ell, exits, group_loops=ell)  # every rank evaluates the same plan
        reports = run_pipeline(
            pipeline, [MicroBatch(b, plan) for b in batches], seq_len=tokens_NT1.shape[1] - 1, training=False
        )
        for rep in reports:
            for e, (s, _) in rep["by_exit"].items():
                sums[loops.index(e)] += float(s)
    if pipeline.is_last_stage:
        count += tokens_NT1.shape[0] * (tokens_NT1.shape[1] - 1)
    return sums, count


def quality_curve(
    model: LoopedMoEModel,
    tokens_NT1: torch.Tensor,
    *,
    name: str = "fixed depth",
    attention_context: AttentionContext = "causal",
    batch_size: int = 8,
    exit_axis: ExitAxis = "loop",
) -> QualityCurve:
    """:func:`loss_by_loops` at every ℓ ∈ 1..L_max, each placed at its relative compute (``model/flops.py``).

    ``exit_axis="layer"``: every exit after core layer k = 1..N of a non-looped stack (``CurvePoint.loops``
    holds k); its cost is the stack's forward FLOPs with k of its N core layers, ``flops_per_token(cfg, k/N)``
    (a fraction of the one core pass: every core layer costs the same)."""
    cfg = model.cfg
    seq_len = tokens_NT1.shape[1] - 1
    layer = exit_axis == "layer"
    scale = 1.0 / cfg.core_layers_built if layer else 1.0

    def flops(depth: int) -> float:
        return flops_per_token(
            cfg, depth * scale, seq_len=seq_len, padded_vocab=model.padded_vocab, attention_context=attention_context
        )

    fmax = flops(cfg.core_layers_built if layer else cfg.max_loops)
    losses = loss_by_loops(model, tokens_NT1, batch_size=batch_size, exit_axis=exit_axis)
    points = tuple(CurvePoint(loops=ell, loss=loss, relative_compute=flops(ell) / fmax) for ell, loss in losses.items())
    return QualityCurve(name=name, points=points, flops_max=fmax)
