"""``engine: deepspeed``: the same looped model, wrapped by ``deepspeed.initialize`` (ZeRO stage 1/2/3).

megatron-core modules on a TP = PP = EP = 1 mesh; DeepSpeed owns the optimizer, gradient reduction, clipping
and partitioning; the LR schedule, trainer, samplers, data and checkpoint bookkeeping are the project's own.
Mixed depth gives ranks different autograd graphs, so :class:`DeepSpeedStep` computes gradients with
``torch.autograd.grad`` and hands DeepSpeed every trainable parameter in a fixed order (zeros for unused ones);
under ZeRO-3 each micro-batch runs to the deepest ℓ over the replicas, shallower ranks as ghost passes.
docs/engines.md, "Mixed depth under ZeRO (why there is an "ordered backward")".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elastic_pretrain.engine.config import can_mix, ds_config
from elastic_pretrain.engine.safe_load import load_checkpoint_safely
from elastic_pretrain.engine.weights import import_deepspeed
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import write_atomic
from elastic_pretrain.job import JobConfig
from elastic_pretrain.parallel.mesh import Mesh
from elastic_pretrain.parallel.pipeline import MicroBatch, _loss_func, group_loops
from elastic_pretrain.schedule import ExpertLayout
from elastic_pretrain.train.session import Session, wsd_decay_steps
from elastic_pretrain.train.step import StepResult, _moe_aux, _reduce_by_loops, measured_step

if TYPE_CHECKING:  # annotations only
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from elastic_pretrain.model.looped import LoopedMoEModel

log = logging.getLogger(__name__)

CONFIG_FILE = "deepspeed_config.json"  # in the run directory: the generated DeepSpeed config
TAG = "model_optim"  # DeepSpeed's files go to step_<N>/model_optim/ (checkpoint/store.py MODEL_DIR)


def param_groups(net: torch.nn.Module) -> list[dict[str, Any]]:
    """megatron-core's default groups: no weight decay on biases and 1-D parameters (``wd_mult`` is read by
    ``OptimizerParamScheduler``, which sets each group's weight decay every step)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in net.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    return [g for g in ({"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}) if g["params"]]


def lr_scheduler(job: JobConfig, optimizer: ZeROOptimizer) -> OptimizerParamScheduler:
    """The job's LR schedule with the arguments ``train/session.py:build_optimizer`` gives megatron's."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = job.train
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.warmup_steps,
        lr_decay_steps=t.steps, lr_decay_style=t.decay, start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=t.steps, wd_incr_style="constant",
        wsd_decay_steps=wsd_decay_steps(t.steps) if t.decay == "WSD" else None,
        lr_wsd_decay_style="linear" if t.decay == "WSD" else None,
    )  # fmt: skip


class _ReplayGrads(torch.autograd.Function):
    """A scalar whose backward hands ``grads`` to ``params``: DeepSpeed's gradient hooks then fire for every
    parameter, in the order of ``params``, on every rank (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, grads: tuple[torch.Tensor, ...], *params: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        # grad_out is exactly 1 (fp32/bf16: DeepSpeed scales no loss); the multiply keeps it honest
        return (None, *(g * grad_out for g in ctx.grads))


class ExitOutputs:
    """The model's ``{exit ℓ: tensor}`` as attributes ``l<ℓ>``, read like the dict. ZeRO-3's post-forward hook
    reads a module's non-tensor output through ``dict.items()`` or ``vars()`` and needs string names; the looped
    model's exits are ints."""

    def __init__(self, out: dict[int, torch.Tensor]) -> None:
        for k, v in out.items():
            setattr(self, f"l{k}", v)

    def __getitem__(self, exit_: int) -> torch.Tensor:
        return getattr(self, f"l{exit_}")

    def items(self) -> list[tuple[int, torch.Tensor]]:
        return [(int(n[1:]), v) for n, v in vars(self).items()]

    def keys(self) -> list[int]:
        return [k for k, _ in self.items()]

    def values(self) -> list[torch.Tensor]:
        return list(vars(self).values())


class LoopedForDeepSpeed(torch.nn.Module):
    """What ``deepspeed.initialize`` wraps: the looped model under ``module``, its exits as :class:`ExitOutputs`.

    ``forward`` calls the model's ``forward`` directly, past its own module hooks (it holds no parameters of its
    own; its submodules' hooks gather theirs), so no hook sees the int-keyed dict."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.module = net

    def forward(self, *args: Any, **kwargs: Any) -> ExitOutputs:
        return ExitOutputs(self.module.forward(*args, **kwargs))


class DeepSpeedStep:
    """The numerics of one optimizer step on the DeepSpeed engine: the objective, reductions and result of
    ``train/step.py``'s ``TrainStep`` (same loss function, same per-ℓ reduction), DeepSpeed's backward/step."""

    def __init__(
        self,
        engine: DeepSpeedEngine,
        net: LoopedMoEModel,
        scheduler: OptimizerParamScheduler,
        *,
        seq_len: int,
        max_loops: int,
        ordered: bool,
        ghosts: bool = False,
        balanced_micro: int | None = None,
    ) -> None:
        self.model, self.net, self.optimizer, self.scheduler = engine, net, engine.optimizer, scheduler
        self.seq_len, self.max_loops, self.ordered = seq_len, max_loops, ordered
        self.ghosts = ghosts  # ZeRO-3: run each micro-batch for the deepest ℓ of the replicas (full ghost passes)
        # schedule.balance=compute (ZeRO-1/2): replicas run different numbers of micro-batches, M = DP x this in all
        self.balanced_micro = balanced_micro
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.veto: Any = None  # FaultMonitor.veto(found_inf, grad_norm, loss=...): sees the loss (see _step)

    def __call__(self, micro_batches: list[MicroBatch], *, probe_routing: bool = False) -> StepResult:
        result = measured_step(self.net, self._step, micro_batches, probe_routing=probe_routing, seq_len=self.seq_len)
        if self.ghosts and result.depth is not None:  # HFU: a ZeRO-3 ghost pass computes a whole pass
            result.depth = dataclasses.replace(result.depth, full_ghosts=True)
        return result

    def _step(self, micro_batches: list[MicroBatch]) -> StepResult:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        engine, n = self.model, len(micro_batches)
        engine.train()
        # megatron's schedule scales the MoE aux-loss gradients by 1/micro-batches (its main loss too). Balanced: a
        # replica's count varies, so every micro-batch weighs 1/M of the step, M the global count (equal tokens per
        # micro-batch: the per-token mean over the global batch, as megatron's calculate_per_token_loss); the engine's
        # mean over DP supplies the 1/DP in 1/M = 1/(DP * balanced_micro)
        per_rank = self.balanced_micro or n
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=micro_batches[0].tokens_BT1.device) / per_rank)
        if self.ghosts:
            self._zero_grad_partitions()
        reports = []
        summed: tuple[torch.Tensor, ...] | None = None  # balanced: this rank's gradients over its micro-batches
        for mb in micro_batches:
            inputs, labels = mb.tokens_BT1[:, :-1].contiguous(), mb.tokens_BT1[:, 1:].contiguous()
            # ordered: the bare module, whose outputs carry no DeepSpeed backward hooks (autograd.grad below
            # would fire them); the hooks go on the replayed scalar instead, as engine.forward would add them
            forward = engine.module if self.ordered else engine
            sync = group_loops([mb])[0] if self.ghosts else None
            losses = forward(inputs, labels=labels, loops=mb.plan.loops, exits=mb.plan.exits, sync_loops=sync)
            objective, num_tokens, report = _loss_func(mb.plan, losses)
            reports.append(report)
            loss = objective / num_tokens / per_rank  # megatron: / tokens / micro-batches; DP averaged by the engine
            if self.balanced_micro:  # accumulate locally: DeepSpeed's reductions then run once per step on every rank
                grads = self._grads(loss)
                summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
                continue
            if self.ordered:
                loss = self._replay(self._grads(loss))
            engine.backward(loss, scale_wrt_gas=False)
            if engine.is_gradient_accumulation_boundary():
                break
            engine.step()  # not the boundary: DeepSpeed only counts the micro-batch
        if summed is not None:  # balanced: one backward, at the boundary (however many micro-batches ran here)
            engine.set_gradient_accumulation_boundary(True)
            engine.backward(self._replay(summed), scale_wrt_gas=False)
        loss_value, by_loops = _reduce_by_loops(reports, self.max_loops)
        vetoed = self.veto is not None and self.veto(False, 0.0, loss=loss_value)
        if vetoed:  # drop the update: DeepSpeed clears the reduced gradients, the LR stays where it was
            engine.optimizer.zero_grad()
            engine.micro_steps += 1
        else:
            engine.step()
            self.scheduler.step(increment=1)
        grad_norm = engine.get_global_grad_norm()
        return StepResult(
            loss=loss_value,
            loss_by_loops=by_loops,
            grad_norm=float(grad_norm or 0.0),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            skipped=vetoed,
            aux=_moe_aux(n),
        )

    def _zero_grad_partitions(self) -> None:
        """ZeRO-3 (DeepSpeed 0.19.8) writes a parameter's gradient partition only when that parameter's gradient hook
        fires, and keeps the partitions in one flat buffer across steps: a parameter no rank used this step (a pass
        beyond every replica's ℓ) would step on the gradient of the last step that used it. Zeroed before the first
        micro-batch, it steps on zero, as on the other engine (one pass over 1/DP of the gradients)."""
        opt = self.optimizer
        opt.grad_partitions_flat_buffer.zero_()
        if opt.offload_optimizer:  # the update reads fp32 gradient copies, written only for the parameters used
            for flat in opt.fp32_partitioned_groups_flat:
                if flat.grad is not None:
                    flat.grad.zero_()

    def _grads(self, loss: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``loss``'s gradient for every trainable parameter (zeros where unused), computed without hooks."""
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        return tuple(torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads))

    def _replay(self, full: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One scalar whose backward hands ``full`` to every parameter in a fixed order (DeepSpeed's hooks on it)."""
        from deepspeed.runtime.utils import register_output_backward_hooks

        replay = _ReplayGrads.apply(full, *self.params)
        engine = self.model
        register_output_backward_hooks(
            replay,
            preprocess_once_fn=engine._backward_prologue,
            preprocess_per_tensor_fn=engine._backward_prologue_per_tensor,
        )
        return replay


def keep_own_group_settings(optimizer: ZeROOptimizer) -> None:
    """Give the param groups DeepSpeed's load brought back the settings this engine's Adam reads and they lack.

    DeepSpeed's own load replaces the optimizer's param groups with the saved ones, so a checkpoint written by
    the other Adam (torch's AdamW on CPU or with an offloaded optimizer, DeepSpeed's FusedAdam on CUDA:
    engine/config.py ``ds_config``; ``convert-checkpoint`` writes torch's) lacks the keys of this one: FusedAdam's
    step reads ``group["bias_correction"]`` and raised KeyError. Each missing key gets this optimizer's default,
    as torch's Adam does for its own keys (``Adam.__setstate__``); the job's lr, betas, eps and decay are
    present either way. Adam's step is per parameter in both (torch: a tensor, FusedAdam: an int it also
    accepts as a tensor), so it carries over."""
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch optimizer DeepSpeed built
    for group in inner.param_groups:
        for key, value in inner.defaults.items():
            group.setdefault(key, value)


class DeepSpeedTensors:
    """Model + optimizer state through DeepSpeed's own save/load into ``step_<N>/model_optim/`` (the
    Checkpointer keeps the commit marker, ``latest``, retention and trainer state). Loading never unpickles
    arbitrary objects (``engine/safe_load.py``)."""

    def __init__(self, engine: DeepSpeedEngine) -> None:
        self.engine = engine

    def save(self, path: Path, strategy: Any, use_async: bool) -> tuple[None, dict[str, Any]]:
        """Collective; ``path`` is ``<tmp>/model_optim``. Synchronous (DeepSpeed's own writer: ``strategy`` and
        ``use_async`` do not apply), so no async request; the state beside it is the optimizer step count."""
        self.engine.save_checkpoint(str(path.parent), tag=path.name, save_latest=False)
        return None, {"adam_step": float(self.engine.global_steps)}

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Collective; ``path`` is ``step_<N>/model_optim`` (DeepSpeed restores its own step count). Saved at this
        world size and ZeRO stage: DeepSpeed's own load, each rank its partition. Otherwise every rank reads the
        whole state (weights, Adam moments, step: engine/full_state.py) and keeps its new partition."""
        if not any(path.glob("*_model_states.pt")):
            raise UserError(
                f"{path}: not a DeepSpeed-engine checkpoint (written by engine=megatron?): resume it with "
                "engine=megatron, or convert it: elastic-pretrain convert-checkpoint <step> --out <run dir>"
            )
        saved_dp = int(state.get("layout", {}).get("dp", self.engine.dp_world_size))
        saved_stage = int(state.get("config", {}).get("deepspeed", {}).get("zero_stage", self.stage))
        if (saved_dp, saved_stage) == (self.engine.dp_world_size, self.stage):
            load_checkpoint_safely(self.engine, path)
            keep_own_group_settings(self.engine.optimizer)
            return
        now = self.engine.dp_world_size
        if self.engine.zero_nvme_offload_optimizer():
            raise UserError(
                f"{path}: saved at world size {saved_dp} (ZeRO-{saved_stage}); resharding to {now} ranks "
                f"(ZeRO-{self.stage}) writes the optimizer state in memory, offload_optimizer=nvme keeps it on disk: "
                f"resume with deepspeed.offload_optimizer=cpu (or none), or at world size {saved_dp} ZeRO-{saved_stage}"
            )
        from elastic_pretrain.engine.full_state import install_deepspeed, read_deepspeed

        install_deepspeed(self.engine, read_deepspeed(path.parent))
        if int(os.environ.get("RANK", "0")) == 0:
            log.info(
                "resharded %s: world size %d ZeRO-%d -> world size %d ZeRO-%d (weights, Adam state, step %d)",
                path.parent,
                saved_dp,
                saved_stage,
                now,
                self.stage,
                self.engine.global_steps,
            )

    @property
    def stage(self) -> int:
        return int(self.engine.zero_optimization_stage())


def build_session(job: JobConfig, mesh: Mesh) -> DeepSpeedSession:
    """The :class:`~elastic_pretrain.train.session.Session` of ``engine: deepspeed`` (same fields, a DeepSpeed
    engine as ``model``, :class:`DeepSpeedStep` as ``step``, :class:`DeepSpeedTensors` as ``tensors()``)."""
    from elastic_pretrain.data.loader import load_validation
    from elastic_pretrain.data.prefetch import prefetched
    from elastic_pretrain.data.tokenizer import load_tokenizer
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.schedule import ScheduleController

    deepspeed = import_deepspeed()
    tokenizer = load_tokenizer(job.data.tokenizer)
    job.check_vocab(tokenizer.vocab_size)
    zero3 = job.deepspeed.zero_stage == 3  # every rank calls the same modules: full ghost passes, direct backward
    net = build_model(
        job.model, job.parallel, recompute=job.train.recompute, ghosts="full_passes" if zero3 else "moe_calls"
    )
    config = ds_config(
        job, mesh.dp_size, n_params=sum(p.numel() for p in net.parameters()), device_type=mesh.device.type
    )
    if mesh.is_logging_rank:
        write_atomic(job.run_path / CONFIG_FILE, json.dumps(config, indent=1) + "\n", root=job.run_path)
    os.environ.setdefault("LOCAL_RANK", "0")  # torchrun sets it; DeepSpeed asserts it even for one process
    engine, optimizer, _, _ = deepspeed.initialize(
        model=LoopedForDeepSpeed(net), model_parameters=param_groups(net), config=config
    )
    scheduler = lr_scheduler(job, optimizer)
    n_micro = job.train.micro_batches(mesh.dp_size)
    batches = prefetched(
        job.data,
        micro_batch_size=job.train.micro_batch_size,
        num_micro_batches=n_micro,
        dp_rank=mesh.dp_rank,
        dp_size=mesh.dp_size,
        seed=job.train.seed,
    )
    val_all = load_validation(job.data, num_sequences=job.train.eval_sequences)
    rows = (val_all.shape[0] // mesh.dp_size) * mesh.dp_size
    val_tokens = val_all[:rows][mesh.dp_rank :: mesh.dp_size].contiguous()
    controller = ScheduleController(
        job.schedule,
        max_loops=job.model.max_loops,
        total_tokens=job.train.steps * job.tokens_per_step,
        seed=job.train.seed,
    )
    ordered = not zero3
    step = DeepSpeedStep(
        engine,
        net,
        scheduler,
        seq_len=job.data.seq_len,
        max_loops=job.model.max_loops,
        ordered=ordered,
        ghosts=zero3,
        balanced_micro=n_micro if job.schedule.balance == "compute" else None,
    )
    session = DeepSpeedSession(job, net, engine, optimizer, scheduler, batches, val_tokens, controller, step)  # type: ignore[arg-type]  # the same interface as TrainStep
    session.ds_tensors = DeepSpeedTensors(engine)
    session.replica, session.replicas = mesh.replica, mesh.dp_size
    session.sync_phase()
    if mesh.is_logging_rank:
        log.info(
            "engine deepspeed: ZeRO-%d, %s backward (mixed depth possible: %s%s)",
            job.deepspeed.zero_stage,
            "ordered" if ordered else "direct",
            can_mix(job),
            ", ranks run the deepest ℓ with full ghost passes" if zero3 and can_mix(job) else "",
        )
    return session


class DeepSpeedSession(Session):
    """A Session whose switch to mixed depth writes the copied attention through ZeRO's master copies."""

    ds_tensors: DeepSpeedTensors | None = None
    replica: int = 0
    replicas: int = 1

    def depth_layout(self) -> ExpertLayout:
        """ZeRO-3: the replicas whose module calls must pair are all of them (its gathers and reduce-scatters run
        over the whole data-parallel group), so a micro-batch's ``group_loops`` is the max ℓ over every replica,
        computed locally from their draws; each replica still draws its own ℓ (key: itself). ZeRO-1/2: alone."""
        if self.job.deepspeed.zero_stage != 3:
            return ExpertLayout.single(self.replica)
        return ExpertLayout(group=tuple(range(self.replicas)), key={r: r for r in range(self.replicas)})

    def tensors(self) -> Any:  # the Checkpointer's tensors: DeepSpeed's own files, not megatron's sharded ones
        assert self.ds_tensors is not None
        return self.ds_tensors

    def rank_parameters(self) -> tuple[int, str]:
        """ZeRO-3's partitioned parameters counted at their full size."""
        n = sum(getattr(p, "ds_numel", p.numel()) for p in self.net.parameters())
        return n, "partitioned over the ranks" if self.job.deepspeed.zero_stage == 3 else "on this rank"

    def describe(self) -> str:
        return f"{super().describe()} | engine deepspeed ZeRO-{self.job.deepspeed.zero_stage}"

    def on_switch_to_mixed(self, step: int) -> None:
        unused = self.controller.unused_passes()
        if unused and self.job.schedule.init_unused_passes == "copy_pass0":
            self._copy_pass0(unused)
            log.info(
                "step %d: pass 0's attention copied into passes %s (never run before the switch)", step, list(unused)
            )
        self.sync_phase()

    def _copy_pass0(self, unused: range) -> None:
        import deepspeed

        # ZeRO keeps fp32 master partitions of its own: write the model, then refresh them from it
        if self.job.deepspeed.zero_stage == 3:
            with deepspeed.zero.GatheredParameters(list(self.net.parameters()), modifier_rank=0):
                self.net.init_unused_passes(unused)
        else:
            self.net.init_unused_passes(unused)
        self.optimizer.refresh_fp32_params()
