"""Route replay that saves work (ELR cross-loop route replay; ``model.route_replay_impl: dispatch``).

Pass 0 of a micro-batch runs megatron's MoE layer as usual and records what its alltoall dispatcher derived
from the routing (experts per token, permutation, split sizes, tokens per expert). A later pass runs only the
router matmul (the router keeps learning), computes the k gates at the recorded experts (:func:`replay_gates`)
and reuses the rest, skipping top-k, the full softmax, the aux losses and — at EP 1 — the host sync. With
EP > 1 the counts are still exchanged (ghost ranks join that collective).
docs/route-replay.md, "What a replayed pass computes" and "Expert parallelism, recompute, pipeline".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer.moe.moe_utils import permute
from torch import Tensor

_SNAPSHOT = (
    "input_splits",
    "output_splits",
    "output_splits_tp",
    "num_out_tokens",
    "num_global_tokens_per_local_expert",
)


@dataclasses.dataclass
class RouteRecord:
    """Pass 0's routing of one micro-batch at one core layer (N local tokens, k experts each)."""

    topk_NK: Tensor  # the k experts of each token (expert-ascending)
    routing_map_NE: Tensor  # bool
    rows_R: Tensor  # token of each permuted row (R = N·k, expert-major; megatron's sorted_indices)
    slots_R: Tensor  # index of each permuted row into the flattened [N, k] gates
    tokens_per_expert: Tensor  # per local expert, on the host (what the experts received)
    dispatcher: dict[str, Any]  # split sizes etc. (_SNAPSHOT), host values after pass 0's sync


def replay_gates(logits_NE: Tensor, topk_NK: Tensor, config: Any) -> Tensor:
    """Gate values ``[N, k]`` at the replayed experts from live logits, as megatron's router computes them."""
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:  # normaliser over all experts
            scores = torch.softmax(logits_NE, dim=-1, dtype=torch.float32).type_as(logits_NE)
            gates_NK = scores.gather(1, topk_NK)
        else:  # softmax after top-k: only the k logits
            gates_NK = torch.softmax(logits_NE.gather(1, topk_NK), dim=-1, dtype=torch.float32).type_as(logits_NE)
    elif config.moe_router_score_function == "sigmoid":
        gates_NK = torch.sigmoid(logits_NE.gather(1, topk_NK).float()).type_as(logits_NE)
        if topk_NK.shape[1] > 1:
            gates_NK = gates_NK / (gates_NK.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"route replay: unsupported router score function {config.moe_router_score_function!r}")
    if config.moe_router_topk_scaling_factor:
        gates_NK = gates_NK * config.moe_router_topk_scaling_factor
    return gates_NK


def check_replayable(config: Any) -> None:
    """The dispatcher settings whose metadata a replay can reuse as recorded (dropless, no padding)."""
    bad = [
        name
        for name, on in (
            ("moe_expert_capacity_factor", config.moe_expert_capacity_factor is not None),
            ("moe_router_padding_for_quantization", bool(config.moe_router_padding_for_quantization)),
            ("moe_latent_size", bool(config.moe_latent_size)),
            ("moe_router_num_groups", bool(config.moe_router_group_topk)),
            ("moe_router_enable_expert_bias", bool(config.moe_router_enable_expert_bias)),
            ("moe_shared_expert_overlap", bool(config.moe_shared_expert_overlap)),
        )
        if on
    ]
    if bad or config.moe_token_dispatcher_type != "alltoall":
        raise ValueError(
            f"route_replay_impl dispatch needs the dropless alltoall dispatcher without {bad}; "
            "use route_replay_impl: router"
        )


def moe_forward(
    moe: Any, x_TBD: Tensor, record: RouteRecord | None, *, exchange_counts: bool, router_losses: bool = False
) -> tuple[Tensor, RouteRecord]:
    """megatron ``MoELayer.forward`` (route → dispatch → experts → combine), recording when ``record``
    is None and replaying it otherwise. Returns (output ``[T, B, D]``, the record).

    ``router_losses``: a replay that still adds the router's z-loss and load-balancing loss — the
    backward's re-run of pass 0 under ``train.recompute: pass``, whose no-grad forward added none."""
    disp = moe.token_dispatcher
    shared = moe.shared_experts_compute(x_TBD)
    if record is None:
        probs, routing_map = moe.route(x_TBD)
        permuted, permuted_probs = moe.preprocess(x_TBD, probs, routing_map)
        rows_R = disp.reversed_local_input_permutation_mapping
    else:
        permuted, permuted_probs = _replay_preprocess(
            moe, x_TBD, record, exchange_counts=exchange_counts, router_losses=router_losses
        )
    saved_points = disp.cuda_dtoh_point, disp.cuda_sync_point
    if record is not None and not exchange_counts:  # all counts are host values already: no copy, no sync
        disp.cuda_dtoh_point = disp.cuda_sync_point = "no_sync"
    try:
        dispatched, dispatched_probs = moe.dispatch(permuted, permuted_probs)
        tokens, tokens_per_expert, expert_probs = disp.dispatch_postprocess(dispatched, dispatched_probs)
    finally:
        disp.cuda_dtoh_point, disp.cuda_sync_point = saved_points
    if record is None:
        record = _record(moe, routing_map, rows_R, tokens_per_expert)
    out, bias = moe.experts(tokens, tokens_per_expert, expert_probs)
    assert bias is None, "MoE experts with bias are not supported by megatron's dispatchers"
    out = moe.combine(disp.combine_preprocess(out))
    return moe.postprocess(out, shared), record


def _record(moe: Any, routing_map_NE: Tensor, rows_R: Tensor, tokens_per_expert: Tensor) -> RouteRecord:
    disp, k = moe.token_dispatcher, moe.router.topk
    # the k experts of each token, ascending (any order works: the gates are a function of the set)
    topk_NK = torch.sort(routing_map_NE.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :k]
    topk_NK = topk_NK.sort(dim=1).values
    # megatron's permutation is expert-major, token-ascending; a stable sort of the flattened expert ids
    # gives the same order, and each row's position in [N, k] (no mask-select: no host sync)
    slots_R = torch.sort(topk_NK.reshape(-1), stable=True).indices
    if not disp.config.moe_permute_fusion and not rows_R.is_cuda and not torch.equal(slots_R // k, rows_R):
        # (fused: rows_R is Transformer Engine's row-id map; on CUDA the check would cost a host sync)
        raise RuntimeError("route replay: the recorded permutation differs from megatron's")
    return RouteRecord(
        topk_NK=topk_NK,
        routing_map_NE=routing_map_NE,
        rows_R=rows_R,
        slots_R=slots_R,
        tokens_per_expert=tokens_per_expert,
        dispatcher={name: getattr(disp, name) for name in _SNAPSHOT},
    )


def _replay_preprocess(
    moe: Any, x_TBD: Tensor, rec: RouteRecord, *, exchange_counts: bool, router_losses: bool
) -> tuple[Tensor, Tensor]:
    """``MoELayer.route`` + ``preprocess`` from a record: live gates, recorded dispatch metadata."""
    disp, router = moe.token_dispatcher, moe.router
    x_ND = x_TBD.reshape(-1, x_TBD.shape[-1])
    if x_ND.shape[0] != rec.topk_NK.shape[0]:
        raise RuntimeError(f"route replay: {x_ND.shape[0]} tokens, but pass 0 routed {rec.topk_NK.shape[0]}")
    x_ND = router.apply_input_jitter(x_ND)
    for pre_hook in list(router._forward_pre_hooks.values()):  # a router call for them: the gradient
        pre_hook(router, (x_ND,))  # ledger (parallel/overlap.py) counts the router weight's uses by these
    logits_NE = router.gating(x_ND)
    if router_losses:  # pass 0 re-run in backward: its z-loss and load-balancing loss, as megatron's routing
        logits_NE = router.apply_z_loss(logits_NE)
    gates_NK = replay_gates(logits_NE, rec.topk_NK, router.config)
    if router_losses and router.training and torch.is_grad_enabled() and router.is_aux_loss_enabled():
        gates_NK = _with_aux_losses(router, logits_NE, gates_NK, rec, x_TBD.shape[0], x_TBD.shape[1])
    if router._forward_hooks:  # the routing probe (every N steps) observes replayed passes too, as router calls
        probs_NE = torch.zeros_like(logits_NE).scatter(1, rec.topk_NK, gates_NK)
        for hook in list(router._forward_hooks.values()):
            hook(router, (x_ND,), (probs_NE, rec.routing_map_NE))
    disp.hidden_shape = x_TBD.shape
    disp.hidden_shape_before_permute = x_ND.shape
    disp.routing_map = rec.routing_map_NE
    if exchange_counts:  # EP > 1: the count all-gather is a collective every group member calls
        disp.tokens_per_expert = disp.preprocess(rec.routing_map_NE)
        disp.tokens_per_expert = disp._maybe_dtoh_and_synchronize("before_permutation_1", disp.tokens_per_expert)
    else:
        for name, value in rec.dispatcher.items():
            setattr(disp, name, value)
        disp.tokens_per_expert = rec.tokens_per_expert
    if disp.config.moe_permute_fusion:  # Transformer Engine's fused permute takes dense [N, E] probs
        probs_NE = torch.zeros_like(rec.routing_map_NE, dtype=gates_NK.dtype).scatter(1, rec.topk_NK, gates_NK)
        permuted, permuted_probs, disp.reversed_local_input_permutation_mapping = permute(
            x_ND, rec.routing_map_NE, probs=probs_NE, num_out_tokens=disp.num_out_tokens, fused=True
        )
        return permuted, permuted_probs
    disp.reversed_local_input_permutation_mapping = rec.rows_R
    return x_ND.index_select(0, rec.rows_R), gates_NK.reshape(-1).index_select(0, rec.slots_R)


def _with_aux_losses(
    router: Any, logits_NE: Tensor, gates_NK: Tensor, rec: RouteRecord, seq: int, batch: int
) -> Tensor:
    """The gates with megatron's load-balancing losses attached (``TopKRouter.routing``'s aux section)."""
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

    probs_NE = torch.zeros_like(logits_NE).scatter(1, rec.topk_NK, gates_NK)
    rmap, scores = compute_routing_scores_for_aux_loss(
        logits_NE, router.topk, router.score_function, fused=router.config.moe_router_fusion
    )
    probs_NE = router._apply_aux_loss(probs_NE, scores, rmap, with_padding_mask=False)
    probs_NE = router._apply_seq_aux_loss(probs_NE, scores, rmap, seq, batch, with_padding_mask=False)
    probs_NE = router._apply_global_aux_loss(probs_NE, scores, rmap, with_padding_mask=False)
    return probs_NE.gather(1, rec.topk_NK)
