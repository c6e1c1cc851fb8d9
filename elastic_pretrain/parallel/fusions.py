"""Throughput switches for GPU machines: fused kernels, grouped-GEMM experts, the MoE dispatcher.

``model.fusions`` and ``model.moe_grouped_gemm`` are ``auto`` by default: on where CUDA and
Transformer Engine are present, off elsewhere, so a CPU run keeps its exact numerics. Asking for
one explicitly (``on``, or ``model.moe_dispatcher=flex``) on a machine without them is a one-line
error naming the fix — never a silent fallback that would change what a cluster job computes
(docs/gpu.md, "Fusions").
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging

import torch

from elastic_pretrain.config import ConfigError
from elastic_pretrain.model.config import ModelConfig

log = logging.getLogger(__name__)


def cuda_te_available() -> bool:
    """CUDA and Transformer Engine both present (the TE layer spec and every fused kernel need both)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


@dataclasses.dataclass(frozen=True)
class Fusions:
    """What a job runs with on this machine (resolved from the ``auto|on|off`` switches)."""

    kernels: bool  # bias+SwiGLU, bias-dropout-add, masked softmax, RoPE, cross-entropy, MoE permute/unpermute
    router: bool  # fused router top-k/softmax (off under route replay: it bypasses megatron's RouterReplay)
    grouped_gemm: bool  # experts as TE grouped GEMMs (TEGroupedMLP) instead of a per-expert loop


def resolve(model: ModelConfig) -> Fusions:
    """The switches of ``model`` on this machine; ConfigError when one asked for is unavailable."""
    have = cuda_te_available()
    for name in ("fusions", "moe_grouped_gemm"):
        if getattr(model, name) == "on" and not have:
            raise ConfigError(
                f"model.{name}=on needs CUDA and Transformer Engine, which this machine lacks: "
                f"use model.{name}=auto (on where they exist) or off"
            )
    if model.moe_dispatcher == "flex":
        if not have:
            raise ConfigError(
                "model.moe_dispatcher=flex needs CUDA, Transformer Engine and DeepEP, which this machine lacks: "
                "use model.moe_dispatcher=alltoall"
            )
        if importlib.util.find_spec("deep_ep") is None:
            raise ConfigError(
                "model.moe_dispatcher=flex needs DeepEP (github.com/deepseek-ai/DeepEP), which is not installed: "
                "install it or use model.moe_dispatcher=alltoall"
            )
    kernels = model.fusions == "on" or (model.fusions == "auto" and have)
    grouped = model.moe_grouped_gemm == "on" or (model.moe_grouped_gemm == "auto" and have)
    if kernels and model.route_replay:
        # megatron's fused top-k never consults RouterReplay: passes >= 1 would route afresh, silently
        log.info("model.route_replay: router fusion stays off (the fused top-k cannot replay routes)")
    return Fusions(kernels=kernels, router=kernels and not model.route_replay, grouped_gemm=grouped)


def apex_wgrad_available() -> bool:
    """Apex's ``fused_weight_gradient_mlp_cuda`` imports: megatron's own linears (the output layer) need it for
    fused weight-gradient accumulation, and refuse to build with it on otherwise (the same import test)."""
    try:
        importlib.import_module("fused_weight_gradient_mlp_cuda")
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class WgradFusion:
    """Where weight gradients are accumulated in the GEMM, straight into megatron DDP's fp32 ``main_grad``."""

    te: bool  # Transformer Engine's linears (``fuse_wgrad_accumulation``): every layer's GEMMs, experts included
    head: bool  # the output layer, megatron's local ColumnParallelLinear (Apex's kernel)


def wgrad_fusion(*, main_grad: bool) -> WgradFusion:
    """Fused weight-gradient accumulation on this machine, for a model whose parameters get megatron DDP's
    ``main_grad`` buffers (``main_grad``: the trainer's models; not DeepSpeed's or a bare model, where a fused
    GEMM would have nothing to write into).

    Without it a shared module's weight gradient is summed over the ℓ passes of a micro-batch in the
    parameter's dtype (bf16) by autograd before it reaches the fp32 ``main_grad`` (issue 30, item 6); with it
    every pass's GEMM adds its product into ``main_grad`` in fp32."""
    te = main_grad and cuda_te_available()
    return WgradFusion(te=te, head=te and apex_wgrad_available())
