"""Which engine runs the numerics of a job, and the DeepSpeed (ZeRO) settings of the ``deepspeed`` one.

``engine: megatron`` (the default) trains through megatron-core's DDP + distributed optimizer on any
TP/PP/EP/DP mesh. ``engine: deepspeed`` wraps the same looped model (built from megatron-core modules
by ``parallel/megatron.py``) in ``deepspeed.initialize`` with ZeRO stage 1, 2 or 3: data parallel only
(docs/engines.md). Nothing here imports DeepSpeed: a job is validated on any machine.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

from elastic_pretrain.config import ConfigError, field

if TYPE_CHECKING:  # job.py nests this module's config: at run time the import would go upward
    from elastic_pretrain.job import JobConfig

Engine = Literal["megatron", "deepspeed"]
Offload = Literal["none", "cpu", "nvme"]
ZeroStage = Literal[1, 2, 3]


@dataclasses.dataclass(kw_only=True)
class DeepSpeedConfig:
    """ZeRO settings of ``engine: deepspeed``; the optimizer, LR schedule, batch sizes, clipping and
    precision come from ``train``/``model`` (one generated ``deepspeed_config.json`` in the run directory)."""

    zero_stage: ZeroStage = field(2, doc="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.")
    offload_optimizer: Offload = field(
        "none", doc="Where ZeRO keeps optimizer state and runs the update: none (the device), cpu, nvme (stage >= 1)."
    )
    offload_param: Offload = field("none", doc="ZeRO-3 only: where partitioned parameters live between uses.")
    nvme_path: str | None = field(None, doc="Folder for nvme offload (a fast local disk on every node).")
    param_persistence_threshold: int = field(
        100_000,
        doc="ZeRO-3: parameters with fewer elements stay whole on every rank (never gathered); DeepSpeed's default.",
    )
    reduce_bucket_size: int = field(
        500_000_000,
        doc="Elements per gradient-reduction (and ZeRO-3 gather) bucket, capped at the model's parameter count: "
        "ZeRO-3 allocates a whole bucket up front (5e8 fp32 elements = 1.9 GiB per rank for a 0.7 M model).",
    )

    def __post_init__(self) -> None:
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ConfigError(
                f"deepspeed.offload_param={self.offload_param} partitions parameters, which only ZeRO-3 does: "
                "set deepspeed.zero_stage=3 or deepspeed.offload_param=none"
            )
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise ConfigError("deepspeed: nvme offload needs a folder: set deepspeed.nvme_path=/local/nvme/dir")
        if self.param_persistence_threshold < 0:
            raise ConfigError(
                f"deepspeed.param_persistence_threshold: must be >= 0, got {self.param_persistence_threshold}"
            )
        if self.reduce_bucket_size < 1:
            raise ConfigError(f"deepspeed.reduce_bucket_size: must be >= 1, got {self.reduce_bucket_size}")


def check_engine(job: JobConfig) -> None:
    """Refuse, in one line naming the fix, what ``engine: deepspeed`` cannot run (called by JobConfig)."""
    if job.engine != "deepspeed":
        return
    p = job.parallel
    if (p.tensor, p.pipeline, p.expert) != (1, 1, 1):
        raise ConfigError(
            f"engine=deepspeed is data parallel only, but the mesh has tensor={p.tensor} pipeline={p.pipeline} "
            f"expert={p.expert}: use parallel=single (every rank a data-parallel replica) or engine=megatron"
        )
    if job.decider is not None:
        raise ConfigError("engine=deepspeed does not train an iteration decider: use engine=megatron for decider jobs")
    if job.model.fp8 != "off":
        raise ConfigError(
            f"engine=deepspeed runs bf16/fp32 only (model.fp8={job.model.fp8}): set model.fp8=off or engine=megatron"
        )
    if job.schedule.balance != "off" and job.deepspeed.zero_stage == 3:
        raise ConfigError(
            f"schedule.balance={job.schedule.balance} deals unequal micro-batch counts per rank, whose module calls "
            "ZeRO-3's parameter gathers cannot pair: use deepspeed.zero_stage=2 (or 1), or schedule.balance=off"
        )
    if job.schedule.exit_axis != "loop":
        raise ConfigError(
            f"schedule.exit_axis={job.schedule.exit_axis} (layer exits) is not wired into the DeepSpeed engine: use "
            "schedule.exit_axis=loop or engine=megatron"
        )
    if job.deepspeed.zero_stage == 3 and can_mix(job) and job.deepspeed.offload_optimizer == "nvme":
        raise ConfigError(
            "deepspeed.zero_stage=3 with per-rank loop counts zeroes the gradients of passes no rank ran, which "
            "offload_optimizer=nvme keeps on disk: use deepspeed.offload_optimizer=cpu (or none), or engine=megatron"
        )
    if job.deepspeed.zero_stage == 3 and can_mix(job) and job.model.kv_training == "last_loop":
        raise ConfigError(
            "deepspeed.zero_stage=3 with per-rank loop counts runs ghost passes, which model.kv_training=last_loop's "
            "no-grad pre-run does not join: use model.kv_training=same_pass, deepspeed.zero_stage=2, or engine=megatron"
        )


def can_mix(job: JobConfig) -> bool:
    """Ranks may run different loop counts inside one step (a mixed phase with a per-replica sampler)."""
    s = job.schedule
    return s.switch_at < 1.0 and s.sampler not in ("fixed", "fixed_exits")


def ds_config(job: JobConfig, dp_size: int, n_params: int | None = None, *, device_type: str = "cpu") -> dict[str, Any]:
    """The DeepSpeed config of ``job`` on ``dp_size`` ranks whose model lives on ``device_type`` (JSON-ready;
    written to the run directory); buckets no larger than ``n_params`` elements.

    On CUDA (issue 31 item 5; docs/engines.md, "What is generated"): ``overlap_comm`` (ZeRO-2/3 reduce, and
    ZeRO-3 gather, on DeepSpeed's side streams during backward) and, with the optimizer on the device, DeepSpeed's
    ``FusedAdam`` (``torch_adam: False`` and no offload: ``engine.get_optimizer_configuration`` of DeepSpeed
    0.19.8 then builds ``deepspeed.ops.adam.FusedAdam``, one multi-tensor kernel per dtype and param group).
    On CPU, and for an offloaded optimizer, as before: no side streams on gloo, and DeepSpeed's CPU Adam would
    need a compiled op.

    Optimizer otherwise: DeepSpeed builds ``torch.optim.AdamW`` (``torch_adam``: no compiled op, as megatron-core's
    fallback on a machine without Apex/TE) with the job's betas, eps and weight decay; the parameter groups
    (no decay on biases and 1-D parameters) are passed in, as megatron-core forms them. LR schedule: the
    job's (``train.lr/min_lr/warmup_steps/decay``) through megatron-core's ``OptimizerParamScheduler``,
    stepped by the train step, so both engines run the same LR at every step; the config names it under
    ``elastic_pretrain_lr_schedule`` (DeepSpeed ignores unknown keys; its ``scheduler`` block is absent)."""
    t, d = job.train, job.deepspeed
    micro = t.micro_batches(dp_size)
    bucket = min(d.reduce_bucket_size, n_params) if n_params else d.reduce_bucket_size
    cuda = device_type == "cuda"
    fused_adam = cuda and d.offload_optimizer == "none"  # an offloaded optimizer steps on the host
    zero: dict[str, Any] = {
        "stage": d.zero_stage,
        "contiguous_gradients": True,
        # the ordered backward fixes which buckets form and in what order; overlap only moves their reduction
        # onto a side stream (CPU/gloo has none: off there)
        "overlap_comm": cuda,
        "reduce_scatter": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "ignore_unused_parameters": True,
    }
    if d.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": d.offload_optimizer, **_nvme(d)}
    if d.offload_param != "none":
        zero["offload_param"] = {"device": d.offload_param, **_nvme(d)}
    if d.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
        zero["stage3_param_persistence_threshold"] = d.param_persistence_threshold
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": micro,
        "gradient_clipping": t.clip_grad,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": [t.adam_beta1, t.adam_beta2],
                "eps": 1e-8,
                "weight_decay": t.weight_decay,
                "torch_adam": not fused_adam,
                "adam_w_mode": True,
            },
        },
        "zero_force_ds_cpu_optimizer": False,  # offload with torch's AdamW (DeepSpeedCPUAdam needs a compiled op)
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": job.model.dtype == "bf16"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 10**9,  # the trainer prints progress
        "wall_clock_breakdown": False,
        "elastic_pretrain_lr_schedule": {
            "warmup_steps": t.warmup_steps,
            "decay": t.decay,
            "lr": t.lr,
            "min_lr": t.min_lr,
            "steps": t.steps,
        },
    }


def _nvme(d: DeepSpeedConfig) -> dict[str, Any]:
    return {"nvme_path": d.nvme_path} if d.nvme_path else {}
