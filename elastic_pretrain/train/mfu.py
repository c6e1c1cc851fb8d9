"""Model and hardware FLOPs utilisation of a step, against a named per-device peak.

**MFU** counts the FLOPs the model needs for what a step trained (global means of ℓ and the supervised exits
over data-parallel replicas, × 3 for forward + backward); **HFU** adds what the hardware also executed: the
recomputed forward and the one-token MoE calls of ghost passes, whose share is reported on its own
(``ghost_pass_fraction``, ``depth_efficiency``): they cost little FLOPs but idle time. Peaks are dense data-sheet
numbers matched on the device name; ``train.peak_tflops`` overrides them (the only MFU on CPU).
docs/gpu.md, "MFU"; docs/elastic-depth.md, "Depth efficiency".
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.model.flops import attention_flops, dense_mlp_flops, moe_mlp_flops
from elastic_pretrain.model.vocab import padded_vocab_size

Precision = Literal["bf16", "fp8"]
Recompute = Literal["none", "selective", "pass"]


@dataclasses.dataclass(frozen=True)
class Peak:
    """Dense tensor-core peak FLOP/s of one device (data sheet, no sparsity)."""

    name: str
    bf16: float
    fp8: float | None  # None: no FP8 tensor cores (A100)


# Matched in order against torch.cuda.get_device_name(): specific names before the family.
# "NVIDIA H100 80GB HBM3" is the SXM part; PCIe and NVL name themselves.
PEAKS: tuple[tuple[str, Peak], ...] = (
    ("H100 NVL", Peak("H100 NVL", 835e12, 1671e12)),
    ("H100 PCIe", Peak("H100 PCIe", 756e12, 1513e12)),
    ("H100", Peak("H100 SXM", 989e12, 1979e12)),
    ("H200 NVL", Peak("H200 NVL", 835e12, 1671e12)),
    ("H200", Peak("H200 SXM", 989e12, 1979e12)),
    ("A100", Peak("A100", 312e12, None)),
    ("B200", Peak("B200", 2250e12, 4500e12)),
)


def known_peak(device_name: str) -> Peak | None:
    for key, peak in PEAKS:
        if key in device_name:
            return peak
    return None


def device_peak(
    configured_tflops: float | None, *, precision: Precision = "bf16", device_name: str | None = None
) -> tuple[float, str] | None:
    """(peak FLOP/s, its name) that MFU divides by; None when unknown (CPU or an unlisted GPU, no setting).

    ``precision``: ``fp8`` when the model trains in FP8 (the FP8 peak; a device without FP8 uses its
    bf16 peak). fp32 models are measured against the bf16 peak, the figure clusters are sized by."""
    if configured_tflops:
        return configured_tflops * 1e12, f"{configured_tflops:g} TFLOP/s (train.peak_tflops)"
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    peak = known_peak(device_name)
    if peak is None:
        return None
    if precision == "fp8" and peak.fp8 is not None:
        return peak.fp8, f"{peak.fp8 / 1e12:g} TFLOP/s ({peak.name} fp8 dense)"
    return peak.bf16, f"{peak.bf16 / 1e12:g} TFLOP/s ({peak.name} bf16 dense)"


@dataclasses.dataclass(frozen=True)
class DepthCounts:
    """What one step ran, as means per micro-batch over every data-parallel replica."""

    loops: float  # passes ℓ
    exits: float  # supervised exits (coda + output layer runs)
    ghost_passes: float  # passes joined as a ghost (expert-parallel group deeper than this micro-batch)
    # mean / max over replicas of the passes each executed in the step (ghosts included): the share of
    # the step the slowest replica keeps the others waiting for at the gradient reduction (depth
    # efficiency does not see it; schedule.balance: compute targets it)
    balance: float = 1.0
    # ghost passes run every module of a real pass on the micro-batch's tokens (DeepSpeed ZeRO-3's gathers, not
    # expert parallelism's one-token MoE calls): their hardware FLOPs are a real pass's
    full_ghosts: bool = False

    @property
    def efficiency(self) -> float:
        """``depth_efficiency``: useful passes / executed passes (1.0: no rank idled in a ghost pass)."""
        executed = self.loops + self.ghost_passes
        return self.loops / executed if executed else 1.0


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs per token of one training step (forward + backward)."""

    model: float  # what the model needs: MFU's numerator
    hardware: float  # + recompute + ghost calls: HFU's numerator
    ghost_pass_fraction: float  # ghost passes / executed passes


def step_flops(
    cfg: ModelConfig,
    depth: DepthCounts,
    *,
    seq_len: int,
    micro_batch_tokens: int,
    recompute: Recompute = "none",
    padded_vocab: int | None = None,
) -> StepFlops:
    """Matmul FLOPs per trained token (the formula of ``model/flops.py``, per part of the model)."""
    vocab = padded_vocab_size(cfg.vocab_size, 1) if padded_vocab is None else padded_vocab
    ctx = (seq_len + 1) / 2  # keys a query sees on average under a causal mask (as model/flops.py counts)
    attn = attention_flops(cfg, ctx)
    edge = attn + (moe_mlp_flops(cfg) if cfg.edge_mlp == "moe" else dense_mlp_flops(cfg))
    core_pass = cfg.core_layers_built * (attn + moe_mlp_flops(cfg))
    head = cfg.coda_layers * edge + 2 * cfg.hidden_size * vocab
    forward = cfg.prelude_layers * edge + depth.loops * core_pass + depth.exits * head
    model = 3.0 * forward
    # a ghost pass sends one token through every core layer's MoE MLP, forward and backward (full: a whole pass)
    ghost_pass = core_pass if depth.full_ghosts else cfg.core_layers_built * moe_mlp_flops(cfg) / micro_batch_tokens
    ghost = 3.0 * depth.ghost_passes * ghost_pass
    if recompute == "pass":
        extra = depth.loops * core_pass + depth.ghost_passes * ghost_pass
    elif recompute == "selective":  # megatron recomputes core attention (QKᵀ, softmax, ·V) of every layer run
        attentions = cfg.prelude_layers + depth.loops * cfg.core_layers_built + depth.exits * cfg.coda_layers
        extra = attentions * 4 * ctx * cfg.hidden_size
    else:
        extra = 0.0
    executed = depth.loops + depth.ghost_passes
    return StepFlops(
        model=model,
        hardware=model + ghost + extra,
        ghost_pass_fraction=depth.ghost_passes / executed if executed else 0.0,
    )


def ghost_time_share(cfg: ModelConfig, depth: DepthCounts, *, seq_len: int) -> float:
    """Estimated share of a step's compute time spent in ghost passes.

    A ghost pass does almost no FLOPs of its own, but the rank waits inside the all-to-all for its
    peer's real pass, so it costs the wall time of one real core pass. The share is therefore the
    ghost passes' part of the FLOPs the step would take if every executed pass were a real one
    (forward + backward alike; recompute ignored). An estimate, not a timer: on a GPU a host timer
    around asynchronous NCCL calls would measure kernel launches, not the wait."""
    as_real = step_flops(
        cfg,
        DepthCounts(loops=depth.loops + depth.ghost_passes, exits=depth.exits, ghost_passes=0),
        seq_len=seq_len,
        micro_batch_tokens=1,
    ).model
    useful = step_flops(
        cfg, DepthCounts(loops=depth.loops, exits=depth.exits, ghost_passes=0), seq_len=seq_len, micro_batch_tokens=1
    ).model
    return (as_real - useful) / as_real if as_real else 0.0


def utilisation(flops: StepFlops, *, tokens_per_s: float, devices: int, peak_flops_per_s: float) -> dict[str, float]:
    """``mfu``, ``hfu`` in [0, 1] and ``ghost_pass_fraction`` for a step rate over ``devices`` devices."""
    per_device = tokens_per_s / devices
    return {
        "mfu": per_device * flops.model / peak_flops_per_s,
        "hfu": per_device * flops.hardware / peak_flops_per_s,
        "ghost_pass_fraction": flops.ghost_pass_fraction,
    }


def baseline_flops_per_token(cfg: ModelConfig, *, seq_len: int) -> float:
    """Training FLOPs per token of the matched non-looped baseline: the same model at ℓ = 1, one exit.

    ELR's compute comparison (seeds/003: "Mixed-depth training from scratch costs an estimated 1.62
    times the baseline's training compute") divides a run's training compute by this, at equal tokens.
    """
    return step_flops(
        cfg, DepthCounts(loops=1.0, exits=1.0, ghost_passes=0.0), seq_len=seq_len, micro_batch_tokens=seq_len
    ).model
