"""Save and restore everything a resumed run needs; the Trainer calls :class:`Checkpointer`.

What a checkpoint holds (docs/checkpoints.md): the model and the Adam state through megatron-core
``dist_checkpointing`` (sharded, layout-independent keys: loads at another TP/EP/DP layout), the
LR schedule, the schedule controller, the data position, the loop counters, the MLflow run id,
the resolved config and layout (``trainer.json``), and every rank's RNG states (``rng/``).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from elastic_pretrain.checkpoint import optim_state, parallel_io, rng
from elastic_pretrain.checkpoint.preempt import start_helper_manager
from elastic_pretrain.checkpoint.safe_load import load_sharded
from elastic_pretrain.checkpoint.store import (
    MODEL_DIR,
    RNG_DIR,
    TRAINER_FILE,
    TRAINER_KEYS,
    CheckpointStore,
    fault_point,
    rank_records,
    read_trainer_state,
    write_atomic,
)
from elastic_pretrain.config import flatten, to_dict
from elastic_pretrain.errors import UserError
from elastic_pretrain.job import JobConfig, public_dict
from elastic_pretrain.parallel.mesh import Mesh, describe

log = logging.getLogger(__name__)

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


def decider_changes(saved: dict[str, Any], job: JobConfig) -> list[str]:
    """The iteration decider (a decider job's submodule) appeared, vanished or changed width."""
    old, now = saved.get("decider"), to_dict(job).get("decider")
    width = [(d or {}).get("hidden_size") for d in (old, now)]
    if (old is None) != (now is None) or width[0] != width[1]:
        return [f"decider.hidden_size: {width[0]!r} -> {width[1]!r}"]
    return []


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (small picklable objects of our own making only)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


_results_manager: Any = None


def start_write_results_queue() -> None:
    """Start the Manager process through which megatron's checkpoint writers report, our way.

    megatron (``filesystem_async._get_write_results_queue``) spawns it lazily on the first save, in
    a module global. We fill that global first with a Manager that (1) ignores the stop signals —
    the batch script forwards SIGTERM to every process of the job step, and a dead Manager fails
    the preemption save — and (2) is SIGKILLed when this rank dies, so ``kill -9`` of a rank does
    not leave it orphaned (``checkpoint/preempt.py``)."""
    global _results_manager
    if filesystem_async._results_queue is None:
        _results_manager = start_helper_manager()
        filesystem_async._results_queue = _results_manager.Queue()


def resume_source(job: JobConfig, store: CheckpointStore) -> Path | None:
    """The checkpoint a run continues from, or None for a fresh start (reads the file system only).

    The newest *committed* ``step_<N>`` wins, not ``latest``: a crash between the rename and the
    ``latest`` update leaves a complete newer checkpoint that ``latest`` does not name yet."""
    cfg = job.checkpoint
    if cfg.resume_from:
        return Path(cfg.resume_from)
    newest = store.newest()
    if cfg.resume == "never":
        if newest is not None:
            raise UserError(
                f"checkpoint.resume=never but {newest.path} exists: use a new run directory, or resume=auto"
            )
        return None
    return newest.path if newest else None


def verify_everywhere(ckpt: Path, timeout_minutes: float = 30.0) -> None:
    """Verify ``ckpt`` (size + CRC32 of every file), each rank its share; every rank raises the first
    error. Collective (checkpoint/parallel_io.py)."""
    parallel_io.verify_spread(ckpt, timeout_minutes)


def check_resumable(ckpt: Path, job: JobConfig) -> dict[str, Any]:
    """Verify ``ckpt`` (rank 0: size + CRC32 of every file), refuse a changed model shape; returns its
    ``trainer.json``. Collective; runs before the model is built, so a refusal costs no build time."""
    try:
        verify_everywhere(ckpt, job.checkpoint.io_timeout_minutes)
    except UserError as err:
        raise UserError(f"{err}{_previous_hint(ckpt)}") from None
    meta = read_trainer_state(ckpt, require=tuple(TRAINER_KEYS))
    saved_engine = meta.get("config", {}).get("engine", "megatron")  # engine/: each reads only its own files
    if saved_engine != job.engine:
        raise UserError(
            f"cannot resume from {ckpt}: it was written by engine={saved_engine}, this job runs engine={job.engine}: "
            f"set engine={saved_engine}, or convert it: elastic-pretrain convert-checkpoint {ckpt} --out <run dir>"
        )
    changes = shape_changes(meta.get("config", {}), job) + decider_changes(meta.get("config", {}), job)
    if changes:
        raise UserError(
            f"cannot resume from {ckpt}: the model shape changed ({'; '.join(changes)}); "
            "restore those values or start a new run directory"
        )
    return meta


def _previous_hint(ckpt: Path) -> str:
    """``; to continue from the previous committed checkpoint: --resume-from <it>`` (or nothing)."""
    step = ckpt.name.removeprefix("step_")
    older = [c for c in CheckpointStore(ckpt.parent).committed() if step.isdigit() and c.step < int(step)]
    if not older:
        return ""
    return f"; to continue from the previous committed checkpoint: --resume-from {older[-1].path}"


def save_tensors(
    net: Any, optimizer: Any, path: Path, strategy: TorchDistSaveShardedStrategy, use_async: bool = False
) -> tuple[Any, float]:
    """Model + Adam state (model space) to ``path`` through dist_checkpointing; returns (the async request,
    or None when synchronous; Adam's step count). Collective."""
    model_sd = net.sharded_state_dict()
    optim_sd, adam_step = optim_state.sharded_optimizer_state(optimizer, model_sd)
    request = dist_checkpointing.save(
        {"model": model_sd, "optimizer": optim_sd}, str(path), sharded_strategy=strategy, async_sharded_save=use_async
    )
    return request, adam_step


def load_tensors(net: Any, optimizer: Any, path: Path, *, adam_step: float) -> None:
    """Load model + Adam state from ``path`` at this process's layout (reshards over TP/EP/DP). Collective."""
    model_sd = net.sharded_state_dict()
    optim_state.ensure_state(optimizer)
    template = optim_state.loading_template(optimizer, model_sd)
    loaded = load_sharded(
        {"model": model_sd, "optimizer": template}, path, what="model/optimizer tensors",
        strategy=parallel_io.load_strategy(),
    )
    with torch.no_grad():
        net.load_state_dict(loaded["model"], strict=True)
        # a fresh sharded view: megatron's load rewrites the one it was given in place
        fresh = net.sharded_state_dict()
        optim_state.load_optimizer_state(optimizer, fresh, loaded["optimizer"], adam_step)


class Checkpointer:
    """Owns ``<run_dir>/checkpoints``: periodic/final/preemption saves (sync or async) and resume."""

    def __init__(self, job: JobConfig, mesh: Mesh, session: Any, run_dir: Path) -> None:
        self.job, self.mesh, self.s, self.cfg = job, mesh, session, job.checkpoint
        self.store = CheckpointStore(run_dir / "checkpoints")
        self.run_id: Callable[[], str | None] = lambda: None
        self.strategy = parallel_io.save_strategy()
        self.queue = AsyncCallsQueue() if self.cfg.async_save else None
        self.pending: int | None = None  # step of the async save in flight
        self.last_saved: int | None = None
        self.stale_cleaned = False
        # name -> object with state_dict()/load_state_dict(), kept in trainer.json under "extras"
        self.extras: dict[str, Any] = {}
        start_write_results_queue()

    # --- resume ------------------------------------------------------------------------------------
    def restore(self, ckpt: Path, meta: dict[str, Any], state: Any) -> None:
        """Load ``ckpt`` (already checked by :func:`check_resumable`, which returned ``meta``) into the
        session and ``state``. Collective."""
        s = self.s
        if getattr(s, "tensors", None) is not None:  # engine=deepspeed: its own files (engine/deepspeed.py)
            s.tensors.load(ckpt / MODEL_DIR)
        else:
            load_tensors(s.net, s.optimizer, ckpt / MODEL_DIR, adam_step=float(meta["adam_step"]))
        s.scheduler.load_state_dict(meta["scheduler"])
        s.controller.load_state_dict(meta["controller"])
        s.batches.load_state_dict(meta["data"])
        state.load_state_dict(meta["trainer"])
        self._load_extras(meta.get("extras", {}))
        same_layout = meta.get("layout") == describe(self.mesh)
        if same_layout:
            rng.restore(rng.load(ckpt / RNG_DIR / f"rank_{self.mesh.rank:05d}.pt"))
        elif self.mesh.rank == 0:
            log.warning(
                "layout changed %s -> %s: RNG states start from the seed", meta.get("layout"), describe(self.mesh)
            )
        if hasattr(s, "sync_phase"):
            s.sync_phase()
        self.last_saved = state.step if ckpt.parent == self.store.root else None
        if self.mesh.rank == 0:
            self._log_changes(meta.get("config", {}))
            print(f"resumed from {ckpt} (step {state.step}, {state.tokens:,} tokens)", flush=True)

    def _load_extras(self, saved: dict[str, Any]) -> None:
        for name, obj in self.extras.items():
            if name in saved:  # a checkpoint from before the extra existed starts it fresh
                obj.load_state_dict(saved[name])

    def _log_changes(self, saved: dict[str, Any]) -> None:
        old, new = flatten(saved), flatten(public_dict(self.job))
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "run_dir")
        if diff:
            log.info("config changed since the checkpoint: %s", ", ".join(f"{k}={new.get(k)!r}" for k in diff))

    # --- saving --------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return bool(self.cfg.interval) and step % self.cfg.interval == 0

    def save(self, state: Any, *, blocking: bool = False) -> None:
        """Save at ``state.step`` (collective). Async: returns once tensors are staged in a forked writer."""
        self.wait()  # one save in flight at a time
        step, rank = state.step, self.mesh.rank
        if rank == 0:
            if not self.stale_cleaned:
                self.store.clean_stale()
                self.stale_cleaned = True
            self.store.prepare(step)
        _barrier()
        tmp = self.store.tmp_dir(step)
        fault_point("before_tensors", rank, step)
        rng.save(tmp / RNG_DIR / f"rank_{rank:05d}.pt")
        use_async = self.queue is not None and not blocking
        if getattr(self.s, "tensors", None) is not None:  # engine=deepspeed: its own save, synchronous
            request, adam_step, use_async = None, self.s.tensors.save(tmp / MODEL_DIR), False
        else:
            request, adam_step = save_tensors(self.s.net, self.s.optimizer, tmp / MODEL_DIR, self.strategy, use_async)
        if rank == 0:
            write_atomic(tmp / TRAINER_FILE, json.dumps(self._trainer_state(state, adam_step), indent=1))
        if use_async:
            assert self.queue is not None and request is not None
            request.add_finalize_fn(functools.partial(self._commit, step))
            self.queue.schedule_async_request(request)
            self.pending = step
        else:
            self._commit(step)
        self.last_saved = step

    def _trainer_state(self, state: Any, adam_step: float) -> dict[str, Any]:
        s = self.s
        return {
            "trainer": state.state_dict(),
            "adam_step": adam_step,
            "scheduler": s.scheduler.state_dict(),
            "controller": s.controller.state_dict(),
            "data": s.batches.state_dict(),
            "mlflow_run_id": self.run_id(),
            "extras": {name: obj.state_dict() for name, obj in self.extras.items()},
            "layout": describe(self.mesh),
            "config": public_dict(self.job),  # checkpoints are shared: no credentials, no env values
        }

    def _commit(self, step: int) -> None:
        """After every rank's writer finished: marker, rename, ``latest``, retention (rank 0). Collective."""
        rank = self.mesh.rank
        fault_point("before_marker", rank, step)
        records = rank_records(self.store.tmp_dir(step), rank)
        gathered: list[Any] = [records]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, records, group=parallel_io.io_group(self.cfg.io_timeout_minutes))
        if rank == 0:
            merged = {k: v for r in gathered for k, v in r.items()}
            self.store.commit(step, merged, rank=rank)
            removed = self.store.retain(self.cfg.keep_last, self.cfg.keep_every)
            print(
                f"checkpoint step {step} committed -> {self.store.step_dir(step)}"
                + (f" (removed {', '.join(f'step_{r}' for r in removed)})" if removed else ""),
                flush=True,
            )
        _barrier()

    def poll(self) -> None:
        """Commit a finished async save (a cheap all-reduce while one is in flight). Every rank, every step."""
        if self.queue is not None and self.pending is not None:
            self.queue.maybe_finalize_async_calls(blocking=False)
            if self.queue.get_num_unfinalized_calls() == 0:
                self.pending = None

    def wait(self) -> None:
        """Block until an async save in flight is written and committed."""
        if self.queue is not None and self.pending is not None:
            self.queue.maybe_finalize_async_calls(blocking=True)
            self.pending = None

    def close(self) -> None:
        self.wait()
        if self.queue is not None:
            self.queue.close()
