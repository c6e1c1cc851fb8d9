"""Never fatal, never blocking: the tracking server is down at start, or killed mid-run and restarted.

The two tests share one server of their own (each start costs 10-20 s): the first needs it down
at the beginning and starts it; the second kills and restarts it on the same port and store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from elastic_pretrain.tracking.config import TrackingConfig
from elastic_pretrain.tracking.tracker import create_tracker

FLUSH_S = 120.0  # bound for reaching a healthy server (loaded CI machine)
DOWN_S = 3.0  # a flush while the server is down: long enough for several failed attempts


@pytest.fixture(scope="module")
def server(server_factory: Callable[[], Any]) -> Any:
    return server_factory()


def _messages(caplog: Any, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_server_down_at_start_run_created_later_buffer_bounded(
    server: Any, fast_cfg: Callable[..., TrackingConfig], tmp_path: Path, caplog: Any
) -> None:
    assert not server.running
    caplog.set_level(logging.WARNING, logger="elastic_pretrain.tracking")
    cfg = fast_cfg(uri=server.uri, experiment="down-at-start", max_buffered=10)
    tracker = create_tracker(cfg, run_dir=tmp_path, job_name="job-d", rank=0, resume_run_id=None)
    tracker.log_params({"model": {"loops": 2}})
    for step in range(25):
        tracker.log_metrics({"loss": float(step)}, step=step)  # returns although nothing is listening
    assert not tracker.flush(DOWN_S)
    stats = tracker.stats()
    assert tracker.run_id is None and stats.reachable is False
    assert stats.buffered == 10 and stats.dropped == 15
    assert len(_messages(caplog, "tracking buffer full")) == 1

    server.start()
    assert tracker.flush(FLUSH_S), tracker.stats()
    run_id = tracker.run_id
    assert run_id is not None  # known once the server answered: the trainer reads it at each checkpoint
    tracker.close(FLUSH_S)
    assert _history(server.uri, run_id, "loss") == [(s, float(s)) for s in range(15, 25)]  # the newest 10
    assert MlflowClient(server.uri).get_run(run_id).data.params == {"model.loops": "2"}
    assert tracker.stats().failed_attempts >= 2 and len(_messages(caplog, "unreachable")) == 1
    (back,) = _messages(caplog, "reachable again")
    assert "back-filled 10 metric values" in back and "15 oldest dropped" in back


def test_server_killed_mid_run_and_restarted(
    server: Any, fast_cfg: Callable[..., TrackingConfig], tmp_path: Path, caplog: Any
) -> None:
    if not server.running:
        server.start()
    caplog.set_level(logging.WARNING, logger="elastic_pretrain.tracking")
    tracker = create_tracker(fast_cfg(uri=server.uri, experiment="outage"), run_dir=tmp_path, job_name="o", rank=0)
    for step in range(10):
        tracker.log_metrics({"loss": float(step), "lr": 0.1}, step=step)
    assert tracker.flush(FLUSH_S)
    run_id = tracker.run_id
    assert run_id is not None

    server.stop()
    for step in range(10, 30):  # training goes on while the server is gone
        tracker.log_metrics({"loss": float(step), "lr": 0.1}, step=step)
    assert not tracker.flush(DOWN_S)
    assert tracker.stats().reachable is False and tracker.stats().buffered >= 40
    for step in range(30, 40):
        tracker.log_metrics({"loss": float(step), "lr": 0.1}, step=step)

    server.start()  # same port, same store
    assert tracker.flush(FLUSH_S), tracker.stats()
    tracker.close(FLUSH_S)
    assert _history(server.uri, run_id, "loss") == [(s, float(s)) for s in range(40)]  # all back-filled, once
    assert len(_history(server.uri, run_id, "lr")) == 40
    assert MlflowClient(server.uri).get_run(run_id).info.status == "FINISHED"
    assert tracker.stats().failed_attempts >= 2  # it retried while down...
    assert len(_messages(caplog, "unreachable")) == 1  # ...with one line for the outage, not one per retry
    assert len(_messages(caplog, "reachable again")) == 1
    assert tracker.stats().dropped == 0


def test_close_while_unreachable_returns_within_its_timeout(
    fast_cfg: Callable[..., TrackingConfig], tmp_path: Path, dead_uri: str, caplog: Any
) -> None:
    caplog.set_level(logging.WARNING, logger="elastic_pretrain.tracking")
    tracker = create_tracker(fast_cfg(uri=dead_uri), run_dir=tmp_path, job_name="c", rank=0)
    tracker.log_metrics({"loss": 1.0}, step=0)
    tracker.close(2.0)  # must return (pytest-timeout would catch a hang) and say what was lost
    (lost,) = _messages(caplog, "tracking closed with")
    assert "1 metric values not sent" in lost
