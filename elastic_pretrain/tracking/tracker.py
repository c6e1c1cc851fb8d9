"""Experiment tracking for the trainer: one object, never fatal, never blocking.

Every rank calls the same methods; :func:`create_tracker` gives rank 0 an :class:`MlflowTracker` and every
other rank (and ``backend: none``) the no-op :class:`Tracker`, so the trainer needs no ``if rank == 0``.
``MlflowTracker`` methods only validate and append to a bounded in-memory buffer; a background thread
(:mod:`elastic_pretrain.tracking.sender`) sends it, so a slow or down MLflow costs training only that memory.
docs/tracking.md, "API (for the trainer)" (usage) and "Never fatal, never blocking".
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import shutil
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from elastic_pretrain.config import flatten
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import copy_file, ensure_dir, write_atomic
from elastic_pretrain.provenance import code_identity
from elastic_pretrain.tracking import quality, store
from elastic_pretrain.tracking.buffer import Buffer, MetricRow, Staged, TrackerStats
from elastic_pretrain.tracking.config import (
    TrackingConfig,
    local_store_dir,
    local_store_uri,
    redact_uri,
    resolve_uri,
)
from elastic_pretrain.tracking.mlflow_env import prepare_environment
from elastic_pretrain.tracking.names import sanitize, val_loss_loops, val_ppl_loops
from elastic_pretrain.tracking.sender import Sender
from elastic_pretrain.tracking.sysmetrics import SystemMetricsSampler

log = logging.getLogger("elastic_pretrain.tracking")

# MLflow 3.17 accepts 6000-character param values, but servers before 1.x/2.x-era upgrades reject
# more than 500; we stay within 500 so any server takes the batch, and log the untruncated
# values as the artifact config/params.json whenever something was cut.
PARAM_VALUE_LIMIT = 500
TAG_VALUE_LIMIT = 5000  # same reasoning: 5000 on older servers, 8000 on 3.x
_TRUNCATED = "...[truncated]"

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]


class Tracker:
    """The tracking interface, doing nothing: ranks other than 0, and ``backend: none``."""

    @property
    def run_id(self) -> str | None:
        """MLflow run id, or None (no tracking, or MLflow not reached yet). Save it in checkpoints."""
        return None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log the resolved config (nested dicts are flattened to dotted keys)."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set run tags (later values for the same key win)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue metric values at ``step``; values at or before the last step logged for a key are skipped."""

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Upload a file or folder (copied now, so later edits do not race the upload)."""

    def log_quality_budget(self, loss_by_loops: Mapping[int, float], step: int) -> None:
        """Log ``val_loss_loops_<k>``/``val_ppl_loops_<k>`` and the quality-budget plot + table."""

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for everything queued to reach MLflow; True if it did."""
        return True

    def stats(self) -> TrackerStats:
        return TrackerStats()

    def close(self, timeout_s: float | None = None, status: RunStatus = "FINISHED") -> None:
        """Flush for at most ``timeout_s`` seconds, mark the run ``status``, stop the threads."""


class MlflowTracker(Tracker):
    """Rank 0's tracker: a bounded buffer in front of a background MLflow sender."""

    def __init__(
        self,
        cfg: TrackingConfig,
        *,
        uri: str,
        run_dir: Path,
        experiment: str,
        run_name: str,
        resume_run_id: str | None,
    ) -> None:
        self.cfg = cfg
        self.uri = uri
        self.shown_uri = redact_uri(uri)  # logs never show user:password@
        self.store_dir = local_store_dir(run_dir)
        ensure_dir(self.store_dir, root=self.store_dir.parent)  # a planted mlflow -> elsewhere is refused
        # The run directory's own store may come from someone else: its file, schema and the artifact locations
        # this run will use are checked (and kept relative) before MLflow opens it; a foreign one is refused here,
        # in one line, before anything is sent (tracking/store.py, issue 35)
        own = Path(run_dir) if uri == local_store_uri(run_dir) else None
        if own is not None:
            store.claim_locations(own, experiment=experiment, run_id=resume_run_id)
        prepare_environment(cfg.request_timeout_s)  # before any thread imports mlflow
        self._buf = Buffer(cfg.max_buffered)
        self._sender = Sender(
            cfg,
            self._buf,
            uri=uri,
            store_dir=self.store_dir,
            experiment=experiment,
            run_name=run_name,
            resume_run_id=resume_run_id,
            own_store=own,
        )
        # Evals of an earlier attempt of this run, so the resumed plot continues the same history.
        self._sender.quality_history = quality.read_table(self.store_dir / "quality_budget" / quality.CSV_NAME)
        self._names: dict[str, str] = {}
        self._staged_seq = 0
        self._closed = False
        self._sender.start()
        self._sampler: SystemMetricsSampler | None = None
        if cfg.system_metrics:
            self._sampler = SystemMetricsSampler(cfg.system_metrics_interval_s, self._log_system_metrics)
            self._sampler.start()

    @property
    def run_id(self) -> str | None:
        return self._sender.run_id

    def _name(self, raw: str) -> str:
        name = self._names.get(raw)
        if name is None:
            name = self._names[raw] = sanitize(str(raw))
            if name != raw:
                log.warning("metric/param name %r is not valid in MLflow; logging it as %r", raw, name)
        return name

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self._closed:
            return
        flat = flatten(dict(params))
        values: dict[str, str] = {}
        truncated = False
        for key, value in flat.items():
            text = redact_uri(_param_text(value))  # the caller's config is already public; a URL never is
            if len(text) > PARAM_VALUE_LIMIT:
                text = text[: PARAM_VALUE_LIMIT - len(_TRUNCATED)] + _TRUNCATED
                truncated = True
            values[self._name(key)] = text
        with self._buf.cond:
            self._buf.params.update(values)
        if truncated:
            full = {k: redact_uri(_param_text(v)) for k, v in flat.items()}
            self._stage_bytes("params.json", json.dumps(full, indent=1).encode(), "config")

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if self._closed:
            return
        clean = {self._name(k): str(v)[:TAG_VALUE_LIMIT] for k, v in tags.items()}
        with self._buf.cond:
            self._buf.tags.update(clean)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:
            return
        now_ms = int(time.time() * 1000)
        step = int(step)
        rows: list[MetricRow] = []
        for key, value in metrics.items():
            try:
                rows.append((self._name(key), float(value), now_ms, step))
            except (TypeError, ValueError):
                log.warning("metric %r at step %d is not a number (%r); skipped", key, step, value)
        self._buf.add_metrics(rows)

    def _log_system_metrics(self, metrics: dict[str, float]) -> None:
        # System samples carry the latest training step, so they line up with the training curves
        # and continue across a resume; before the first training step there is nothing to align to.
        step = self._buf.latest_step
        if step >= 0 and not self._closed:
            now_ms = int(time.time() * 1000)
            self._buf.add_metrics([(k, v, now_ms, step) for k, v in metrics.items()])

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self._closed:
            return
        path = Path(path)
        try:
            stage = self._stage_dir()
            if path.is_dir():
                shutil.copytree(path, stage / path.name)
            else:  # a link or a FIFO at the source is refused, not followed (files.py)
                copy_file(path, stage / path.name, root=self.store_dir)
        except (OSError, UserError) as err:
            log.warning("artifact %s not logged: %s", path, err)
            return
        self._queue_artifact(Staged(stage / path.name, artifact_path, owned=True))

    def _stage_dir(self) -> Path:
        self._staged_seq += 1
        stage = self.store_dir / "staging" / f"{os.getpid()}-{self._staged_seq:06d}"
        return ensure_dir(stage, root=self.store_dir)

    def _stage_bytes(self, name: str, data: bytes, artifact_path: str | None) -> None:
        try:
            stage = self._stage_dir()
            write_atomic(stage / name, data, root=self.store_dir)
        except (OSError, UserError) as err:
            log.warning("artifact %s not logged: %s", name, err)
            return
        self._queue_artifact(Staged(stage / name, artifact_path, owned=True))

    def _queue_artifact(self, staged: Staged) -> None:
        key = (staged.artifact_path, staged.local.name)
        with self._buf.cond:
            old = self._buf.artifacts.get(key)
            self._buf.artifacts[key] = staged  # the latest version of a path wins
            if old is not None and old.owned:
                self._buf.garbage.append(old)

    def log_quality_budget(self, loss_by_loops: Mapping[int, float], step: int) -> None:
        if self._closed or not loss_by_loops:
            return
        losses = {int(k): float(v) for k, v in loss_by_loops.items()}
        metrics: dict[str, float] = {}
        for k, loss in sorted(losses.items()):
            metrics[val_loss_loops(k)] = loss
            metrics[val_ppl_loops(k)] = quality.perplexity(loss)
        self.log_metrics(metrics, step)
        with self._buf.cond:
            self._sender.quality_history[int(step)] = losses
            self._sender.quality_dirty = True
            self._buf.flush_requested = True  # evals are rare: render and upload now, not in 5 s
            self._buf.cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        sender, buf = self._sender, self._buf

        def done() -> bool:
            return (buf.idle() and not sender.quality_dirty and sender.run_id is not None) or not sender.alive

        with buf.cond:
            buf.flush_requested = True
            buf.cond.notify_all()
            buf.cond.wait_for(done, timeout=max(0.0, timeout_s))
            return buf.idle() and not sender.quality_dirty and sender.run_id is not None

    def stats(self) -> TrackerStats:
        return self._buf.snapshot()

    def close(self, timeout_s: float | None = None, status: RunStatus = "FINISHED") -> None:
        if self._closed:
            return
        self._closed = True
        timeout = self.cfg.close_timeout_s if timeout_s is None else float(timeout_s)
        start = time.monotonic()
        if self._sampler is not None:
            self._sampler.stop()
        with self._buf.cond:
            self._sender.final_status = status
            self._sender.deadline = start + timeout
            self._buf.stopping = True
            self._buf.flush_requested = True
            self._buf.cond.notify_all()
        finished = self._sender.join(start + timeout - time.monotonic())
        stats = self._buf.snapshot()
        if stats.buffered or not finished:
            log.warning(
                "tracking closed with %d metric values not sent to MLflow at %s (unreachable or slow for %.0fs)%s",
                stats.buffered,
                self.shown_uri,
                timeout,
                f"; {stats.dropped} more were dropped earlier" if stats.dropped else "",
            )


def _param_text(value: Any) -> str:
    """Readable param values: YAML-like scalars, JSON for lists and empty mappings."""
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, default=str)
    return str(value)


def create_tracker(
    cfg: TrackingConfig, *, run_dir: Path, job_name: str, rank: int, resume_run_id: str | None = None
) -> Tracker:
    """Rank 0 with ``backend: mlflow`` gets an :class:`MlflowTracker`, everyone else a no-op one.

    ``resume_run_id`` (from the checkpoint) continues that MLflow run: same params, the step axis
    continues, and values at steps the run already has are skipped. Never raises for tracking
    trouble: a store that cannot even be prepared yields a warning and the no-op tracker — except a run
    directory's own store that is not what the tracker makes (a link, a foreign schema, artifact locations
    outside the run): that is a one-line :class:`UserError`, since logging there would send files or
    credentials where the directory's author chose.
    """
    if cfg.backend == "none" or rank != 0:
        return Tracker()
    if resume_run_id is not None and not store.is_run_id(resume_run_id):
        # from a checkpoint or mlflow_run_id file, both possibly someone else's: not 32 hex digits, not a run id
        log.warning("not an MLflow run id: %r; logging to a new run instead", resume_run_id[:40])
        resume_run_id = None
    try:
        return MlflowTracker(
            cfg,
            uri=resolve_uri(cfg, run_dir),
            run_dir=run_dir,
            experiment=cfg.experiment or job_name,
            run_name=cfg.run_name or job_name,
            resume_run_id=resume_run_id,
        )
    except OSError as err:
        log.warning("tracking off: cannot prepare %s (%s)", local_store_dir(run_dir), err)
        return Tracker()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def default_tags(world_size: int) -> dict[str, str]:
    """Provenance tags: code version, software stack, and where the job ran.

    Read from package metadata and git without importing torch or megatron (cheap on rank 0).
    """
    code = code_identity()
    commit = code["commit"] if code["commit"] != "unknown" else None
    tags = {
        "git.commit": code["commit"],
        "git.dirty": code["dirty"],
        "host.name": socket.gethostname(),
        "host.world_size": str(world_size),
        "version.torch": _version("torch"),
        "version.megatron_core": _version("megatron-core"),
        "version.mlflow": _version("mlflow"),
        "version.elastic_pretrain": _version("elastic-pretrain"),
        "version.python": platform.python_version(),
    }
    if commit:
        tags["mlflow.source.git.commit"] = commit  # shown in the MLflow UI's run header
    local = os.environ.get("LOCAL_WORLD_SIZE")  # set by torchrun
    if local and local.isdigit() and int(local) > 0:
        tags["host.local_world_size"] = local
        tags["host.nnodes"] = str(max(1, world_size // int(local)))
    for env, tag in (("SLURM_JOB_ID", "slurm.job_id"), ("SLURM_JOB_NODELIST", "slurm.nodelist")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    return tags


__all__ = ["MlflowTracker", "Tracker", "TrackerStats", "create_tracker", "default_tags"]
