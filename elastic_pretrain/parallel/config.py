"""The mesh layout of a job (``parallel:``): plain data, no torch import (the CLI validates jobs with it)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from elastic_pretrain.config import ConfigError, field


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout of one job. Data parallelism is what is left of the world size."""

    tensor: int = field(1, doc="Tensor-parallel size (attention heads and FFN columns split across ranks).")
    expert: int = field(1, doc="Expert-parallel size (experts split across ranks; tokens move by all-to-all).")
    pipeline: int = field(1, doc="Pipeline-parallel stages (the loop maps onto virtual stages; see docs).")
    sequence_parallel: Literal["auto", "on", "off"] = field(
        "auto", doc="Sequence parallelism; 'auto' turns it on when tensor > 1 (megatron requires it for MoE + TP)."
    )
    backend: Literal["auto", "gloo", "nccl"] = field(
        "auto", doc="torch.distributed backend; 'auto' = nccl with CUDA, gloo without."
    )
    grad_reduce: Literal["after_backward", "overlap"] = field(
        "after_backward",
        doc="Data-parallel gradient reduction: one reduction after backward, or 'overlap' — each bucket's "
        "reduction starts during backward once its gradients are final, under any mix of loop counts "
        "(megatron engine; docs/elastic-depth.md).",
    )
    param_gather: Literal["after_step", "overlap"] = field(
        "after_step",
        doc="Distributed optimizer's parameter all-gather: at the end of the optimizer step, or 'overlap' — "
        "started after the step, each bucket awaited by the next forward's first use of it (needs "
        "grad_reduce: overlap; no effect without train.distributed_optimizer; docs/gpu.md).",
    )
    bucket_size: int = field(
        0,
        doc="Parameters per data-parallel communication bucket under grad_reduce: overlap; 0 = chosen from the "
        "parameters per rank and the DP size (parallel/overlap.py: bucket_size_for).",
    )
    timeout_minutes: int = field(10, doc="Collective timeout; a hang fails after this long instead of forever.")

    def __post_init__(self) -> None:
        for name in ("tensor", "expert", "pipeline"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.bucket_size < 0:
            raise ConfigError(f"bucket_size: must be >= 0 (0 = from the model size), got {self.bucket_size}")
        if self.param_gather == "overlap" and self.grad_reduce != "overlap":
            raise ConfigError(
                "param_gather=overlap needs grad_reduce=overlap (its DDP starts the gathers in one order on every "
                "rank): set parallel.grad_reduce=overlap or parallel.param_gather=after_step"
            )

    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.model_parallel_size()
        if world_size % mp:
            raise ConfigError(
                f"parallel: world size {world_size} is not divisible by tensor*pipeline = {mp}: "
                "change --nproc-per-node or parallel.tensor/pipeline"
            )
        dp = world_size // mp
        if (self.tensor * dp) % (self.expert) or dp * self.tensor < self.expert:
            raise ConfigError(
                f"parallel.expert={self.expert} does not divide tensor*data = {self.tensor * dp} "
                f"(world size {world_size}): pick an expert size that divides it"
            )
        return dp

    def use_sequence_parallel(self) -> bool:
        return self.sequence_parallel == "on" or (self.sequence_parallel == "auto" and self.tensor > 1)


def check_micro_batches(
    n: int, stages: int, fix: str = "raise train.global_batch_size (or lower train.micro_batch_size)"
) -> None:
    """The pipeline schedule needs at least one micro-batch per stage."""
    if n < stages:
        raise ConfigError(
            f"parallel.pipeline={stages} needs at least {stages} micro-batches per step and replica, got {n}: {fix}"
        )
