"""Save and restore everything a resumed run needs; the Trainer calls :class:`Checkpointer`.

A checkpoint holds (docs/checkpoints.md): the model and its optimizer's Adam state
(:class:`~elastic_pretrain.checkpoint.tensors.ModelTensors`, through megatron-core ``dist_checkpointing``:
sharded, layout-independent keys, loads at another TP/EP/DP layout); the state of every named stateful
object the caller hands in (the loop counters, LR schedule, schedule controller, data position, fault
counts, the MLflow run id...: ``state_dict()`` under its name in ``trainer.json``); the resolved config and
layout; and every rank's RNG states (``rng/``). The checkpointer knows none of those objects' insides.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies import filesystem_async

from elastic_pretrain.checkpoint import parallel_io, rng
from elastic_pretrain.checkpoint.config import CheckpointConfig
from elastic_pretrain.checkpoint.helper_manager import start_helper_manager
from elastic_pretrain.checkpoint.store import (
    RESUME_KEYS,
    CheckpointStore,
    fault_point,
    rank_records,
    read_trainer_state,
    resume_source,
)
from elastic_pretrain.checkpoint.tensors import ModelTensors, load_tensors, save_tensors
from elastic_pretrain.checkpoint.writer import WriterQueue
from elastic_pretrain.config import flatten
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import write_atomic
from elastic_pretrain.jsonsafe import StateError
from elastic_pretrain.parallel.mesh import Mesh, describe
from elastic_pretrain.rundir import CheckpointFiles, RunFiles

# save_tensors/load_tensors live in checkpoint/tensors.py; named here too for tests/dist and bench/
__all__ = ["Checkpointer", "Stateful", "check_resumable", "load_tensors", "resume_source", "save_tensors"]

log = logging.getLogger(__name__)

# trainer.json keys of the checkpointer itself (the tensors' small state adds adam_step): no object takes them
RESERVED = ("adam_step", "layout", "config")


class Stateful(Protocol):
    """An object a checkpoint saves: ``state_dict()`` is JSON-serialisable data (it goes into trainer.json,
    written by rank 0) and ``load_state_dict`` takes it back on every rank."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


_results_manager: Any = None


def start_write_results_queue() -> None:
    """Start the Manager process through which megatron's checkpoint writers report, our way.

    megatron (``filesystem_async._get_write_results_queue``) spawns it lazily on the first save, in
    a module global. We fill that global first with a Manager that (1) ignores the stop signals —
    the batch script forwards SIGTERM to every process of the job step, and a dead Manager fails
    the preemption save — and (2) is SIGKILLed when this rank dies, so ``kill -9`` of a rank does
    not leave it orphaned (``checkpoint/helper_manager.py``)."""
    global _results_manager
    if filesystem_async._results_queue is None:
        _results_manager = start_helper_manager()
        filesystem_async._results_queue = _results_manager.Queue()


def verify_everywhere(ckpt: Path, timeout_minutes: float = 30.0) -> None:
    """Verify ``ckpt`` (size + CRC32 of every file), each rank its share; every rank raises the first
    error. Collective (checkpoint/parallel_io.py)."""
    parallel_io.verify_spread(ckpt, timeout_minutes)


# The job's verdict on resuming from a checkpoint whose saved config is the dict: a one-line refusal (a changed
# model shape: job.py shape_refusal), or None. Storage knows no JobConfig: the caller hands its rule in.
Refusal = Callable[[Path, dict[str, Any]], str | None]


def check_resumable(ckpt: Path, config: dict[str, Any], refusal: Refusal) -> dict[str, Any]:
    """Verify ``ckpt`` (rank 0: size + CRC32 of every file), refuse another engine's checkpoint and what
    ``refusal`` refuses; returns its ``trainer.json``. ``config``: this run's public config (job.py
    ``public_dict``). Collective; runs before the model is built, so a refusal costs no build time."""
    try:
        verify_everywhere(ckpt, config["checkpoint"]["io_timeout_minutes"])
    except UserError as err:
        raise UserError(f"{err}{_previous_hint(ckpt)}") from None
    meta = read_trainer_state(ckpt, require=RESUME_KEYS)
    saved_engine = meta.get("config", {}).get("engine", "megatron")  # engine/: each reads only its own files
    engine = config["engine"]
    if saved_engine != engine:
        raise UserError(
            f"cannot resume from {ckpt}: it was written by engine={saved_engine}, this job runs engine={engine}: "
            f"set engine={saved_engine}, or convert it: elastic-pretrain convert-checkpoint {ckpt} --out <run dir>"
        )
    refused = refusal(ckpt, meta.get("config", {}))
    if refused:
        raise UserError(refused)
    return meta


def check_states(ckpt: Path, meta: dict[str, Any], checks: Mapping[str, Callable[[Any], object]]) -> None:
    """Each named object's saved state through its own check (``check_state``), before anything is built:
    ``trainer.json`` comes from whoever shared the checkpoint, and a position of 10**30 or an empty
    controller would otherwise be a traceback after the model was built (or, negative, train silently)."""
    for name, check in checks.items():
        if name in meta:
            try:
                check(meta[name])
            except StateError as err:
                raise bad_state(ckpt, err) from None


def bad_state(ckpt: Path, err: StateError) -> UserError:
    """``<ckpt>/trainer.json: <what is wrong>; …use another checkpoint`` (naming the previous one, if any)."""
    return UserError(
        f"{CheckpointFiles(ckpt).trainer}: {err}; it was not written by elastic-pretrain: use another "
        f"checkpoint{_previous_hint(ckpt)}"
    )


def _previous_hint(ckpt: Path) -> str:
    """``; to continue from the previous committed checkpoint: --resume-from <it>`` (or nothing)."""
    step = CheckpointFiles(ckpt).step
    older = [c for c in CheckpointStore(ckpt.parent).committed() if step is not None and c.step < step]
    if not older:
        return ""
    return f"; to continue from the previous committed checkpoint: --resume-from {older[-1].path}"


class Checkpointer:
    """Owns ``<run_dir>/checkpoints``: periodic/final/preemption saves (sync or async) and resume.

    ``cfg``: the job's ``checkpoint`` section; ``config``: the job's public config (job.py ``public_dict``),
    saved in ``trainer.json``. ``tensors``: the model and optimizer (sharded). ``state``: name ->
    :class:`Stateful`, each saved under its name in ``trainer.json`` and loaded back by :meth:`restore`;
    :attr:`state` may gain entries until the first save (an object built after the checkpointer, e.g. the
    fault monitor, which needs it)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        config: dict[str, Any],
        mesh: Mesh,
        run_dir: Path,
        tensors: ModelTensors,
        state: Mapping[str, Stateful],
    ) -> None:
        self.cfg, self.config, self.mesh, self.tensors = cfg, config, mesh, tensors
        self.state: dict[str, Stateful] = dict(state)
        self.store = CheckpointStore(RunFiles(run_dir).checkpoints)
        self.strategy = parallel_io.trainer_saves(self.cfg.io_timeout_minutes)  # checkpoint/snapshot.py
        self.queue = WriterQueue(self.cfg.async_writer) if self.cfg.async_save else None  # checkpoint/writer.py
        self.pending: int | None = None  # step of the async save in flight
        self.last_saved: int | None = None
        self.stale_cleaned = False
        start_write_results_queue()

    # --- resume ------------------------------------------------------------------------------------
    def restore(self, ckpt: Path, meta: dict[str, Any]) -> None:
        """Load ``ckpt`` (already checked by :func:`check_resumable`, which returned ``meta``) into the
        tensors and every named object; an object the checkpoint has no state for (saved before it
        existed) keeps its fresh state. Collective."""
        self.settle()  # loading writes the tensors a save in flight may still be copying
        files = CheckpointFiles(ckpt)
        self.tensors.load(files.tensors, meta)
        for name, obj in self.state.items():
            if name in meta:
                try:
                    obj.load_state_dict(meta[name])
                except StateError as err:  # each object checks its own values (check_states ran them first)
                    raise bad_state(ckpt, err) from None
            elif self.mesh.rank == 0:
                log.info("%s holds no %r state (saved before it existed): it starts fresh", ckpt, name)
        same_layout = meta.get("layout") == describe(self.mesh)
        if same_layout:
            rng.restore(rng.load(files.rng(self.mesh.rank)))
        elif self.mesh.rank == 0:
            log.warning(
                "layout changed %s -> %s: RNG states start from the seed", meta.get("layout"), describe(self.mesh)
            )
        self.last_saved = files.step if ckpt.parent == self.store.root else None
        if self.mesh.rank == 0:
            self._log_changes(meta.get("config", {}))

    def _log_changes(self, saved: dict[str, Any]) -> None:
        old, new = flatten(saved), flatten(self.config)
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "run_dir")
        if diff:
            log.info("config changed since the checkpoint: %s", ", ".join(f"{k}={new.get(k)!r}" for k in diff))

    # --- saving --------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return bool(self.cfg.interval) and step % self.cfg.interval == 0

    def save(self, step: int, *, blocking: bool = False) -> None:
        """Save as step ``step`` (collective). Async: returns once tensors are staged in a forked writer."""
        self.wait()  # one save in flight at a time
        rank = self.mesh.rank
        if rank == 0:
            if not self.stale_cleaned:
                self.store.clean_stale()
                self.stale_cleaned = True
            self.store.prepare(step)
        _barrier()
        files = CheckpointFiles(self.store.tmp_dir(step))
        fault_point("before_tensors", rank, step)
        rng.save(files.rng(rank), root=files.path)
        use_async = self.queue is not None and not blocking
        request, tensor_state = self.tensors.save(files.tensors, self.strategy, use_async)
        use_async = use_async and request is not None  # engine=deepspeed saves synchronously
        if rank == 0:
            write_atomic(files.trainer, json.dumps(self._trainer_state(tensor_state), indent=1), root=files.path)
        if use_async:
            assert self.queue is not None and request is not None
            request.add_finalize_fn(functools.partial(self._commit, step))
            self.queue.schedule_async_request(request)
            self.pending = step
        else:
            self._commit(step)
        self.last_saved = step

    def _trainer_state(self, tensor_state: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(set(self.state) & {*RESERVED, *tensor_state})
        if clash:
            raise ValueError(f"checkpointed objects may not be named {', '.join(clash)} (the checkpointer's keys)")
        return {
            **{name: obj.state_dict() for name, obj in self.state.items()},
            **tensor_state,
            "layout": describe(self.mesh),
            "config": self.config,  # the public config (job.py public_dict): no credentials, no env values
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

    def settle(self) -> None:
        """Wait until an async save in flight has taken its snapshot of the tensors (its staging copy runs
        beside the next step's forward and backward): call before writing parameters or optimizer state
        outside an optimizer step — every optimizer step waits for it by itself (checkpoint/writer.py)."""
        if self.queue is not None:
            self.queue.staged()

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
