"""Everything a run holds, built once: DDP model, optimizer, LR schedule, data, depth controller."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from elastic_pretrain.checkpoint.manager import Stateful
from elastic_pretrain.checkpoint.tensors import ModelTensors
from elastic_pretrain.data.loader import load_validation
from elastic_pretrain.data.prefetch import PrefetchedBatches, prefetched
from elastic_pretrain.data.tokenizer import load_tokenizer
from elastic_pretrain.job import JobConfig
from elastic_pretrain.jsonsafe import StateError, choice, count, mapping, number
from elastic_pretrain.model.looped import LoopedMoEModel
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import Mesh, data_parallel_group, expert_layout
from elastic_pretrain.parallel.overlap import DepthOverlapDDP, bucket_size_for, settle_param_gather
from elastic_pretrain.parallel.pipeline import Pipeline, check_micro_batches
from elastic_pretrain.schedule import ExpertLayout, ScheduleController
from elastic_pretrain.train.decider import DeciderStep, freeze_backbone
from elastic_pretrain.train.idle import copy_to_main_params
from elastic_pretrain.train.step import TrainStep

if TYPE_CHECKING:  # annotations only: DeepSpeed is imported by a deepspeed job only
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Session:
    job: JobConfig
    net: LoopedMoEModel  # the bare model (for parameter counts, conditioning heads)
    model: DistributedDataParallel | DeepSpeedEngine  # DeepSpeed's in engine/deepspeed.py's session
    optimizer: MegatronOptimizer | ZeROOptimizer  # DeepSpeed's ZeRO optimizer (stages 1-3) there
    scheduler: OptimizerParamScheduler
    batches: PrefetchedBatches  # data.prefetch steps read ahead; its state is what was consumed
    val_tokens: torch.Tensor
    controller: ScheduleController
    step: TrainStep
    pipeline: Pipeline | None = None  # parallel.pipeline > 1: the loop's passes as virtual pipeline chunks

    def on_switch_to_mixed(self, step: int) -> None:
        log.info(
            "step %d: switching to mixed depth (%s)%s",
            step,
            self.job.schedule.sampler,
            "; loop-conditioning heads on (zero-init)" if self.net.loop_conditioning is not None else "",
        )
        unused = self.controller.unused_passes()
        if unused and self.job.schedule.init_unused_passes == "copy_pass0":
            settle_param_gather(self.optimizer)  # pass 0's whole attention, not one rank's shard of it
            # only passes the fixed phase never ran change, so the switch step's loss at fixed_loops is unchanged
            written = self.net.init_unused_passes(unused)
            copy_to_main_params(self.optimizer, written)
            log.info(
                "step %d: pass 0's attention copied into passes %s (never run before the switch)", step, list(unused)
            )
        self.sync_phase()

    def depth_layout(self) -> ExpertLayout:
        """Whose draws a micro-batch's ``group_loops`` is the max of: this rank's expert-parallel group (the
        DeepSpeed session: every replica under ZeRO-3). One all_gather, at the start of training."""
        return expert_layout()

    def sync_phase(self) -> None:
        """The conditioning heads are on exactly in the mixed phase (also after a resume)."""
        # from the config, not from this rank's modules: only the first pipeline stage holds the heads,
        # and every stage must agree (evaluation runs one pass per ℓ when they are on)
        self.net.set_modes(conditioning=self.controller.mixed and self.job.model.loop_conditioning)
        # the fixed phase runs fixed_loops passes, the mixed phase any: the rest stay out of the update (train/idle.py;
        # megatron's optimizer: DeepSpeed's step has no such hold, docs/engines.md)
        idle = getattr(self.step, "idle", None)
        if idle is not None:
            idle.passes_run = None if self.controller.mixed else self.controller.fixed_loops

    def tensors(self) -> ModelTensors:
        """The model and optimizer, as a checkpoint saves them (sharded, layout-independent)."""
        return ModelTensors(self.net, self.optimizer)

    def checkpointed(self) -> dict[str, Stateful]:
        """The session's other checkpointed state, by its name in ``trainer.json``."""
        return {"scheduler": SchedulerState(self.scheduler), "controller": ControllerState(self), "data": self.batches}

    def rank_parameters(self) -> tuple[int, str]:
        """The parameters this rank holds, and where they are, for the banner."""
        return sum(p.numel() for p in self.net.parameters()), "on this rank"

    def describe(self) -> str:
        """The banner: the shape as the job file states it and as flattened (Foil), and one parameter line."""
        from elastic_pretrain.model.params import count_parameters, format_count

        n_params, where = self.rank_parameters()
        n_train = sum(p.numel() for p in self.net.parameters() if p.requires_grad)
        cfg, sched = self.job.model, self.job.schedule
        counts = count_parameters(cfg)
        here = f"; {format_count(n_params)} {where}" if n_params != counts.total else ""
        trained = f", {format_count(n_train)} trained" if n_train != n_params else ""
        flat = (f" -> flattened x{cfg.flatten}: {cfg.core_layers_built} x {cfg.max_loops} passes x "
                f"{cfg.experts_built} experts" if cfg.flatten != 1 else "")  # fmt: skip
        fixed = f", fixed phase at {sched.fixed_loops} loop(s)" if sched.fixed_loops and sched.switch_at > 0 else ""
        return (
            f"model: prelude {cfg.prelude_layers} + core {cfg.core_layers} layers x {cfg.loops} loops x "
            f"{cfg.num_experts} experts{flat} (top-{cfg.moe_top_k}, L_max {cfg.max_loops}) + coda {cfg.coda_layers}"
            f" | parameters {format_count(counts.total)} total, {format_count(counts.active)} active per token"
            f"{here}{trained} | sampler {sched.sampler}, switch at {sched.switch_at:.2f} of tokens{fixed}"
        )


@dataclasses.dataclass
class ControllerState:
    """The schedule controller as a checkpoint holds it; loading it also switches the conditioning heads
    to its phase (:meth:`Session.sync_phase`), on resume and on a fault rollback alike."""

    session: Session

    def state_dict(self) -> dict[str, Any]:
        return self.session.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        self.session.controller.load_state_dict(state)
        self.session.sync_phase()


# megatron's schedule state: the values OptimizerParamScheduler.state_dict writes and the styles it runs
_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WD_STYLES = ("constant", "linear", "cosine")


@dataclasses.dataclass
class SchedulerState:
    """megatron's LR / weight-decay schedule as a checkpoint holds it. megatron takes the checkpoint's values
    over the job's (``use_checkpoint_opt_param_scheduler``) and checks none of them: an unknown style, a
    string step count or a step of 10**30 fail at the first step, or never (a NaN LR), so they are checked
    here first. megatron keeps the checkpoint's horizon (``lr_decay_steps``, warmup); WSD's decay window
    follows that horizon here too. A run's schedule is fixed by the ``train.steps`` it started with (issue 33:
    docs/run-directory.md, "Training further")."""

    scheduler: OptimizerParamScheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        self.check_state(state)
        if state["lr_decay_style"] == "WSD" and self.scheduler.wsd_decay_steps is None:
            raise StateError("scheduler.lr_decay_style is 'WSD', which this job does not configure (train.decay=WSD)")
        self.scheduler.load_state_dict(state)
        if self.scheduler.lr_decay_style == "WSD":
            self.scheduler.wsd_decay_steps = wsd_decay_steps(self.scheduler.lr_decay_steps)
            self.scheduler.step(increment=0)  # the resumed step's learning rate under that window

    @staticmethod
    def check_state(state: Any) -> None:
        """Every value megatron reads, in range; else :class:`StateError`."""
        state = mapping(state, "scheduler")
        max_lr = number(state, "max_lr", "scheduler")
        number(state, "min_lr", "scheduler", high=max_lr)
        for key in ("lr_warmup_steps", "lr_decay_steps", "num_steps"):
            count(state, key, "scheduler")
        choice(state, "lr_decay_style", "scheduler", _DECAY_STYLES)
        if "start_wd" in state:  # megatron reads the weight-decay schedule only when the checkpoint has one
            for key in ("start_wd", "end_wd"):
                number(state, key, "scheduler")
            count(state, "wd_incr_steps", "scheduler")
            choice(state, "wd_incr_style", "scheduler", _WD_STYLES)


def wsd_decay_steps(steps: int) -> int:
    """WSD's final decay: the last fifth of the schedule."""
    return max(1, steps // 5)


def schedule_end_note(
    scheduler: OptimizerParamScheduler, controller: ScheduleController, *, step: int, steps: int
) -> str | None:
    """One line when ``train.steps`` reaches past the run's schedule (a finished run trained further): the
    steps beyond its horizon run at the schedule's final learning rate, in its final depth phase."""
    horizon = int(scheduler.lr_decay_steps)
    if steps <= horizon:
        return None
    final = scheduler.max_lr if scheduler.lr_decay_style == "constant" else scheduler.min_lr
    return (
        f"train.steps={steps} goes past this run's {horizon}-step schedule: steps {max(horizon, step) + 1}.."
        f"{steps} train at its end (learning rate {final:.2e}, {controller.phase} depth); a new schedule "
        "needs a new run (docs/run-directory.md)"
    )


def build_optimizer(
    job: JobConfig, model: DistributedDataParallel
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    t = job.train
    bf16 = job.model.dtype == "bf16"
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=1e-8,
        clip_grad=t.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=t.distributed_optimizer,
        overlap_param_gather=model.ddp_config.overlap_param_gather,  # megatron: "same value as the DDP config's"
    )
    optimizer = get_megatron_optimizer(opt_cfg, [model])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_steps,
        lr_decay_steps=t.steps,
        lr_decay_style=t.decay,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.steps,
        wd_incr_style="constant",
        wsd_decay_steps=wsd_decay_steps(t.steps) if t.decay == "WSD" else None,
        lr_wsd_decay_style="linear" if t.decay == "WSD" else None,
    )
    return optimizer, scheduler


def per_token_loss(net: LoopedMoEModel) -> None:
    """Weight every token of the global batch 1 / (its token count), whichever replica ran it.

    Compute-balanced mixed depth gives replicas different numbers of micro-batches. megatron's default
    divides each micro-batch's loss by its tokens and by *this rank's* micro-batch count, then averages
    over data-parallel ranks: a token on a replica with n_r of the step's M micro-batches would weigh
    1 / (n_r · DP) micro-batches instead of 1 / M — the deep replicas (few micro-batches) would count
    more, biasing the gradient towards deep ℓ. megatron's ``calculate_per_token_loss`` sums instead and
    divides by the global token count in ``finalize_model_grads``; its routers scale the aux/z losses by
    their tokens to match (each micro-batch's aux loss weighs 1 / M). Must run before DDP is built (it
    reads the flag for its reduction scaling); routers cache the flag when built, so they are set here."""
    net.config.calculate_per_token_loss = True
    for module in net.modules():
        if hasattr(module, "calculate_per_token_loss"):  # megatron's TopKRouter
            module.calculate_per_token_loss = True


def wrap_ddp(job: JobConfig, net: LoopedMoEModel, *, bucket_size: int | None = None) -> DistributedDataParallel:
    """megatron's DDP over ``net`` (``bucket_size``: parameters per bucket under overlap; None: from
    ``parallel.bucket_size``, whose 0 means the rule of parallel/overlap.py ``bucket_size_for``)."""
    if job.schedule.balance == "compute":  # replicas run different micro-batch counts
        per_token_loss(net)
    # parallel.grad_reduce=overlap: megatron's overlapped reduction with buckets started by our ledger, not by
    # megatron's first-step hook counts, which mixed depth breaks (parallel/overlap.py; docs/elastic-depth.md)
    overlap = job.parallel.grad_reduce == "overlap"
    if overlap and bucket_size is None:
        bucket_size = job.parallel.bucket_size or bucket_size_for(
            sum(p.numel() for p in net.parameters() if p.requires_grad), data_parallel_group().size()
        )
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        bucket_size=bucket_size,
        use_distributed_optimizer=job.train.distributed_optimizer,
        # gathers started after the step, awaited by the next forward (parallel/overlap.py; issue 31 item 1)
        overlap_param_gather=job.train.distributed_optimizer and job.parallel.param_gather == "overlap",
    )
    ddp_class = DepthOverlapDDP if overlap else DistributedDataParallel
    model = ddp_class(config=net.config, ddp_config=ddp_cfg, module=net)
    net.config.finalize_model_grads_func = finalize_model_grads
    net.config.no_sync_func = model.no_sync
    return model


def build_session(job: JobConfig, mesh: Mesh) -> Session:
    tokenizer = load_tokenizer(job.data.tokenizer)
    job.check_vocab(tokenizer.vocab_size)
    # main_grad: wrapped in megatron's DDP below (fused weight-gradient accumulation writes into its buffers)
    net = build_model(job.model, job.parallel, decider=job.decider, recompute=job.train.recompute, main_grad=True)
    if job.decider is not None and job.decider.backbone == "frozen":
        freeze_backbone(net)
    model = wrap_ddp(job, net)
    optimizer, scheduler = build_optimizer(job, model)
    net.config.grad_scale_func = optimizer.scale_loss if job.model.dtype == "bf16" else None
    n_micro = job.train.micro_batches(mesh.dp_size)
    pipeline = None
    if job.parallel.pipeline > 1:
        check_micro_batches(n_micro, job.parallel.pipeline)
        pipeline = Pipeline(model, net, job.parallel.pipeline)
        pipeline.config.grad_scale_func = net.config.grad_scale_func
    batches = prefetched(
        job.data,
        micro_batch_size=job.train.micro_batch_size,
        num_micro_batches=n_micro,
        dp_rank=mesh.dp_rank,
        dp_size=mesh.dp_size,
        seed=job.train.seed,
    )
    val_all = load_validation(job.data, num_sequences=job.train.eval_sequences)
    rows = (val_all.shape[0] // mesh.dp_size) * mesh.dp_size  # equal share per replica (EP all-to-alls pair up)
    if pipeline is not None:  # the pipeline's activations have one shape: whole micro-batches only
        rows = (rows // (mesh.dp_size * job.train.micro_batch_size)) * mesh.dp_size * job.train.micro_batch_size
        check_micro_batches(
            rows // (mesh.dp_size * job.train.micro_batch_size),
            job.parallel.pipeline,
            "validation runs through the pipeline too: raise train.eval_sequences",
        )
    val_tokens = val_all[:rows][mesh.dp_rank :: mesh.dp_size].contiguous()
    controller = ScheduleController(
        job.schedule,
        max_loops=job.model.max_loops,
        total_tokens=job.train.steps * job.tokens_per_step,
        seed=job.train.seed,
        layers=job.model.core_layers_built,
    )
    step_kw: dict[str, Any] = dict(
        seq_len=job.data.seq_len,
        micro_batch_size=job.train.micro_batch_size,
        max_loops=job.exit_depths,
        pipeline=pipeline,
    )
    step = (
        TrainStep(model, optimizer, scheduler, **step_kw)
        if job.decider is None
        else DeciderStep(model, optimizer, scheduler, decider=job.decider, **step_kw)
    )
    session = Session(job, net, model, optimizer, scheduler, batches, val_tokens, controller, step, pipeline)
    session.sync_phase()
    return session
