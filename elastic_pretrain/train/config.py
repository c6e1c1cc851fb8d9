"""Optimisation and loop-cadence settings of a run."""

from __future__ import annotations

import dataclasses
from typing import Literal

from elastic_pretrain.config import ConfigError, field

FaultPolicy = Literal["skip", "rollback", "stop"]


@dataclasses.dataclass(kw_only=True)
class SpikeConfig:
    """Loss-spike detector: a step whose loss rises above the trailing window's mean by more than
    ``max(sigmas * std, min_rise * mean)`` is a spike (docs/faults.md)."""

    policy: Literal["off", "skip", "rollback", "stop"] = field(
        "off", doc="What a spike does: 'off' (not checked), or the same policies as train.on_nonfinite."
    )
    window: int = field(100, doc="Trailing accepted steps whose losses make the reference (checked once full).")
    sigmas: float = field(6.0, doc="Rise over the window mean, in standard deviations of the window, that is a spike.")
    min_rise: float = field(0.1, doc="Smallest rise that is a spike, as a fraction of the window mean (noise floor).")

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ConfigError(f"train.spike.window: {self.window} must be >= 2 (a deviation needs two losses)")
        if self.sigmas <= 0 or self.min_rise < 0:
            raise ConfigError("train.spike: sigmas must be > 0 and min_rise >= 0")


@dataclasses.dataclass(kw_only=True)
class ProfileConfig:
    """A torch profiler window: steps ``start+1 .. start+steps`` are traced (docs/faults.md)."""

    start: int = field(doc="Steps completed before the trace starts (>= 1: the first step is a warm-up outlier).")
    steps: int = field(3, doc="Steps traced.")

    def __post_init__(self) -> None:
        if self.start < 1 or self.steps < 1:
            raise ConfigError(f"train.profile: need start >= 1 and steps >= 1, got {self.start}, {self.steps}")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """How long, how large a batch, how fast: AdamW via megatron-core, warmup + decay."""

    steps: int = field(doc="Optimizer steps of the whole run.")
    micro_batch_size: int = field(4, doc="Sequences per micro-batch per data-parallel rank.")
    global_batch_size: int = field(
        8, doc="Sequences per optimizer step over all ranks; micro-batches = global / (micro * data-parallel)."
    )
    lr: float = field(3e-3, doc="Peak learning rate.")
    min_lr: float = field(3e-4, doc="Learning rate at the end of the decay.")
    warmup_steps: int = field(20, doc="Linear warmup steps from 0 to lr.")
    decay: Literal["cosine", "linear", "constant", "WSD"] = field("cosine", doc="LR decay after warmup.")
    weight_decay: float = field(0.1, doc="AdamW decoupled weight decay.")
    adam_beta1: float = field(0.9, doc="AdamW beta1.")
    adam_beta2: float = field(0.95, doc="AdamW beta2.")
    clip_grad: float = field(1.0, doc="Global gradient-norm clip (0 disables).")
    seed: int = field(1234, doc="Seed of initialisation, data order and depth sampling.")
    log_interval: int = field(10, doc="Steps between progress lines / metric logs.")
    eval_interval: int = field(100, doc="Steps between validation runs (0: only at the end).")
    eval_sequences: int = field(64, doc="Held-out sequences evaluated at every loop count.")
    routing_interval: int = field(50, doc="Steps between routing-health probes (0: never).")
    peak_tflops: float | None = field(
        None,
        doc="Peak TFLOP/s of one device that MFU/HFU divide by; None: known GPUs by name (bf16, or fp8 when the "
        "model trains in FP8; dense data-sheet figures, train/mfu.py), no MFU on CPU.",
    )
    peak_flops_per_s: float | None = field(
        None, doc="Deprecated (older configs): the same peak in FLOP/s; use peak_tflops."
    )
    distributed_optimizer: bool = field(True, doc="Shard optimizer state over data-parallel ranks (ZeRO-1).")
    threads_per_rank: int = field(1, doc="torch intra-op threads per process (CPU runs).")
    recompute: Literal["none", "selective", "pass"] = field(
        "none",
        doc="Activation recompute: 'pass' keeps only each loop pass's input and recomputes the pass in backward "
        "(activations flat in ℓ); 'selective' recomputes core attention (megatron); docs/gpu.md.",
    )
    on_nonfinite: FaultPolicy = field(
        "skip",
        doc="A NaN/Inf loss or gradient norm: 'skip' the update (parameters and Adam state untouched), 'rollback' "
        "to the last committed checkpoint past the data window, or 'stop' the run (docs/faults.md).",
    )
    spike: SpikeConfig = field(factory=SpikeConfig, doc="Loss-spike detector and its policy.")
    max_consecutive_faults: int = field(
        3, doc="Stop after this many non-finite/spike events without the run getting past the previous one."
    )
    hang_timeout_s: float = field(
        1800.0,
        doc="No step, evaluation or save finished for this long: every rank dumps its thread stacks to "
        "<run_dir>/hang/ and exits non-zero (0: no watchdog). Must exceed the slowest step plus a save.",
    )
    straggler_interval: int = field(
        100, doc="Steps between straggler reports (per-rank step and data-wait time; 0: never)."
    )
    profile: ProfileConfig | None = field(None, doc="Trace a window of steps with the torch profiler (None: off).")

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "micro_batch_size",
            "global_batch_size",
            "log_interval",
            "threads_per_rank",
            "max_consecutive_faults",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"global_batch_size: {self.global_batch_size} is not a multiple of micro_batch_size="
                f"{self.micro_batch_size}: make it one (each rank runs whole micro-batches)"
            )
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"lr/min_lr: need 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            # a short run of a job written for a long one (train.steps=20 on a 30-step warmup): say the override
            raise ConfigError(
                f"warmup_steps: {self.warmup_steps} must be in [0, steps={self.steps}): "
                f"add train.warmup_steps={self.steps // 10} (a tenth of the steps; 0 for none)"
            )
        if self.peak_tflops is not None and self.peak_flops_per_s is not None:
            raise ConfigError("train.peak_tflops and train.peak_flops_per_s both set: keep peak_tflops only")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"train.peak_tflops: must be > 0 (e.g. 989 for an H100 SXM), got {self.peak_tflops}")
        if self.eval_interval < 0:
            raise ConfigError("eval_interval: must be >= 0 (0 evaluates only at the end)")
        if self.hang_timeout_s < 0 or self.straggler_interval < 0:
            raise ConfigError("train.hang_timeout_s and train.straggler_interval: must be >= 0 (0 turns them off)")

    def micro_batches(self, dp_size: int) -> int:
        per_step = self.micro_batch_size * dp_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not divisible by micro_batch_size*data_parallel"
                f" = {self.micro_batch_size}*{dp_size}: make it a multiple of {per_step}"
            )
        return self.global_batch_size // per_step
