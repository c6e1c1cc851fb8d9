"""megatron-core wiring: TransformerConfig from our configs, layer-spec choice (TE vs local), DDP.

Transformer Engine's spec (and FP8) is chosen only when TE imports *and* CUDA is present; otherwise
the local spec, with one log line saying so.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from elastic_pretrain.config import ConfigError
from elastic_pretrain.internals import require
from elastic_pretrain.model.config import GhostKind, ModelConfig, RunModes
from elastic_pretrain.model.decider import DeciderConfig
from elastic_pretrain.model.looped import LayerSpecs, LoopedMoEModel
from elastic_pretrain.model.vocab import padded_vocab_size
from elastic_pretrain.parallel import fusions
from elastic_pretrain.parallel.device import device
from elastic_pretrain.parallel.mesh import ParallelConfig

log = logging.getLogger(__name__)


def te_available() -> bool:
    return fusions.cuda_te_available()


Recompute = Literal["none", "selective", "pass"]


def _precision_kwargs(model: ModelConfig, parallel: ParallelConfig) -> dict[str, Any]:
    """``TransformerConfig`` FP8 fields for ``model.fp8`` (none when off). FP8 without Transformer Engine
    + CUDA is refused, never silently dropped: a cluster job's numerics must be what its config says."""
    if model.fp8 == "off":
        return {}
    if not te_available():
        raise ConfigError(
            f"model.fp8={model.fp8} needs CUDA and Transformer Engine (pip install 'elastic-pretrain[gpu]', or an "
            "NGC PyTorch container): run on a GPU machine with TE, or set model.fp8=off"
        )
    model.check_fp8_layout(tensor=parallel.tensor, tokens=None)
    check_fp8_device(model.fp8, device_capability())
    return dict(
        # E4M3 forward / E5M2 gradients for the per-tensor recipes; the block-scaled ones use E4M3 throughout
        fp8="hybrid" if model.fp8 in ("delayed", "tensorwise") else "e4m3",
        fp8_recipe=model.fp8,
        # Delayed scaling all-reduces amax histories at every autocast exit. Replicas run different ℓ
        # under mixed depth (a different number of exits), so reduce over TP only: every TP rank of a
        # replica runs the same passes. Current/block scaling needs no history reduction.
        tp_only_amax_red=model.fp8 == "delayed",
    )


# The oldest GPU each recipe's GEMMs run on (Transformer Engine 2.9-2.11's own checks, made at its first autocast):
# FP8 from Ada/Hopper, 128-element block scaling from Hopper (with CUDA >= 12.9), MXFP8 on Blackwell only.
FP8_MIN_CAPABILITY: dict[str, tuple[tuple[int, int], str, str]] = {
    "delayed": ((8, 9), "Ada or Hopper", "off"),
    "tensorwise": ((8, 9), "Ada or Hopper", "off"),
    "blockwise": ((9, 0), "Hopper", "tensorwise"),
    "mxfp8": ((10, 0), "Blackwell", "blockwise (Hopper) or tensorwise"),
}


def device_capability() -> tuple[int, int]:
    """The CUDA compute capability of this process's device (tests stand in a value here)."""
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def check_fp8_device(recipe: str, capability: tuple[int, int]) -> None:
    """Refuse a recipe this GPU cannot run, in one line when the model is built (on the GPU machine), instead of
    Transformer Engine's assertion inside the first forward."""
    need, name, instead = FP8_MIN_CAPABILITY[recipe]
    if capability < need:
        raise ConfigError(
            f"model.fp8={recipe} needs a GPU of compute capability {need[0]}.{need[1]} or higher ({name}); this one "
            f"is {capability[0]}.{capability[1]}: set model.fp8={instead}"
        )


def _recompute_kwargs(recompute: Recompute) -> dict[str, Any]:
    """``selective``: megatron's core-attention recompute (the looped model calls each layer's attention
    module, which checkpoints itself). ``pass`` is the looped model's own (``RunModes.recompute``)."""
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return {}


def transformer_config(
    model: ModelConfig, parallel: ParallelConfig, *, recompute: Recompute = "none", main_grad: bool = False
) -> TransformerConfig:
    """The megatron ``TransformerConfig`` for our model on this layout (CPU-safe settings when no CUDA).

    ``main_grad``: the model will be wrapped in megatron's DDP, whose fp32 ``main_grad`` buffers the fused
    weight-gradient accumulation writes into (``fusions.wgrad_fusion``)."""
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if model.dtype == "bf16" else torch.float32
    model.check_fp8_recompute(recompute)
    kwargs: dict[str, Any] = {**_precision_kwargs(model, parallel), **_recompute_kwargs(recompute)}
    return TransformerConfig(
        num_layers=model.num_unique_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_heads,
        num_query_groups=model.query_groups,
        qk_layernorm=model.qk_norm,
        ffn_hidden_size=model.ffn_hidden_size,
        kv_channels=model.hidden_size // model.num_heads,
        normalization=model.normalization,
        gated_linear_unit=True,  # SwiGLU experts and dense MLPs
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        params_dtype=dtype,
        bf16=model.dtype == "bf16",
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tensor,
        # The model's layers are placed on pipeline stages by LoopedMoEModel itself (global layer numbers);
        # megatron would add a per-stage layer offset. The schedule gets its own config (parallel/pipeline.py).
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=1,
        sequence_parallel=parallel.use_sequence_parallel(),
        num_moe_experts=model.experts_built,
        moe_router_topk=model.moe_top_k,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff or None,
        moe_router_load_balancing_type=model.moe_load_balancing,
        moe_token_dispatcher_type=model.moe_dispatcher,
        moe_enable_routing_replay=model.route_replay,
        use_cpu_initialization=not on_gpu,
        persist_layer_norm=False,  # an Apex-only kernel
        **_wgrad_kwargs(main_grad),
        **_fusion_kwargs(model),
        **kwargs,
    )


def _wgrad_kwargs(main_grad: bool) -> dict[str, Any]:
    """Fused weight-gradient accumulation in Transformer Engine's linears (docs/gpu.md, "Fusions").

    With it, TE's GEMM for a call made with ``is_first_microbatch=True`` *overwrites* ``main_grad`` instead of
    adding to it (TE's shortcut for a module called once per micro-batch). The looped model calls its shared
    modules ℓ times per micro-batch (the MoE MLPs, tied attention, the coda once per exit), so that overwrite
    would drop the other calls' gradients of the first micro-batch. ``disable_parameter_transpose_cache``
    makes megatron's TE layers pass ``is_first_microbatch=None``: every call accumulates, and every call
    quantizes its weight afresh under FP8 (no cached FP8 weight to go stale; the cost is one weight cast per
    call instead of one per step)."""
    fused = fusions.wgrad_fusion(main_grad=main_grad).te
    return dict(gradient_accumulation_fusion=fused, disable_parameter_transpose_cache=fused)


def output_layer_config(config: TransformerConfig) -> TransformerConfig:
    """The output layer's config: the model's, with fused weight-gradient accumulation only where Apex's
    kernel imports (the output layer is megatron's local ColumnParallelLinear, which refuses to build without
    it; TE's linears need no Apex)."""
    if not config.gradient_accumulation_fusion or fusions.apex_wgrad_available():
        return config
    head = copy.copy(config)
    head.gradient_accumulation_fusion = False
    return head


def _fusion_kwargs(model: ModelConfig) -> dict[str, Any]:
    """The throughput switches as TransformerConfig fields (parallel/fusions.py): all off on CPU, where
    megatron's defaults would assume CUDA/TE kernels; ``auto`` turns them on with CUDA + TE."""
    f = fusions.resolve(model)
    kw: dict[str, Any] = dict(
        bias_activation_fusion=f.kernels,  # SwiGLU without bias: megatron's fused bias_swiglu
        bias_dropout_fusion=f.kernels,
        masked_softmax_fusion=f.kernels,
        apply_rope_fusion=f.kernels,
        cross_entropy_loss_fusion=f.kernels,  # megatron's fused vocab-parallel CE ("native" impl)
        moe_permute_fusion=f.kernels,
        moe_router_fusion=f.router,
        moe_grouped_gemm=f.grouped_gemm,  # the TE layer spec builds TEGroupedMLP experts to match
    )
    if model.moe_dispatcher == "flex":
        kw["moe_flex_dispatcher_backend"] = "deepep"
    return kw


_SAID = {"local_spec": False}


def layer_specs(model: ModelConfig, backend: Literal["te", "local"] | None = None) -> LayerSpecs:
    """megatron's TE layer spec with CUDA + TE (``backend`` None), else its local spec (torch modules).

    Both build the same model (tests/model/test_te_spec.py): the TE spec fuses each layer's input norm
    (and a dense MLP's norm) into the linear after it, so its ``input_layernorm`` is ``IdentityOp`` and
    the final norm gets its own spec — TENorm — instead of being copied from a layer's."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    backend = backend or ("te" if te_available() else "local")
    if backend == "te":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        log.info("Transformer Engine + CUDA found: using the TE layer spec")
        grouped = fusions.resolve(model).grouped_gemm
        dense = specs.get_gpt_layer_with_transformer_engine_spec(num_experts=None, qk_layernorm=model.qk_norm)
        moe = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.experts_built, moe_grouped_gemm=grouped, qk_layernorm=model.qk_norm
        )
        return LayerSpecs(dense=dense, moe=moe, norm=TESpecProvider().layer_norm())
    if not _SAID["local_spec"]:  # once per process: evaluation builds a model per checkpoint (issue 33 item 12)
        _SAID["local_spec"] = True
        log.info("no Transformer Engine/CUDA: using megatron-core's local layer spec (torch modules)")
    dense = specs.get_gpt_layer_local_spec(
        num_experts=None, normalization=model.normalization, qk_layernorm=model.qk_norm
    )
    moe = specs.get_gpt_layer_local_spec(
        num_experts=model.experts_built, normalization=model.normalization, qk_layernorm=model.qk_norm
    )
    return LayerSpecs(dense=dense, moe=moe, norm=dense.submodules.input_layernorm)


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    decider: DeciderConfig | None = None,
    recompute: Recompute = "none",
    ghosts: GhostKind = "moe_calls",
    main_grad: bool = False,
) -> LoopedMoEModel:
    """Build the looped model (this pipeline stage's part of it) for the current process's place in the
    (already initialised) mesh (with an iteration decider submodule when ``decider`` is given: a decider job
    or its checkpoints; ``recompute``: ``train.recompute``; ``ghosts``: how it joins deeper partners' passes,
    ``RunModes.ghosts``; ``main_grad``: it will be wrapped in megatron's
    DDP, see :func:`transformer_config`)."""
    from megatron.core import parallel_state

    require("megatron", "torch")  # a private name the model or checkpoints use, gone in this version: one line
    check_pipeline(model, parallel)
    tconfig = transformer_config(model, parallel, recompute=recompute, main_grad=main_grad)
    net = LoopedMoEModel(
        model,
        tconfig,
        layer_specs(model),
        padded_vocab=padded_vocab_size(model.vocab_size, parallel.tensor),
        stage=parallel_state.get_pipeline_model_parallel_rank(),
        stages=parallel.pipeline,
        decider=decider,
        head_config=output_layer_config(tconfig),
        modes=RunModes(recompute=recompute, ghosts=ghosts),
    )
    mark_tp_replicated_experts(net, parallel)

    shard = net.padded_vocab // parallel.tensor
    rank = parallel_state.get_tensor_model_parallel_rank()
    net.set_vocab_shard(rank * shard, (rank + 1) * shard)
    net.to(device())  # parameters built on the host (use_cpu_initialization on CPU) move too; a no-op on CPU
    return net


def check_pipeline(model: ModelConfig, parallel: ParallelConfig) -> None:
    """What pipeline parallelism of the loop needs from the model (docs/parallelism.md)."""
    model.check_pipeline(parallel.pipeline)


def mark_tp_replicated_experts(net: torch.nn.Module, parallel: ParallelConfig) -> None:
    """With TP > 1, expert-TP = 1 and EP = 1, every TP rank holds all experts but routes only its own
    sequence shard through them, so each rank's expert gradient is partial. megatron tags expert
    weights ``allreduce=True`` (dense) whenever EP == 1 and reduces them over DP only — the TP
    replicas would silently diverge. Tag them as expert-parallel params instead: DDP then sums them
    over the expert-data-parallel group (TP x DP ranks), which is the full gradient
    (tests/parallel/test_equivalence.py checks it against one process)."""
    if parallel.tensor > 1 and parallel.expert == 1:
        for name, p in net.named_parameters():
            if ".experts." in name:
                p.allreduce = False  # type: ignore[attr-defined]
