"""The tracker's background thread: the only code that talks to MLflow during training.

It owns the MLflow client, creates or resumes the run (retrying in the background if the store is
down at start), sends buffered data in ``log_batch`` calls, and backs off while the store is
unreachable. The training thread never waits on it, except in ``flush``/``close`` with a timeout.

Warnings are edge-triggered: one line when MLflow becomes unreachable, one when it is back (with
what was back-filled and dropped), not one per failed attempt.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from elastic_pretrain.errors import UserError
from elastic_pretrain.files import write_private
from elastic_pretrain.tracking import quality, store
from elastic_pretrain.tracking.buffer import Buffer, Staged
from elastic_pretrain.tracking.config import TrackingConfig, is_local_sqlite, redact_uri
from elastic_pretrain.tracking.mlflow_env import is_transient, make_client, short_error

log = logging.getLogger("elastic_pretrain.tracking")

_BATCH_METRICS = 1000  # mlflow.utils.validation.MAX_METRICS_PER_BATCH
_BATCH_PARAMS_TAGS = 100  # MAX_PARAMS_TAGS_PER_BATCH
_FIRST_RETRY_S = 1.0


class _Transient(Exception):
    """A send failed in a way worth retrying later (already classified and kept in the buffer)."""


class Sender:
    """Runs :meth:`_loop` in a daemon thread; state shared with the front end goes through ``Buffer``."""

    def __init__(
        self,
        cfg: TrackingConfig,
        buf: Buffer,
        *,
        uri: str,
        store_dir: Path,
        experiment: str,
        run_name: str,
        resume_run_id: str | None,
        own_store: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.buf = buf
        self.uri = uri  # only for the client: logs and run.json get shown_uri (no user:password@)
        self.shown_uri = redact_uri(uri)
        self.store_dir = store_dir
        # the run directory whose own sqlite store this is (tracking/store.py): its artifact locations are kept
        # relative and checked, and artifacts are copied into it by us, never to where the store says
        self.own_store = own_store
        self._artifact_root: Path | None = None
        self.experiment = experiment
        self.run_name = run_name
        self.resume_run_id = resume_run_id
        self.run_id: str | None = None
        self.quality_history: quality.History = {}
        self.quality_dirty = False  # set by the front end under buf.cond
        self.final_status = "FINISHED"
        self.deadline: float | None = None  # monotonic; set by close()
        self._client: Any = None
        self._floor: dict[str, int] = {}  # key -> last step already in the resumed run
        self._logged_params: dict[str, str] = {}
        self._down_since: float | None = None
        self._sent_at_outage = 0
        self._disabled = False
        self._thread = threading.Thread(target=self._main, name="tracking-sender", daemon=True)

    # -- lifecycle --
    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """True when the thread has finished."""
        self._thread.join(timeout=max(0.0, timeout_s))
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._disabled

    def _main(self) -> None:
        try:
            self._loop()
        except Exception as err:  # a bug here must cost us tracking, never the training run
            self._disabled = True
            with self.buf.cond:
                self.buf.disabled = True
            log.warning("tracking stopped after an unexpected error: %s", short_error(err), exc_info=True)
        finally:
            with self.buf.cond:
                self.buf.cond.notify_all()  # release flush() waiters

    def _loop(self) -> None:
        backoff = _FIRST_RETRY_S
        while True:
            with self.buf.cond:
                wait = backoff if self._down_since is not None else self.cfg.flush_interval_s
                if self.deadline is not None:
                    wait = min(wait, max(0.0, self.deadline - time.monotonic()))
                if self._down_since is None:
                    self.buf.cond.wait_for(self._wake, timeout=wait)
                else:  # while down only close()'s kick cuts the backoff short; flush() must not spin us
                    self.buf.cond.wait_for(lambda: self.buf.stopping and self.buf.flush_requested, timeout=wait)
                self.buf.flush_requested = False
            self._render_quality()
            try:
                self._cycle()
            except _Transient as err:
                # first retry after 1 s, then doubling up to the cap: quick to notice a restart,
                # cheap during a long outage
                was_down = self._down_since is not None
                self._note_down(err.__cause__ or err)
                backoff = min(backoff * 2, self.cfg.retry_max_interval_s) if was_down else _FIRST_RETRY_S
            else:
                self._note_up()
                backoff = _FIRST_RETRY_S
            with self.buf.cond:
                self.buf.cond.notify_all()
                stopping, idle = self.buf.stopping, self.buf.idle()
            if stopping and (idle or (self.deadline is not None and time.monotonic() >= self.deadline)):
                break
            if self._disabled:
                return
        if self.run_id is not None and self._down_since is None:
            try:
                self._client.set_terminated(self.run_id, status=self.final_status)
            except Exception as err:
                log.warning("could not mark MLflow run %s %s: %s", self.run_id, self.final_status, short_error(err))

    def _wake(self) -> bool:
        b = self.buf
        return b.stopping or b.flush_requested or len(b.metrics) >= _BATCH_METRICS

    def _note_down(self, err: BaseException) -> None:
        with self.buf.cond:
            self.buf.stats.reachable = False
            self.buf.stats.failed_attempts += 1
        if self._down_since is None:
            self._down_since = time.monotonic()
            self._sent_at_outage = self.buf.snapshot().sent
            log.warning(
                "MLflow at %s unreachable (%s): training continues; buffering up to %d metric values "
                "and retrying every <= %gs",
                self.shown_uri,
                short_error(err),
                self.cfg.max_buffered,
                self.cfg.retry_max_interval_s,
            )

    def _note_up(self) -> None:
        with self.buf.cond:
            self.buf.stats.reachable = True
        if self._down_since is None:
            return
        stats = self.buf.snapshot()
        dropped = self.buf.reset_full_warning()
        log.warning(
            "MLflow at %s reachable again after %.0fs: back-filled %d metric values%s",
            self.shown_uri,
            time.monotonic() - self._down_since,
            stats.sent - self._sent_at_outage,
            f" ({dropped} oldest dropped while the buffer was full)" if dropped else "",
        )
        self._down_since = None

    # -- one round: connect if needed, then params, tags, metrics, artifacts --
    def _cycle(self) -> None:
        if self.run_id is None:
            self._call(self._connect)
            if self.run_id is None:  # permanent failure: tracking is off, _disabled is set
                return
        self._send_params()
        self._send_tags()
        while self._send_metrics_batch():
            pass
        self._send_artifacts()

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one MLflow call; transient failures become _Transient, permanent ones propagate."""
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            if is_transient(err):
                raise _Transient() from err
            raise

    def _connect(self) -> None:
        if self._client is None:
            if self.own_store is not None:
                store.time_box(store.store_db(self.own_store))
            self._client = make_client(self.uri, self.cfg.request_timeout_s)
        client = self._client
        run = None
        if self.resume_run_id is not None:
            try:
                run = client.get_run(self.resume_run_id)
            except Exception as err:
                if is_transient(err):
                    raise
                log.warning(
                    "cannot continue MLflow run %s at %s (%s): logging to a new run instead",
                    self.resume_run_id,
                    self.shown_uri,
                    short_error(err),
                )
        try:
            run = self._adopt(run) if run is not None else self._create()
            if self.own_store is not None:
                store.claim_locations(self.own_store, run_id=run.info.run_id)
                self._artifact_root = store.artifact_dir(self.own_store, run.info.artifact_uri)
        except Exception as err:
            if is_transient(err):
                raise
            self._disabled = True
            with self.buf.cond:  # stop buffering: nothing would ever drain it
                self.buf.disabled = True
                self.buf.metrics.clear()
            log.warning("tracking off: MLflow at %s refused the run (%s)", self.shown_uri, short_error(err))
            return
        self.run_id = run.info.run_id
        self._write_run_json(run)
        log.info(
            "MLflow run %r (%s) in experiment %r at %s", run.info.run_name, self.run_id, self.experiment, self.shown_uri
        )

    def _create(self) -> Any:
        client = self._client
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            # MLflow stores an absolute file:// location (it resolves relative ones against the working directory);
            # in the run's own store claim_locations rewrites it relative before the run is created below
            location = (self.store_dir / store.ARTIFACTS).as_uri() if is_local_sqlite(self.uri) else None
            try:
                exp_id = client.create_experiment(self.experiment, artifact_location=location)
            except Exception as err:
                if is_transient(err):
                    raise
                exp = client.get_experiment_by_name(self.experiment)  # another job created it first
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        if self.own_store is not None:
            store.claim_locations(self.own_store, experiment=int(exp_id))
        return client.create_run(exp_id, run_name=self.run_name)

    def _adopt(self, run: Any) -> Any:
        """Continue a run: remember its last step per key and its params, mark it running again."""
        self._floor = {m.key: int(m.step) for m in run.data.to_proto().metrics}
        self._logged_params = dict(run.data.params)
        if run.info.status != "RUNNING":
            self._client.update_run(run.info.run_id, status="RUNNING")
        exp = self._client.get_experiment(run.info.experiment_id)
        self.experiment = exp.name
        return run

    def _write_run_json(self, run: Any) -> None:
        """Where this run lives, for ``elastic-pretrain runs RUN_DIR`` and for humans."""
        info = {
            "uri": self.shown_uri,
            "experiment": self.experiment,
            "experiment_id": run.info.experiment_id,
            "run_id": run.info.run_id,
            "run_name": run.info.run_name,
        }
        try:
            write_private(self.store_dir / "run.json", json.dumps(info, indent=2) + "\n", root=self.store_dir.parent)
        except (OSError, UserError) as err:
            log.warning("could not write %s: %s", self.store_dir / "run.json", err)

    def _send_params(self) -> None:
        from mlflow.entities import Param, RunTag

        with self.buf.cond:
            pending = dict(self.buf.params)
        new = {k: v for k, v in pending.items() if k not in self._logged_params}
        changed = {k: v for k, v in pending.items() if k in self._logged_params and self._logged_params[k] != v}
        items = list(new.items())
        for i in range(0, len(items), _BATCH_PARAMS_TAGS):
            chunk = items[i : i + _BATCH_PARAMS_TAGS]
            self._call(self._client.log_batch, self.run_id, params=[Param(k, v) for k, v in chunk])
            self._logged_params.update(chunk)
        if changed:
            # MLflow params are write-once; a resumed job whose config changed keeps the first value
            # as the param and records the new one as a tag, so the UI still shows what ran.
            log.warning(
                "%d config value(s) differ from the MLflow run's params (e.g. %s): kept the old params, "
                "the new values are tags param_changed/<key>",
                len(changed),
                next(iter(changed)),
            )
            tags = [RunTag(f"param_changed/{k}", v) for k, v in changed.items()]
            for i in range(0, len(tags), _BATCH_PARAMS_TAGS):
                self._call(self._client.log_batch, self.run_id, tags=tags[i : i + _BATCH_PARAMS_TAGS])
        with self.buf.cond:
            for k, v in pending.items():
                if self.buf.params.get(k) == v:
                    del self.buf.params[k]

    def _send_tags(self) -> None:
        from mlflow.entities import RunTag

        with self.buf.cond:
            pending = dict(self.buf.tags)
        items = list(pending.items())
        for i in range(0, len(items), _BATCH_PARAMS_TAGS):
            chunk = items[i : i + _BATCH_PARAMS_TAGS]
            self._call(self._client.log_batch, self.run_id, tags=[RunTag(k, v) for k, v in chunk])
        with self.buf.cond:
            for k, v in items:
                if self.buf.tags.get(k) == v:
                    del self.buf.tags[k]

    def _send_metrics_batch(self) -> bool:
        """Send up to one batch; False when the buffer is empty."""
        from mlflow.entities import Metric

        batch = self.buf.take_metrics(_BATCH_METRICS)
        if not batch:
            return False
        fresh = [r for r in batch if r[3] > self._floor.get(r[0], -1)]
        try:
            if fresh:
                metrics = [Metric(key, value, ts, step) for key, value, ts, step in fresh]
                self._call(self._client.log_batch, self.run_id, metrics=metrics)
        except _Transient:
            self.buf.put_back(batch)
            raise
        except Exception as err:
            self.buf.done_metrics(batch, sent=0, rejected=len(fresh))
            log.warning("MLflow rejected %d metric values (dropped): %s", len(fresh), short_error(err, 300))
            return True
        self.buf.done_metrics(batch, sent=len(fresh))
        with self.buf.cond:
            self.buf.stats.skipped += len(batch) - len(fresh)
        return True

    def _send_artifacts(self) -> None:
        with self.buf.cond:
            garbage, self.buf.garbage = self.buf.garbage, []
            pending = list(self.buf.artifacts.items())
        for staged in garbage:  # replaced before upload; deleted here, where no upload can be reading it
            shutil.rmtree(staged.local.parent, ignore_errors=True)
        for key, staged in pending:
            try:
                if self._artifact_root is not None:
                    store.copy_artifact(staged.local, self._artifact_root, staged.artifact_path)
                else:
                    upload = self._client.log_artifacts if staged.local.is_dir() else self._client.log_artifact
                    self._call(upload, self.run_id, str(staged.local), staged.artifact_path)
            except _Transient:
                raise
            except Exception as err:
                log.warning("MLflow rejected artifact %s (dropped): %s", staged.local.name, short_error(err))
            with self.buf.cond:
                if self.buf.artifacts.get(key) is staged:
                    del self.buf.artifacts[key]
            if staged.owned:
                shutil.rmtree(staged.local.parent, ignore_errors=True)

    # -- quality budget: rendered here so matplotlib never runs on the training thread --
    def _render_quality(self) -> None:
        with self.buf.cond:
            if not self.quality_dirty:
                return
            self.quality_dirty = False
            history = {s: dict(v) for s, v in self.quality_history.items()}
        out = self.store_dir / "quality_budget"
        try:  # below the run directory, no link followed (files.py)
            quality.write_table(out / quality.CSV_NAME, history, root=self.store_dir.parent)
            quality.write_plot(out / quality.PNG_NAME, history, root=self.store_dir.parent)
        except Exception as err:  # a plotting problem must not cost the metrics
            log.warning("quality-budget plot failed: %s", short_error(err))
            return
        with self.buf.cond:
            for name in (quality.CSV_NAME, quality.PNG_NAME):
                self.buf.artifacts[("quality_budget", name)] = Staged(out / name, "quality_budget", owned=False)
