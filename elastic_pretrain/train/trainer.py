"""The Trainer owns the loop; :class:`~elastic_pretrain.train.step.TrainStep` owns the numerics.

Logging, evaluation and the run summary are callbacks that never touch the numerics.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from elastic_pretrain.checkpoint import parallel_io
from elastic_pretrain.checkpoint.latest import repair_latest
from elastic_pretrain.checkpoint.manager import Checkpointer, check_states, resume_source
from elastic_pretrain.checkpoint.preempt import StopRequest, stop_reason
from elastic_pretrain.checkpoint.store import CheckpointStore
from elastic_pretrain.checkpoint.tensors import check_model_fits
from elastic_pretrain.data.loader import TokenBatches
from elastic_pretrain.errors import UserError
from elastic_pretrain.eval.loss import loss_by_loops
from elastic_pretrain.files import append_text, ensure_dir, read_bounded, read_text_or_none, write_atomic
from elastic_pretrain.job import JobConfig, public_dict, write_resolved
from elastic_pretrain.jsonsafe import count, mapping
from elastic_pretrain.jsonsafe import loads as json_loads
from elastic_pretrain.parallel.device import device
from elastic_pretrain.parallel.mesh import Mesh, describe, every_rank, init_mesh, teardown
from elastic_pretrain.parallel.pipeline import MicroBatch
from elastic_pretrain.parallel.strict import enter_strict_devices
from elastic_pretrain.provenance import code_identity
from elastic_pretrain.rundir import RunFiles
from elastic_pretrain.schedule import ExpertLayout, ScheduleController
from elastic_pretrain.train.decider import load_base
from elastic_pretrain.train.faults import FaultMonitor
from elastic_pretrain.train.memory_peaks import MemoryPeaks, gib
from elastic_pretrain.train.mfu import baseline_flops_per_token, device_peak, step_flops, utilisation
from elastic_pretrain.train.profiling import ProfileWindow
from elastic_pretrain.train.resume import check_steps_left, resumable
from elastic_pretrain.train.runlock import RunLock, refusal
from elastic_pretrain.train.session import SchedulerState, Session, schedule_end_note
from elastic_pretrain.train.step import StepResult
from elastic_pretrain.train.stragglers import DATA_WAIT_KEY, StragglerReport
from elastic_pretrain.train.watchdog import HangWatchdog

if TYPE_CHECKING:
    from elastic_pretrain.tracking.tracker import Tracker

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainState:
    """Counters of the loop; resumable."""

    step: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    # model FLOPs of every trained token (train/mfu.py: step_flops), all replicas; None: resumed from a
    # checkpoint written before this count existed (its earlier steps are unknown, so no ratio is reported)
    train_flops: float | None = 0.0

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.step, self.tokens, self.elapsed_s = int(d["step"]), int(d["tokens"]), float(d["elapsed_s"])
        flops = d.get("train_flops")
        self.train_flops = None if flops is None else float(flops)

    def flops_vs_baseline(self, job: JobConfig) -> float | None:
        """Training FLOPs so far relative to the matched non-looped baseline (ℓ = 1) on the same tokens."""
        if not self.tokens or not self.train_flops:  # nothing trained yet, or an unknown count
            return None
        return self.train_flops / (self.tokens * baseline_flops_per_token(job.model, seq_len=job.data.seq_len))


class Callback(Protocol):
    def on_step(self, state: TrainState, result: StepResult, step_s: float) -> None: ...
    def on_eval(self, state: TrainState, val: dict[int, float]) -> None: ...
    def on_end(self, state: TrainState, val: dict[int, float]) -> None: ...
    def on_stop(self, state: TrainState, reason: str) -> None: ...
    def on_rollback(self, state: TrainState) -> None: ...


class Trainer:
    def __init__(
        self,
        job: JobConfig,
        mesh: Mesh,
        session: Session,
        callbacks: list[Callback],
        ckpt: Checkpointer,
        stop: StopRequest,
        state: TrainState | None = None,
        faults: FaultMonitor | None = None,
    ) -> None:
        self.job, self.mesh, self.s, self.callbacks = job, mesh, session, callbacks
        self.ckpt, self.stop = ckpt, stop
        self.state = state or TrainState()
        self.faults = faults or FaultMonitor(job, mesh, session, ckpt)

    def fit(self) -> dict[int, float] | None:
        """Train to ``train.steps`` (returns validation loss per ℓ), or save and return None when stopped."""
        job, s, state = self.job, self.s, self.state
        layout = s.depth_layout()  # once: then every rank computes its group's ℓ locally (schedule.py)
        while state.step < job.train.steps:
            if s.controller.update(step=state.step, tokens_seen=state.tokens):
                self.ckpt.settle()  # the switch may write parameters (init_unused_passes)
                s.on_switch_to_mixed(state.step)
            self.faults.before_step(state.step + 1)
            t0 = time.perf_counter()
            micro_batches = self.micro_batches(layout)
            data_s = time.perf_counter() - t0
            probe = bool(job.train.routing_interval) and (state.step + 1) % job.train.routing_interval == 0
            result = s.step(micro_batches, probe_routing=probe)
            result.aux[DATA_WAIT_KEY] = data_s
            step_s = time.perf_counter() - t0
            state.step += 1
            state.tokens += job.tokens_per_step
            state.elapsed_s += step_s
            if result.depth is not None and state.train_flops is not None:
                state.train_flops += (
                    job.tokens_per_step
                    * step_flops(
                        job.model,
                        result.depth,
                        seq_len=job.data.seq_len,
                        micro_batch_tokens=job.train.micro_batch_size * job.data.seq_len,
                    ).model
                )
            for cb in self.callbacks:
                cb.on_step(state, result, step_s)
            if self.faults.after_step(state):  # rolled back to the last checkpoint (skip/stop act inside)
                for cb in self.callbacks:
                    cb.on_rollback(state)
                continue
            reason = self.step_boundary()
            if reason:
                for cb in self.callbacks:
                    cb.on_stop(state, reason)
                return None
            interval = job.train.eval_interval
            if interval and state.step % interval == 0 and state.step < job.train.steps:
                val = self.validate()
                for cb in self.callbacks:
                    cb.on_eval(state, val)
        if self.ckpt.last_saved != state.step:
            self.ckpt.save(state.step, blocking=True)
        self.ckpt.wait()
        val = self.validate()
        for cb in self.callbacks:
            cb.on_end(state, val)
        return val

    def micro_batches(self, layout: ExpertLayout) -> list[MicroBatch]:
        """This replica's micro-batches of the next step with their depth plans (advances the data)."""
        s, step = self.s, self.state.step
        if s.controller.balanced:  # compute-balanced mixed depth: a share of the global batch's slots
            deal = functools.partial(
                s.controller.balanced_plans,
                micro_batches=s.batches.num_micro_batches,
                replica=self.mesh.replica,
                replicas=self.mesh.dp_size,
                layout=layout,
            )
            dealt = deal(step=step)  # and the next step's slots, read ahead while this one runs (data/prefetch.py)
            tokens = s.batches.next_step_slots([slot for slot, _ in dealt], ahead=[x for x, _ in deal(step=step + 1)])
            return [MicroBatch(t, p) for t, (_, p) in zip(tokens, dealt)]
        tokens = s.batches.next_step()
        plans = s.controller.step_plans(step=step, micro_batches=len(tokens), replica=self.mesh.replica, layout=layout)
        return [MicroBatch(tokens[i], p) for i, p in plans]

    def step_boundary(self) -> str | None:
        """Commit a finished async save, agree on a stop (a signal on any rank, or checkpoint.stop_at), save
        if due. A reason (``SIGTERM``, ``SIGTERM on rank 1``, ``stop_at``): every rank saved this step and
        stops now; every rank learns which ranks were signalled (one all-reduce, as the flag was)."""
        c, step = self.ckpt, self.state.step
        signums = every_rank(self.stop.signum or 0)
        stop = any(signums) or 0 < c.cfg.stop_at <= step
        c.poll()
        if stop or (c.due(step) and step < self.job.train.steps):
            c.save(step, blocking=stop)
        return stop_reason(signums) if stop else None

    def validate(self) -> dict[int, float]:
        loops = list(range(1, self.job.exit_depths + 1))  # loop counts, or core layers on exit_axis layer
        return loss_by_loops(
            self.s.model,
            self.s.val_tokens,
            loops,
            pipeline=self.s.pipeline,
            batch_size=self.job.train.micro_batch_size,
            exit_axis=self.job.schedule.exit_axis,
        )


class ProgressPrinter:
    """One progress line every ``log_interval`` steps, from the logging rank."""

    def __init__(
        self, job: JobConfig, mesh: Mesh, controller: ScheduleController, peaks: MemoryPeaks | None = None
    ) -> None:
        self.job, self.enabled, self.controller = job, mesh.is_logging_rank, controller
        self.peaks = peaks or MemoryPeaks(None)
        self._window: list[float] = []
        self.routing: dict[tuple[int, int], dict[str, float]] = {}

    def on_step(self, state: TrainState, result: StepResult, step_s: float) -> None:
        self._window.append(step_s)
        if result.routing:
            self.routing = result.routing
        if not self.enabled or (state.step % self.job.train.log_interval and state.step != self.job.train.steps):
            return
        mean_s = sum(self._window) / len(self._window)
        self._window.clear()
        total = self.job.train.steps
        eta = (total - state.step) * mean_s
        per_loop = " ".join(f"ℓ{k}={v:.3f}" for k, v in sorted(result.loss_by_loops.items()))
        a = result.aux
        decider = (
            f" | decider bce {a['decider/bce']:.3f} acc {a['decider/accuracy']:.3f} "
            f"cont {a['decider/continue_rate']:.3f} passes {a['decider/mean_passes']:.2f}"
            if "decider/bce" in a
            else ""
        )
        # after the switch the step's micro-batches ran different ℓ: its loss averages over the depths drawn,
        # so it is not comparable with the fixed phase's (the per-ℓ values in parentheses are)
        loss = "loss" if not self.controller.mixed else "loss (mixed ℓ)"
        peak = self.peaks.read("progress")  # CUDA: this window's peak allocated / reserved; CPU: None
        mem = f" | mem {gib(peak[0]):.1f}/{gib(peak[1]):.1f} GiB" if peak else ""
        print(
            f"step {state.step:>5}/{total} [{100 * state.step / total:5.1f}%] {loss} {result.loss:.4f} ({per_loop})"
            f"{decider} | lr {result.lr:.2e} | gnorm {result.grad_norm:.2f}"
            f" | {self.job.tokens_per_step / mean_s:,.0f} tok/s{mem} | {self.controller.phase}"
            f"{depth_note(a) if self.controller.mixed else ''}"
            f" | eta {eta:,.0f}s",
            flush=True,
        )

    def on_eval(self, state: TrainState, val: dict[int, float]) -> None:
        if self.enabled:
            print(f"eval  {state.step:>5}: " + "  ".join(f"ℓ{k} {v:.4f}" for k, v in sorted(val.items())), flush=True)

    def on_end(self, state: TrainState, val: dict[int, float]) -> None:
        if not self.enabled:
            return
        layer = self.job.schedule.exit_axis == "layer"  # exits after core layer k of a non-looped stack
        print(f"\nvalidation loss per {'layer exit' if layer else 'loop count'} (held-out tokens)")
        print(f"  {'layer' if layer else 'loops':>5}  {'loss':>8}  {'ppl':>9}")
        for k, v in sorted(val.items()):
            print(f"  {k:>5}  {v:8.4f}  {math.exp(min(v, 50)):9.2f}")
        if self.routing:
            print("\nrouting health (last probe; per core layer and pass)")
            print(print_routing(self.routing))
        print(f"trained {state.step} steps, {state.tokens:,} tokens in {state.elapsed_s:.1f}s", flush=True)

    def on_rollback(self, state: TrainState) -> None:
        self._window.clear()

    def on_stop(self, state: TrainState, reason: str) -> None:
        if self.enabled:
            print(
                f"stopped ({reason}) at step {state.step}/{self.job.train.steps}: checkpoint saved, exiting", flush=True
            )


def depth_note(aux: dict[str, float]) -> str:
    """`` depth eff 0.744 ghost 0.12s``: useful / executed passes of the step and the estimated seconds
    idled in ghost passes (docs/elastic-depth.md, "Depth efficiency")."""
    if "depth_efficiency" not in aux:
        return ""
    balance = f" bal {aux['depth_balance']:.3f}" if "depth_balance" in aux else ""
    return f" depth eff {aux['depth_efficiency']:.3f}{balance} ghost {aux.get('ghost_time_s', 0.0):.2f}s"


def print_routing(routing: dict[tuple[int, int], dict[str, float]]) -> str:
    from elastic_pretrain.model.routing import STATS

    lines = [f"  {'layer':>5} {'pass':>4}  " + "  ".join(f"{s:>10}" for s in STATS)]
    for (layer, p), stats in sorted(routing.items()):
        lines.append(f"  {layer:>5} {p:>4}  " + "  ".join(f"{stats[s]:10.4f}" for s in STATS))
    return "\n".join(lines)


class SummaryWriter:
    """``summary.json`` in the run directory: final validation loss per ℓ and counters; and
    ``history.jsonl``, one line per step, appended as the run goes, so a ``kill -9`` loses no step that
    a checkpoint kept. A resumed run keeps the lines up to its checkpoint's step and drops the rest
    (steps trained after the checkpoint are trained again)."""

    def __init__(self, run_dir: Path, mesh: Mesh, resumed_step: int = 0, job: JobConfig | None = None) -> None:
        files = RunFiles(run_dir)
        self.path, self.enabled, self.mesh, self.job = files.summary, mesh.is_logging_rank, mesh, job
        self.root, self.history_path, self.stopped_path = run_dir, files.history, files.stopped
        self.resumed_step = resumed_step
        self.history: list[dict[str, Any]] = []
        if resumed_step and os.path.lexists(self.history_path):  # the steps before the checkpoint, earlier attempts
            self.history = read_history(self.history_path, resumed_step)
        if self.enabled:  # rewritten (a link planted at the name is replaced, not followed), then appended to
            self._rewrite_history()
            self.stopped_path.unlink(missing_ok=True)  # an earlier start's stop speaks for that start only
        self.routing: dict[str, dict[str, float]] = {}

    def on_step(self, state: TrainState, result: StepResult, step_s: float) -> None:
        entry: dict[str, Any] = {
            "step": state.step,
            "loss": result.loss,
            "loss_by_loops": {str(k): v for k, v in result.loss_by_loops.items()},
            **{k: result.aux[k] for k in ("depth_efficiency", "depth_balance", "ghost_time_s") if k in result.aux},
        }
        self.history.append(entry)
        if self.enabled:
            append_text(self.history_path, json.dumps(entry) + "\n", root=self.root)
        if result.routing:
            self.routing = {f"{layer}/{p}": stats for (layer, p), stats in result.routing.items()}

    def on_eval(self, state: TrainState, val: dict[int, float]) -> None: ...

    def on_rollback(self, state: TrainState) -> None:
        """The steps after the checkpoint are trained again (on later data): drop their lines."""
        self.history = [h for h in self.history if h["step"] <= state.step]
        if self.enabled:
            self._rewrite_history()

    def _rewrite_history(self) -> None:
        write_atomic(self.history_path, "".join(json.dumps(h) + "\n" for h in self.history), root=self.root)

    def on_stop(self, state: TrainState, reason: str) -> None:
        self.on_end(state, {}, stopped=reason)
        if self.enabled and reason != "stop_at":  # a stop signal: the batch script requeues on it (docs/slurm.md)
            marker = {"step": state.step, "tokens": state.tokens, "reason": reason}
            write_atomic(self.stopped_path, json.dumps(marker) + "\n", root=self.root)

    def on_end(self, state: TrainState, val: dict[int, float], stopped: str | None = None) -> None:
        if self.enabled:
            summary = {
                "steps": state.step,
                "stopped": stopped,
                "tokens": state.tokens,
                "elapsed_s": state.elapsed_s,
                "train_flops": state.train_flops,
                "train_flops_vs_baseline": state.flops_vs_baseline(self.job) if self.job else None,
                "val_loss_by_loops": {str(k): v for k, v in val.items()},
                "layout": describe(self.mesh),
                # the code this process trained with (elastic_pretrain/provenance.py); a resumed run's earlier
                # steps may have had other code: started_at_step says where this process took over
                "code": {**code_identity(), "started_at_step": self.resumed_step},
                "routing": self.routing,
                **depth_summary(self.history),
                "history": self.history,
            }
            write_atomic(self.path, json.dumps(summary, indent=1), root=self.root)


# history.jsonl entries: the numbers summary.json adds up (depth_summary) besides the step
_HISTORY_NUMBERS = ("loss", "depth_efficiency", "depth_balance", "ghost_time_s")


def read_history(path: Path, upto: int) -> list[dict[str, Any]]:
    """The entries of ``history.jsonl`` up to step ``upto``. A line that is not an entry as ``on_step`` writes
    it — torn by a kill, or not a JSON object with a step count and numbers (a run directory may come from
    someone else) — is skipped with one warning: the history is a record to read, not training state (the
    checkpoint and MLflow hold the steps it lacks), and ``depth_summary`` adds up what it keeps."""
    entries, skipped = [], 0
    for n, line in enumerate(read_bounded(path, "history").decode("utf-8", "replace").splitlines(), 1):
        try:
            entry = mapping(json_loads(line, f"{path}:{n}"), "entry")
            step = count(entry, "step", "entry")
        except ValueError:  # JSONInputError, StateError
            skipped += 1
            continue
        if not all(_is_number(entry.get(key, 0.0)) for key in _HISTORY_NUMBERS):
            skipped += 1
        elif step <= upto:
            entries.append(entry)
    if skipped:
        log.warning("%s: skipped %d line(s) that are not step entries (torn by a kill, or not written here)",
                    path, skipped)  # fmt: skip
    return entries


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def depth_summary(history: list[dict[str, Any]]) -> dict[str, float]:
    """Run totals for summary.json: mean depth efficiency over the steps, ghost seconds summed."""
    eff = [h["depth_efficiency"] for h in history if "depth_efficiency" in h]
    if not eff:
        return {}
    bal = [h["depth_balance"] for h in history if "depth_balance" in h]
    return {
        "depth_efficiency": sum(eff) / len(eff),
        "ghost_time_s": sum(h.get("ghost_time_s", 0.0) for h in history),
        **({"depth_balance": sum(bal) / len(bal)} if bal else {}),
    }


class TrackingCallback:
    """Metrics, validation curves and the quality-budget plot to MLflow (rank 0; never fatal).

    Checkpointed (as ``tracker``): its state is the MLflow run id, so a resumed run continues that MLflow
    run. :meth:`start` opens the run, after a resume has loaded the id."""

    def __init__(self, job: JobConfig, mesh: Mesh, run_dir: Path, peaks: MemoryPeaks | None = None) -> None:
        from elastic_pretrain.tracking import names

        self.job, self.mesh, self.names, self.files = job, mesh, names, RunFiles(run_dir)
        self.peaks = peaks or MemoryPeaks(None)
        self.resume_run_id: str | None = None
        self.tracker: Tracker | None = None
        self._window: list[float] = []
        self.world_size, self.is_logging_rank = mesh.world_size, mesh.is_logging_rank
        t = job.train
        tflops = t.peak_tflops or (t.peak_flops_per_s / 1e12 if t.peak_flops_per_s else None)
        self.peak = device_peak(tflops, precision="fp8" if job.model.fp8 != "off" else "bf16")

    def state_dict(self) -> dict[str, Any]:
        live = self.tracker.run_id if self.tracker is not None else None
        return {"run_id": live or self.resume_run_id}  # None until MLflow answered (then: mlflow_run_id file)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tracker is None:  # a rollback keeps the run that is open
            self.resume_run_id = state.get("run_id")

    def start(self, *, run_id_file: bool) -> Tracker:
        """Open the MLflow run: the checkpoint's, else (``run_id_file``: resumed from this run directory)
        the one in ``mlflow_run_id`` — MLflow may not have answered before that checkpoint was saved."""
        from elastic_pretrain.config import flatten
        from elastic_pretrain.tracking.tracker import create_tracker, default_tags

        job, mesh = self.job, self.mesh
        if not self.resume_run_id and run_id_file:
            self.resume_run_id = read_text_or_none(self.files.mlflow_run_id, "mlflow_run_id")
        self.tracker = tracker = create_tracker(
            job.tracking, run_dir=self.files.run_dir, job_name=job.name, rank=mesh.rank,
            resume_run_id=self.resume_run_id,
        )  # fmt: skip
        tracker.log_params(flatten(public_dict(job)))  # no URI credentials, no slurm.env values
        if mesh.is_logging_rank:
            tracker.set_tags({**default_tags(world_size=mesh.world_size), "layout": json.dumps(describe(mesh))})
        if self.peak and mesh.is_logging_rank:
            tracker.set_tags({self.names.MFU_PEAK_TAG: self.peak[1]})
        return tracker

    @property
    def _tracker(self) -> Tracker:
        assert self.tracker is not None, "TrackingCallback.start() opens the run before training"
        return self.tracker

    def on_step(self, state: TrainState, result: StepResult, step_s: float) -> None:
        self._window.append(step_s)
        if state.step % self.job.train.log_interval and state.step != self.job.train.steps:
            return
        n = self.names
        tokens_per_s = self.job.tokens_per_step * len(self._window) / sum(self._window)
        metrics = {n.LOSS: result.loss, n.LR: result.lr, n.GRAD_NORM: result.grad_norm, n.TOKENS_PER_S: tokens_per_s}
        if self.peak and result.depth is not None:  # global depth of the step; train/mfu.py
            flops = step_flops(
                self.job.model,
                result.depth,
                seq_len=self.job.data.seq_len,
                micro_batch_tokens=self.job.train.micro_batch_size * self.job.data.seq_len,
                recompute=self.job.train.recompute,
            )
            u = utilisation(flops, tokens_per_s=tokens_per_s, devices=self.world_size, peak_flops_per_s=self.peak[0])
            metrics.update({n.MFU: u["mfu"], n.HFU: u["hfu"], n.GHOST_PASS_FRACTION: u["ghost_pass_fraction"]})
        vs_baseline = state.flops_vs_baseline(self.job)
        if vs_baseline is not None:
            metrics[n.TRAIN_FLOPS_VS_BASELINE] = vs_baseline
        peak = self.peaks.read("tracking")  # CUDA only: this window's peak (train/memory_peaks.py)
        if peak:
            metrics.update({n.PEAK_ALLOCATED_GIB: gib(peak[0]), n.PEAK_RESERVED_GIB: gib(peak[1])})
        metrics.update({n.loss_loops(k): v for k, v in result.loss_by_loops.items()})
        metrics.update({n.sanitize(k): v for k, v in result.aux.items()})
        for (layer, p), stats in result.routing.items():
            metrics.update({n.routing(layer, p, stat): v for stat, v in stats.items()})
        self._window.clear()
        self._tracker.log_metrics(metrics, step=state.step)

    def on_eval(self, state: TrainState, val: dict[int, float]) -> None:
        self._tracker.log_quality_budget(val, step=state.step)

    def on_rollback(self, state: TrainState) -> None:
        self._window.clear()  # MLflow keeps the first value logged at a step; the re-trained steps add none

    def on_end(self, state: TrainState, val: dict[int, float]) -> None:
        self.on_eval(state, val)
        if self.files.config.is_file():
            self._tracker.log_artifact(self.files.config)
        if self.is_logging_rank:
            from elastic_pretrain.checkpoint.index import write_index

            index = write_index(self.files.run_dir)
            if index is not None:
                self._tracker.log_artifact(index, "checkpoints")
        self._tracker.close(self.job.tracking.close_timeout_s)
        self._write_run_id()

    def on_stop(self, state: TrainState, reason: str) -> None:
        self._tracker.close(self.job.tracking.close_timeout_s, status="KILLED")  # a resume reopens the run
        self._write_run_id()

    def _write_run_id(self) -> None:
        # after close: a run stopped early may have saved its checkpoint before MLflow answered, and
        # then this file is how the resumed run finds its MLflow run (train())
        if self._tracker.run_id:
            write_atomic(self.files.mlflow_run_id, self._tracker.run_id, root=self.files.run_dir)


def fault_callbacks(
    job: JobConfig, mesh: Mesh, run_dir: Path, faults: FaultMonitor, tracker: Any, peaks: MemoryPeaks | None = None
) -> list[Any]:
    """Wire the fault policy, hang watchdog, straggler report and profiler window to MLflow (docs/faults.md)."""
    t = job.train
    faults.log_metrics, faults.set_tags = tracker.log_metrics, tracker.set_tags
    faults.close_tracking = lambda: tracker.close(job.tracking.close_timeout_s, status="FAILED")

    def hung(dump: Path, line: str) -> None:
        tracker.set_tags({"fault.hang": line})
        tracker.log_artifact(dump, "hang")
        tracker.close(min(job.tracking.close_timeout_s, 10.0), status="FAILED")

    return [
        HangWatchdog(t.hang_timeout_s, run_dir, mesh.rank, on_fire=hung),
        StragglerReport(
            t.straggler_interval, mesh.rank, mesh.is_logging_rank, tracker.log_metrics, tracker.set_tags, peaks=peaks
        ),
        ProfileWindow(t.profile, run_dir, mesh.rank, tracker.log_artifact),
    ]


# Builds the run's session on the job's engine (megatron or DeepSpeed): the caller picks it
# (``elastic_pretrain.engine.build_session``), so the loop does not import the engines that sit above it.
SessionBuilder = Callable[[JobConfig, Mesh], Session]


def train(job: JobConfig, build_session: SessionBuilder) -> dict[int, float] | None:
    """Run a job in this process (one rank of a torchrun launch, or a single process), its session built by
    ``build_session``.

    Resumes from the run directory's newest committed checkpoint (or ``checkpoint.resume_from``);
    returns None when a stop signal (or ``checkpoint.stop_at``) ended it after a save — exit code 0,
    no ``FINISHED`` marker, so the sbatch script requeues it. The stop handler is installed first: a
    signal during the setup (seconds to minutes) stops the run at its first step boundary."""
    with StopRequest() as stop:
        return _train(job, build_session, stop)


# The checks of the objects a checkpoint holds (the names in trainer.json; the loop counters, adam_step and the
# tracker's run id are checked on reading it: checkpoint/store.py). Restoring runs each check again.
STATE_CHECKS = {"scheduler": SchedulerState.check_state, "controller": ScheduleController.check_state,
                "data": TokenBatches.check_state, "faults": FaultMonitor.check_state}  # fmt: skip


def _train(job: JobConfig, build_session: SessionBuilder, stop: StopRequest) -> dict[int, float] | None:
    torch.set_num_threads(job.train.threads_per_rank)
    mesh = init_mesh(job.parallel, seed=job.train.seed)
    strict = enter_strict_devices()  # ELASTIC_PRETRAIN_STRICT_DEVICES=1 checks every collective (parallel/strict.py)
    done = False
    lock: RunLock | None = None
    try:
        run_dir = job.run_path
        files = RunFiles(run_dir)
        holder = None
        if mesh.rank == 0:  # one trainer per run directory, before anything is written (train/runlock.py)
            ensure_dir(run_dir, root=run_dir)
            lock = RunLock(files.train_lock)
            holder = lock.acquire()
        if every_rank(int(holder is not None))[0]:
            raise UserError(refusal(run_dir, holder or "another trainer (rank 0's message names it)"))
        if mesh.is_logging_rank:
            write_resolved(job, run_dir)
            print(f"run {job.name}: {describe(mesh)} -> {run_dir}", flush=True)
        # refuse a corrupt checkpoint or a changed model shape before building anything
        store = CheckpointStore(files.checkpoints)
        source = resume_source(job.checkpoint, store)
        meta = resumable(source, job) if source else {}
        if source:  # trainer.json's objects, each by its own check, before anything is built
            check_states(source, meta, STATE_CHECKS)
        elif job.decider is not None:  # the model shape came from the base's trainer.json (job_loader.py): bound it
            check_model_fits(Path(job.decider.init_from or ""), job.model)
        check_steps_left(source, meta, job)
        if mesh.rank == 0 and (repaired := repair_latest(store)):  # a crash left it naming an older/missing step
            print(repaired, flush=True)
        session = build_session(job, mesh)
        if mesh.is_logging_rank:
            print(session.describe(), flush=True)
        peaks = MemoryPeaks.on(device())  # peak memory per report window on CUDA (issue 31 item 4)
        state, tracking = TrainState(), TrackingCallback(job, mesh, run_dir, peaks)
        # what a checkpoint holds besides the tensors, by name in trainer.json (docs/checkpoints.md)
        ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, session.tensors(),
                            {"trainer": state, **session.checkpointed(), "tracker": tracking})  # fmt: skip
        faults = FaultMonitor(job, mesh, session, ckpt)
        ckpt.state["faults"] = faults
        if source:
            ckpt.restore(source, meta)
            if mesh.rank == 0:
                print(f"resumed from {source} (step {state.step}, {state.tokens:,} tokens)", flush=True)
                note = schedule_end_note(session.scheduler, session.controller, step=state.step, steps=job.train.steps)
                if note:
                    print(note, flush=True)
        elif job.decider is not None:  # a decider job starts from its base model (decider.init_from)
            load_base(session.net, Path(job.decider.init_from or ""))
            if mesh.is_logging_rank:
                print(f"decider job: base model from {job.decider.init_from} ({job.decider.backbone})", flush=True)
        if mesh.is_logging_rank and state.step < job.train.steps:
            files.finished.unlink(missing_ok=True)  # trained further: finished again at the end (Slurm reads it)
        # the MLflow run continues: its id came with the checkpoint's "tracker" state (or, when MLflow had not
        # answered by the time that save was taken, it is in the run directory's mlflow_run_id file)
        tracker = tracking.start(run_id_file=source is not None and source.parent == ckpt.store.root)
        callbacks: list[Callback] = [
            ProgressPrinter(job, mesh, session.controller, peaks),
            SummaryWriter(run_dir, mesh, resumed_step=state.step, job=job),
            tracking,
            *fault_callbacks(job, mesh, run_dir, faults, tracker, peaks),
        ]
        val = Trainer(job, mesh, session, callbacks, ckpt, stop, state, faults).fit()
        ckpt.close()
        session.batches.close()  # the read-ahead thread (an error leaves it to the daemon flag and the GC)
        if val is not None and mesh.is_logging_rank:
            write_atomic(files.finished, json.dumps({"step": state.step, "tokens": state.tokens}) + "\n", root=run_dir)
        done = True
        return val
    finally:
        strict.close()
        parallel_io.reset()  # its group goes with the others
        teardown(barrier=done)  # after an error (maybe this rank's alone) no rank waits for the others
        if lock is not None:
            lock.release()  # after teardown: the run directory is free once this trainer has let go of it
