"""The job schema: :class:`JobConfig` (each component's own config, nested) and its cross-section rules.

A pure schema: it imports the configs it nests and the package's base helpers, nothing above them
(tests/test_imports.py). Reading a job file (presets, overrides, a decider's base checkpoint) is
:mod:`elastic_pretrain.job_loader`; the resolved config is what gets saved beside checkpoints and logged."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from elastic_pretrain.checkpoint.config import CheckpointConfig
from elastic_pretrain.config import ConfigError, field, show, to_dict
from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.engine.config import DeepSpeedConfig, Engine, check_engine
from elastic_pretrain.files import write_private
from elastic_pretrain.launch.config import SlurmConfig
from elastic_pretrain.model.config import DeciderConfig, ModelConfig
from elastic_pretrain.parallel.config import ParallelConfig
from elastic_pretrain.rundir import RunFiles
from elastic_pretrain.schedule import ScheduleConfig
from elastic_pretrain.tracking.config import REDACTED, TrackingConfig, redact_uri
from elastic_pretrain.train.config import TrainConfig


@dataclasses.dataclass(kw_only=True)
class JobConfig:
    """Everything one training run needs."""

    name: str = field(doc="Run name (run directory, MLflow run name).")
    run_dir: str | None = field(None, doc="Where checkpoints, logs and the resolved config go; default runs/<name>.")
    model: ModelConfig = field(factory=ModelConfig, doc="The looped MoE model.")
    parallel: ParallelConfig = field(factory=ParallelConfig, doc="Parallel layout (or a preset name in parallel/).")
    data: DataConfig = field(doc="Data streams (or a preset name in data/).")
    train: TrainConfig = field(doc="Optimisation and cadence.")
    schedule: ScheduleConfig = field(factory=ScheduleConfig, doc="Depth during training.")
    tracking: TrackingConfig = field(factory=TrackingConfig, doc="MLflow tracking (local store under run_dir).")
    checkpoint: CheckpointConfig = field(factory=CheckpointConfig, doc="Checkpoint cadence, retention, resume.")
    slurm: SlurmConfig = field(factory=SlurmConfig, doc="Slurm resources and preemption policy (used by submit).")
    decider: DeciderConfig | None = field(
        None, doc="A decider job: post-train a TaH2 iteration decider on decider.init_from (docs/evaluation.md)."
    )
    engine: Engine = field("megatron", doc="Who runs the numerics: megatron (any mesh) or deepspeed (ZeRO, DP only).")
    deepspeed: DeepSpeedConfig = field(
        factory=DeepSpeedConfig, doc="ZeRO settings of engine=deepspeed (docs/engines.md)."
    )

    def __post_init__(self) -> None:
        if self.name in ("", ".", "..") or any(c in "/\\" or not c.isprintable() for c in self.name):
            # the run directory is runs/<name>: '..' would be the repository root
            raise ConfigError(
                f"name: {show(self.name)} must be a plain name (not '.' or '..'; no '/', '\\' or control "
                "characters), e.g. name=tiny-cpu-2"
            )
        check_engine(self)  # first: under engine=deepspeed a model-parallel mesh is the mistake to name
        if self.engine != "megatron" and self.parallel.grad_reduce == "overlap":
            also = " parallel.param_gather=after_step" if self.parallel.param_gather == "overlap" else ""
            raise ConfigError(
                f"parallel.grad_reduce=overlap drives megatron's gradient buckets: use engine=megatron "
                f"or parallel.grad_reduce=after_backward{also} "
                f"(engine={self.engine} has its own overlap)"
            )
        self.schedule.validate_for(
            self.model.max_loops, loop_conditioning=self.model.loop_conditioning, layers=self.model.core_layers_built
        )
        if self.schedule.exit_axis == "layer":
            self._check_layer_axis()
        self.model.check_pipeline(self.parallel.pipeline)  # before any process starts (the CLI validates jobs)
        tp = self.parallel.tensor
        self.model.check_fp8_layout(tensor=tp, tokens=self.data.seq_len * self.train.micro_batch_size // tp)
        self.model.check_fp8_recompute(self.train.recompute)
        several_exits = self.decider is not None or self.schedule.sampler in ("telescopic", "fixed_exits")
        if self.model.kv_training == "last_loop" and (self.parallel.pipeline > 1 or several_exits):
            raise ConfigError(
                "model.kv_training=last_loop supervises one exit per forward without pipeline parallelism: use "
                "parallel.pipeline=1, no decider, a sampler other than telescopic/fixed_exits, "
                "or model.kv_training=same_pass"
            )
        if (
            self.model.edge_mlp == "moe"
            and self.parallel.pipeline > 1
            and self.parallel.expert > 1
            and self.schedule.sampler == "telescopic"
        ):
            # the pipeline computes an extra exit's coda in the chunk of its pass (parallel/pipeline.py _ChunkForward);
            # members of an expert-parallel group draw their own exits, so one member's coda all-to-all would pair
            # with its partner's core-layer call (issue 30, item 4: model/looped.py defers the heads; chunks cannot)
            raise ConfigError(
                "model.edge_mlp=moe with parallel.pipeline > 1 and parallel.expert > 1: the telescopic exits of an "
                "expert-parallel group's members run their MoE coda at different chunks; use model.edge_mlp=dense, "
                "parallel.pipeline=1, or a sampler other than telescopic"
            )
        if self.schedule.balance != "off" and self.parallel.pipeline > 1:
            raise ConfigError(  # the pipeline schedule needs the same micro-batch count (a multiple of PP) everywhere
                f"schedule.balance: {self.schedule.balance} deals replicas different numbers of micro-batches, which "
                "the pipeline schedule cannot run: use parallel.pipeline: 1 or schedule.balance: off"
            )
        if self.decider is not None and self.model.max_loops < 2:
            raise ConfigError(
                f"decider: the base model runs L_max = {self.model.max_loops} pass; a decider needs L_max >= 2"
            )
        if self.decider is not None and self.decider.backbone == "per_token" and self.parallel.tensor > 1:
            raise ConfigError(  # model/looped.py forward_decider: per-token depth carries one K/V state per token
                f"decider.backbone=per_token (the default) runs with parallel.tensor=1, not {self.parallel.tensor}: "
                "use a preset with tensor: 1, or decider.backbone: joint (or frozen)"
            )
        if self.decider is not None and self.decider.backbone == "per_token" and self.train.recompute == "pass":
            raise ConfigError(  # model/decider.py run_per_token: the K/V of stopped tokens carry from pass to pass
                "decider.backbone=per_token carries each token's frozen K/V from pass to pass, which a recomputed "
                "pass would not see: use train.recompute=none or selective"
            )
        if self.decider is not None and self.parallel.pipeline > 1:
            raise ConfigError(
                f"decider: a decider job runs without pipeline parallelism (parallel.pipeline="
                f"{self.parallel.pipeline}): use a parallel preset with pipeline: 1 (checkpoints load at any layout)"
            )

    def _check_layer_axis(self) -> None:
        """``schedule.exit_axis: layer`` reads every exit out of one pass through the stack (model/looped.py
        ``run_layers``): one process-local forward, nothing recomputed per pass, every K/V from that pass."""
        fixes = {
            "parallel.pipeline": (self.parallel.pipeline > 1, "parallel.pipeline=1"),
            "train.recompute": (self.train.recompute == "pass", "train.recompute=selective (or none)"),
            "model.kv_training": (
                self.model.kv_training == "last_loop",
                "model.kv_training=same_pass (the same thing with one loop)",
            ),
        }
        for key, (bad, fix) in fixes.items():
            if bad:
                raise ConfigError(
                    f"{key}={_get(self, key)} does not run with schedule.exit_axis=layer "
                    f"(every layer exit is read out of one pass): set {fix}, or exit_axis=loop"
                )

    @property
    def exit_depths(self) -> int:
        """How many exits the depth axis has: L_max, or the core layers on ``schedule.exit_axis: layer``."""
        return self.model.core_layers_built if self.schedule.exit_axis == "layer" else self.model.max_loops

    def check_vocab(self, tokenizer_vocab: int) -> None:
        if tokenizer_vocab > self.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={self.model.vocab_size} is smaller than the tokenizer's vocabulary "
                f"{tokenizer_vocab}: set model.vocab_size={tokenizer_vocab}"
            )

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.data.seq_len


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# Model keys whose change makes saved tensors meaningless for the new model: refuse to resume.
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_heads",
    "num_query_groups",
    "qk_norm",
    "ffn_hidden_size",
    "prelude_layers",
    "core_layers",
    "coda_layers",
    "loops",
    "num_experts",
    "moe_ffn_hidden_size",
    "flatten",
    "attention",
    "edge_mlp",
    "normalization",
    "tie_embeddings",
    "loop_conditioning",
)


def shape_changes(saved: dict[str, Any], job: JobConfig) -> list[str]:
    """``model.<key>: old -> new`` for every shape key that differs between a saved config and ``job``."""
    now, old = to_dict(job)["model"], saved.get("model", {})
    # checkpoints saved before these keys existed had their defaults (multi-head attention, no QK-norm)
    old = {"num_query_groups": None, "qk_norm": False, **old}
    return [f"model.{k}: {old.get(k)!r} -> {now.get(k)!r}" for k in SHAPE_KEYS if old.get(k) != now.get(k)]


def shape_refusal(ckpt: Path, saved: dict[str, Any], job: JobConfig) -> str | None:
    """The one-line refusal to resume ``job`` from ``ckpt`` (its saved config ``saved``) when the model's shape or
    its decider changed, naming what did and how to start a new run instead; None when nothing did."""
    changes = shape_changes(saved, job) + decider_changes(saved, job)
    if not changes:
        return None
    return (
        f"cannot resume from {ckpt}: the model shape changed ({'; '.join(changes)}); restore those values, "
        "or start a new run: another name (name=NEW) or --run-dir runs/NEW"
    )


def decider_changes(saved: dict[str, Any], job: JobConfig) -> list[str]:
    """The iteration decider (a decider job's submodule) appeared, vanished or changed width."""
    old, now = saved.get("decider"), to_dict(job).get("decider")
    width = [(d or {}).get("hidden_size") for d in (old, now)]
    if (old is None) != (now is None) or width[0] != width[1]:
        return [f"decider.hidden_size: {width[0]!r} -> {width[1]!r}"]
    return []


def public_dict(job: JobConfig) -> dict[str, Any]:
    """The job as plain data without its secrets: what is written beside checkpoints, logged to MLflow and
    printed. ``tracking.uri`` loses its ``user:password@`` and every ``slurm.env`` value is replaced by
    ``<redacted>`` (the keys stay). The running job keeps the real values; they live in the job file."""
    data = to_dict(job)
    if data["tracking"]["uri"]:
        data["tracking"]["uri"] = redact_uri(data["tracking"]["uri"])
    data["slurm"]["env"] = dict.fromkeys(data["slurm"]["env"], REDACTED)
    return data


def dump_job(job: JobConfig) -> str:
    """The resolved job as YAML, secrets redacted (see :func:`public_dict`)."""
    return yaml.safe_dump(public_dict(job), sort_keys=False)


def snapshot_job(job: JobConfig) -> str:
    """The resolved job as a job file that loads back to the same job (``submit`` writes it into the run, so a
    requeue trains what was submitted, not the YAML or presets as edited since). Secrets included (the job
    needs them): write it privately. A decider job's ``schedule`` is left out: loading derives it again from
    ``decider.init_from``, which is pinned to the committed step it resolved to."""
    data = to_dict(job)
    if job.decider is not None:
        del data["schedule"]
    return yaml.safe_dump(data, sort_keys=False)


def write_resolved(job: JobConfig, run_dir: Path) -> Path:
    out = RunFiles(run_dir).config
    write_private(out, dump_job(job), root=run_dir)  # creates run_dir
    return out
