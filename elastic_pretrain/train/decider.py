"""A decider job (TaH2 post-training): the numerics of one step, backbone freezing, base weights.

The job's model carries the iteration decider as a submodule (``LoopedMoEModel.decider``), so
megatron's DDP, the distributed optimizer, ``dist_checkpointing`` and our resume/resharding handle it
like any other parameter; with ``backbone: frozen`` every other parameter has ``requires_grad=False``
(megatron's DDP and optimizer skip those: no gradient buffers, no Adam state). Every micro-batch runs
L_max passes with an exit at every pass — the same MoE calls on every rank of an expert-parallel group,
so no ghost passes. Per micro-batch: CE_j at each exit → lookahead labels over its tokens → weighted
BCE of the decider's continue logits; objective = CE at L_max (``lm_loss: every_exit``: the mean CE over
the exits) + ``loss_weight`` · BCE (as
``model/decider.py:decider_loss``, which is the one-process reference).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from elastic_pretrain.model.decider import (
    DeciderConfig,
    PerTokenRun,
    labels_from_gain,
    lookahead_labels,
    passes_at,
    per_token_bce,
)
from elastic_pretrain.model.looped import LoopedMoEModel
from elastic_pretrain.parallel.device import device
from elastic_pretrain.parallel.mesh import data_parallel_group, sequence_shard
from elastic_pretrain.parallel.pipeline import MicroBatch
from elastic_pretrain.train.step import TrainStep, _reduce_by_loops

if TYPE_CHECKING:  # annotations only
    from megatron.core.distributed import DistributedDataParallel

# the per-micro-batch sums a decider step reports (reduced over every rank)
STATS = ("bce_sum", "labels", "continue", "correct", "passes", "tokens")


def _forward_step(
    cfg: DeciderConfig, data_iterator: Iterator[MicroBatch], model: DistributedDataParallel
) -> tuple[Any, Any]:
    mb = next(data_iterator)
    inputs, labels = mb.tokens_BT1[:, :-1].contiguous(), mb.tokens_BT1[:, 1:].contiguous()
    return model.module.forward_decider(inputs, labels), partial(_loss_func, cfg)


def pooled_labels(gain_L_BT: torch.Tensor, coverage: float) -> torch.Tensor:
    """Lookahead labels from the gains ``[L-1, B, T]`` (0 where unlabelled) whose coverage cut is taken over
    the whole data-parallel batch: every DP rank's gains are gathered (on the NCCL device), labelled together,
    and this rank keeps its slice — the labels one process gives the concatenated batch. Micro-batch shapes
    agree across DP ranks (a decider job runs the same micro-batches everywhere)."""
    group = data_parallel_group() if dist.is_initialized() else None
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return labels_from_gain(gain_L_BT, coverage)
    local = gain_L_BT.flatten(1).double().to(device()).contiguous()
    every = torch.empty((world * local.shape[0], local.shape[1]), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(every, local, group=group)  # ranks concatenated along dim 0 (gloo and NCCL)
    every = every.view(world, *local.shape)
    pooled = labels_from_gain(every.transpose(0, 1).flatten(1), coverage)  # [L-1, world·N], rank-major
    mine = pooled.reshape(local.shape[0], world, -1)[:, dist.get_rank(group)]
    return mine.reshape(gain_L_BT.shape).to(gain_L_BT.device)


def _per_token_loss(cfg: DeciderConfig, run: PerTokenRun) -> tuple[Any, Any, dict]:
    """``backbone: per_token``: CE at each token's exit + loss_weight · BCE over the nested, DP-pooled labels
    (``model/decider.py:decider_loss`` is the one-process reference)."""
    n = run.exit_ce_BT.numel()
    targets = pooled_labels(run.gain_LBT(), cfg.coverage)
    bce_sum, count = per_token_bce(run, targets, cfg.pos_weight)
    objective = run.exit_ce_BT.sum() + cfg.loss_weight * bce_sum * (n / count.clamp(min=1))
    with torch.no_grad():
        mask_LTB = run.labelled_LBT().transpose(1, 2)
        t_LTB = targets.transpose(1, 2)
        stats = torch.tensor(
            [float(bce_sum), float(count), float(t_LTB[mask_LTB].sum()),
             float((((run.logit_LTB > 0) == t_LTB) & mask_LTB).sum()), float(run.active_L_BT.sum()), n],
            dtype=torch.float64, device=run.exit_ce_BT.device,
        )  # fmt: skip
    loops = run.ce_L_BT.shape[0]  # ℓ = j: the states after pass j-1 under per-token stopping (ℓ = L_max: exits)
    by_exit = {e: (run.ce_L_BT[e - 1].sum(), n) for e in range(1, loops)}
    by_exit[loops] = (run.exit_ce_BT.detach().sum(), n)
    report = {"by_exit": by_exit, "decider": stats}
    return objective, torch.tensor(n, dtype=torch.int, device=objective.device), report


def _loss_func(
    cfg: DeciderConfig,
    out: tuple[dict[int, torch.Tensor], torch.Tensor] | PerTokenRun,
) -> tuple[Any, Any, dict]:
    """CE at L_max (or the mean over the exits, ``lm_loss: every_exit``) + loss_weight · BCE, as a per-token
    sum (megatron divides by the token count).

    The CE of every exit is identical on the TP ranks of a replica (vocab-parallel CE), so are the
    labels; under sequence parallelism the continue logits ``[L-1, T/tp, B]`` are this rank's sequence
    shard, so the BCE here is the shard's sum over the *whole* sequence's label count: the TP ranks'
    decider gradients add up (finalize_model_grads all-reduces them) to the gradient of the full mean.
    """
    if isinstance(out, PerTokenRun):
        return _per_token_loss(cfg, out)
    losses, logit_LTB = out
    loops = len(losses)
    ce_LBT = torch.stack([losses[e] for e in range(1, loops + 1)])
    n = ce_LBT[0].numel()
    labels_LBT = lookahead_labels(ce_LBT.detach(), cfg.coverage)
    target_LTB = sequence_shard(labels_LBT.transpose(1, 2), logit_LTB.shape[1], dim=1).float()
    pos_weight = torch.tensor(cfg.pos_weight, device=logit_LTB.device)
    bce = F.binary_cross_entropy_with_logits(logit_LTB, target_LTB, pos_weight=pos_weight, reduction="sum")
    lm = ce_LBT[-1].sum() if cfg.lm_loss == "last" else ce_LBT.mean(0).sum()  # every_exit: each depth alike
    objective = lm + cfg.loss_weight * bce * (n / labels_LBT.numel())
    with torch.no_grad():
        passes = passes_at(logit_LTB, cfg.threshold)
        stats = torch.tensor(
            [float(bce), target_LTB.numel(), float(target_LTB.sum()),
             float(((logit_LTB > 0).float() == target_LTB).sum()), float(passes.sum()), passes.numel()],
            dtype=torch.float64, device=logit_LTB.device,
        )  # fmt: skip
    report = {"by_exit": {e: (losses[e].detach().sum(), n) for e in losses}, "decider": stats}
    return objective, torch.tensor(n, dtype=torch.int, device=objective.device), report


class DeciderStep(TrainStep):
    """:class:`TrainStep` with the decider job's forward and loss; logs the decider's metrics."""

    def __init__(self, *args: Any, decider: DeciderConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cfg = decider
        self.forward_step = partial(_forward_step, decider)

    def reduce(self, reports: list[dict]) -> tuple[float, dict[int, float], dict[str, float]]:
        _, by_loops = _reduce_by_loops(reports, self.max_loops)
        sums = torch.stack([r["decider"] for r in reports]).sum(0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # every rank: DP replicas add their tokens; TP ranks add disjoint shards (sequence parallel)
            # or count the same tokens in numerator and denominator alike (no sequence parallel)
            dist.all_reduce(sums)
        s = dict(zip(STATS, sums.tolist(), strict=True))
        bce = s["bce_sum"] / s["labels"]
        metrics = {
            "decider/bce": bce,
            "decider/continue_rate": s["continue"] / s["labels"],
            "decider/accuracy": s["correct"] / s["labels"],
            "decider/mean_passes": s["passes"] / s["tokens"],
        }
        lm = by_loops[self.max_loops] if self.cfg.lm_loss == "last" else sum(by_loops.values()) / len(by_loops)
        return lm + self.cfg.loss_weight * bce, by_loops, metrics


def freeze_backbone(net: LoopedMoEModel) -> None:
    """``backbone: frozen``: only the decider trains (before DDP: it builds buffers for trainable params)."""
    for name, p in net.named_parameters():
        if not name.startswith("decider."):
            p.requires_grad_(False)


def load_base(net: LoopedMoEModel, ckpt: Path) -> None:
    """The base model's tensors (``decider.init_from``) into a decider job's model at this layout; the
    decider keeps its initialisation. Only model tensors are read (no optimizer state). Collective."""
    from elastic_pretrain.checkpoint.manager import verify_everywhere
    from elastic_pretrain.checkpoint.tensors import load_tensors
    from elastic_pretrain.rundir import CheckpointFiles

    verify_everywhere(ckpt)
    load_tensors(net, None, CheckpointFiles(ckpt).tensors, exclude="decider.", what="the base model tensors")
