"""Pipeline parallelism of the loop on megatron-core's interleaved (virtual) pipeline schedule.

Pass j of the loop is virtual chunk j: stage s runs chunk j as pass j through the core layers it
holds (that pass's own attention, the stage's shared MoE MLPs and routers). Embedding and prelude run
at the start of chunk 0 on the first stage; coda, final norm and output layer after the last chunk on
the last stage (and after chunk e-1 there for an extra exit e). docs/parallelism.md has the diagram.

Chunks share parameters (every chunk of a stage uses the stage's shared experts), so they are not
separate modules: one megatron DDP wraps the stage's whole model, and :class:`PassChunk` objects are
parameter-less views of it, one per pass, handed to the schedule as its model list. The schedule's
config (a copy of the model's, with the pipeline layout) points its grad-sync hooks at that one DDP, so
gradients of every pass accumulate in one buffer and are reduced exactly once per step.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from elastic_pretrain.model.looped import LoopedMoEModel
from elastic_pretrain.parallel.config import check_micro_batches
from elastic_pretrain.parallel.device import device
from elastic_pretrain.parallel.mesh import expert_group_max_each
from elastic_pretrain.parallel.overlap import overlapped_step
from elastic_pretrain.schedule import DepthPlan


class PassChunk(torch.nn.Module):
    """Virtual pipeline chunk ``pass_idx`` of this stage: a view of the stage model, no parameters of its own.

    megatron's schedule reads ``config``, ``model_type`` and ``vp_stage`` from it and hands it the
    activation received from the previous stage through :meth:`set_input_tensor`.
    """

    ddp: DistributedDataParallel
    net: LoopedMoEModel

    def __init__(
        self, ddp: DistributedDataParallel, net: LoopedMoEModel, pass_idx: int, config: TransformerConfig
    ) -> None:
        super().__init__()
        # plain attributes, not submodules: the stage's parameters are registered once, by its DDP
        self.__dict__["ddp"] = ddp
        self.__dict__["net"] = net
        self.pass_idx = self.vp_stage = pass_idx
        self.config = config
        self.model_type = net.model_type
        self.input_tensor: Tensor | None = None

    def set_input_tensor(self, input_tensor: Tensor | list[Tensor | None] | None) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def set_is_first_microbatch(self) -> None:
        """megatron's schedule calls this before a chunk's first micro-batch of a step (and of an evaluation).
        Transformer Engine's layers cache their FP8 weights and re-quantize only on a call flagged this way:
        a chunk without it ran every step on the weights cast at step 1 (issue 30). The chunks share the stage's
        modules and chunk 0 runs first on every stage, so chunk 0 flags them all (megatron's own walk over the
        model's modules) and the others nothing: each module re-quantizes once per step, at its first call."""
        if self.pass_idx == 0:
            self.net.set_is_first_microbatch()


class Pipeline:
    """The chunks of this stage and the schedule that runs them (forward+backward, or forward only)."""

    def __init__(self, ddp: DistributedDataParallel, net: LoopedMoEModel, stages: int) -> None:
        self.ddp, self.net, self.stages = ddp, net, stages
        self.config = schedule_config(net.config, ddp, stages=stages, chunks=net.cfg.max_loops)
        self.chunks = [PassChunk(ddp, net, j, self.config) for j in range(net.cfg.max_loops)]
        self.run_schedule = get_forward_backward_func(pp_size=stages, vp_size=net.cfg.max_loops)

    @property
    def is_last_stage(self) -> bool:
        return self.net.post_process

    def run(
        self,
        forward_step: Callable[[Iterator[Any], PassChunk], Any],
        micro_batches: Sequence[Any],
        *,
        seq_length: int,
        micro_batch_size: int,
        forward_only: bool,
    ) -> list[dict]:
        """One schedule over ``micro_batches``; reports from the loss function (last stage only).

        Each chunk gets its own iterator of ``(micro-batch index, micro-batch)``: the interleaved
        schedule runs chunk 0 of micro-batch m+1 before chunk 1 of micro-batch m, and each chunk must
        know which micro-batch (and depth plan) it is running.
        """
        n = len(micro_batches)
        check_micro_batches(n, self.stages)
        # micro-batches per group of one chunk: megatron needs P <= group <= n and n % group 0 or >= P
        self.config.microbatch_group_size_per_vp_stage = self.stages if n % self.stages == 0 else n
        return self.run_schedule(
            forward_step_func=forward_step,
            data_iterator=[iter(list(enumerate(micro_batches))) for _ in self.chunks],
            model=self.chunks,
            num_microbatches=n,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )


def schedule_config(
    model_config: TransformerConfig, ddp: DistributedDataParallel, *, stages: int, chunks: int
) -> TransformerConfig:
    """The config megatron's interleaved schedule reads: the model's, with the pipeline layout.

    A copy, not the model's own config: the model's layers are built and numbered as one block
    (``pipeline_model_parallel_size=1``, no megatron layer offsets). Grad sync goes to the one DDP of
    the stage: ``no_sync`` while micro-batches run, then megatron's ``finalize_model_grads`` once,
    on that DDP (the schedule would otherwise call ``finish_grad_sync`` on every chunk it was given).
    """
    config = copy.copy(model_config)
    config.pipeline_model_parallel_size = stages
    config.virtual_pipeline_model_parallel_size = chunks
    config.microbatch_group_size_per_vp_stage = stages
    config.variable_seq_lengths = False
    # Unbatched p2p. Batched, with 2 stages (previous rank = next rank), one exchange of the interleaved
    # schedule posts "send grad to prev, send activation to next" on one rank and "receive activation
    # from prev, receive grad from next" on the other — the same peer, matched in posting order, so
    # activation and gradient (same shape) swap silently. Unbatched ops send the two directions
    # over two different groups (megatron's _p2p_ops); tests/parallel/test_pipeline.py caught this.
    config.batch_p2p_comm = False
    config.overlap_p2p_comm = False
    config.no_sync_func = ddp.no_sync
    config.grad_sync_func = None  # one buffer for all chunks: no per-chunk reduction may start early
    config.param_sync_func = None
    config.finalize_model_grads_func = _FinalizeOnce(ddp)
    return config


class _FinalizeOnce:
    """``finalize_model_grads_func`` for a chunk list that is one DDP: DP/EP reduction, TP norm
    all-reduce (sequence parallel) and per-token scaling exactly once."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def __call__(
        self,
        model: list[Any],
        num_tokens: Tensor | None = None,
        pg_collection: Any = None,
        force_all_reduce: bool | None = False,
    ) -> None:
        finalize_model_grads([self.ddp], num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


class AttachLoss(torch.autograd.Function):
    """Identity on an activation whose backward also starts the backward of ``loss`` (gradient 1).

    An extra exit e < ℓ ends on the last stage in chunk e-1, mid-pipeline: its loss is computed there
    and attached to the activation that moves on, so its gradient flows when that activation's does
    (the pattern of megatron's ``MoEAuxLossAutoScaler``). ``loss`` must already carry the schedule's
    scaling (1 / tokens / micro-batches, times the loss scale).
    """

    @staticmethod
    def forward(ctx: Any, h_TBD: Tensor, loss: Tensor) -> Tensor:
        ctx.save_for_backward(loss)
        return h_TBD

    @staticmethod
    def backward(ctx: Any, grad_TBD: Tensor) -> tuple[Tensor, Tensor]:
        (loss,) = ctx.saved_tensors
        return grad_TBD, torch.ones_like(loss)


# The micro-batch and the loss of its exits: what the training step (train/step.py, engine/deepspeed.py) and the
# evaluator (eval/loss.py) run, through one process's forward or through the pipeline (run_pipeline).


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    tokens_BT1: torch.Tensor  # [B, T+1]: inputs = [:, :-1], labels = [:, 1:]
    plan: DepthPlan


def _loss_func(plan: DepthPlan, losses_BT: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Objective = Σ over supervised exits of the per-token mean CE (all tokens count; packed data)."""
    n = next(iter(losses_BT.values())).numel()
    objective = torch.stack([losses_BT[e].sum() for e in plan.exits]).sum()
    report = {e: (losses_BT[e].detach().sum(), n) for e in plan.exits}
    # megatron divides the returned loss by num_tokens and by the number of micro-batches.
    num_tokens = torch.tensor(n, dtype=torch.int, device=objective.device)
    return objective, num_tokens, {"by_exit": report, "exits": len(plan.exits)}


class _ChunkForward:
    """``forward_step_func`` of the interleaved pipeline: micro-batch m through chunk j = pass j of this stage.

    Extra exits e < ℓ end on the last stage in chunk e-1: their loss is computed there, attached to the
    activation for backward (``AttachLoss``) and kept (detached, per micro-batch) for the loss function
    of the last chunk, which reports every exit as the 1-process step does.
    """

    def __init__(self, sync_loops: list[int], *, loss_scale: float, training: bool) -> None:
        self.sync_loops, self.loss_scale, self.training = sync_loops, loss_scale, training
        self.exit_losses: dict[int, dict[int, torch.Tensor]] = {}

    def __call__(self, data_iterator: Iterator[tuple[int, MicroBatch]], chunk: PassChunk) -> tuple[Any, Any]:
        with chunk.net.fp8_forward():  # delayed scaling: one FP8 autocast per chunk forward, its head included
            return self._forward(data_iterator, chunk)

    def _forward(self, data_iterator: Iterator[tuple[int, MicroBatch]], chunk: PassChunk) -> tuple[Any, Any]:
        m, mb = next(data_iterator)
        net, j, plan = chunk.net, chunk.pass_idx, mb.plan
        inputs, labels = mb.tokens_BT1[:, :-1].contiguous(), mb.tokens_BT1[:, 1:].contiguous()
        h_TBD = net.run_chunk(
            chunk.input_tensor, inputs, pass_idx=j, loops=plan.loops, sync_loops=self.sync_loops[m], key=m
        )
        if not net.post_process:
            return h_TBD, None
        if j + 1 < net.cfg.max_loops:  # not the last chunk: an extra exit may end here
            if j + 1 in plan.exits and j + 1 < plan.loops:
                losses_BT = net.head_losses(h_TBD, inputs, labels)
                self.exit_losses.setdefault(m, {})[j + 1] = losses_BT.detach()
                if self.training:  # megatron's scaling of the final loss: / tokens / micro-batches, x loss scale
                    h_TBD = AttachLoss.apply(h_TBD, losses_BT.sum() * (self.loss_scale / losses_BT.numel()))
            return h_TBD, None
        losses = {**self.exit_losses.pop(m, {}), plan.loops: net.head_losses(h_TBD, inputs, labels)}
        return losses, partial(_loss_func, plan)


def group_loops(micro_batches: list[MicroBatch]) -> list[int]:
    """The passes each micro-batch's MoE calls run for (its EP group's max ℓ): computed locally by the
    schedule controller (``DepthPlan.group_loops``); only hand-built plans agree with one all-reduce."""
    known = [mb.plan.group_loops for mb in micro_batches]
    if all(g is not None for g in known):
        return [int(g) for g in known]  # type: ignore[arg-type]
    return expert_group_max_each([mb.plan.loops for mb in micro_batches])


def run_pipeline(pipeline: Pipeline, micro_batches: list[MicroBatch], *, seq_len: int, training: bool) -> list[dict]:
    """The interleaved pipeline schedule over one step's micro-batches (forward+backward or forward only)."""
    sync = group_loops(micro_batches)  # EP-safe mixed depth
    grad_scale = pipeline.config.grad_scale_func
    loss_scale = float(grad_scale(torch.ones(1, device=device()))) if grad_scale is not None and training else 1.0
    forward = _ChunkForward(sync, loss_scale=loss_scale / len(micro_batches), training=training)
    if not training:
        return pipeline.run(
            forward,
            micro_batches,
            seq_length=seq_len,
            micro_batch_size=micro_batches[0].tokens_BT1.shape[0],
            forward_only=True,
        )
    with overlapped_step(pipeline.ddp, forward, len(micro_batches) * len(pipeline.chunks)) as forward_step:
        return pipeline.run(
            forward_step,
            micro_batches,
            seq_length=seq_len,
            micro_batch_size=micro_batches[0].tokens_BT1.shape[0],
            forward_only=False,
        )
