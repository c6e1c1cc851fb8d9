"""The tracker against a real MLflow server: what a short run logs, resume, system metrics, ``runs``."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from mlflow.utils.validation import _validate_metric_name

from elastic_pretrain.cli import main as cli_main
from elastic_pretrain.tracking.config import TrackingConfig
from elastic_pretrain.tracking.names import routing
from elastic_pretrain.tracking.tracker import PARAM_VALUE_LIMIT, create_tracker, default_tags

FLUSH_S = 120.0  # bound for a flush to a healthy server; generous for a loaded CI machine


def _steps(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _simulate(tracker: Any, steps: range, offset: float = 0.0) -> None:
    for s in steps:
        tracker.log_metrics(
            {"loss": 10.0 - s + offset, "loss_loops_2": 9.0 - s, "lr": 1e-3, routing(0, 1, "max_load"): 1.5}, step=s
        )


def test_short_run_logs_metrics_params_tags_artifacts(
    mlflow_server: Any, fast_cfg: Callable[..., TrackingConfig], tmp_path: Path
) -> None:
    psutil = pytest.importorskip("psutil", reason="system metrics need psutil")
    assert psutil
    cfg = fast_cfg(uri=mlflow_server.uri, experiment="short-run", system_metrics=True, system_metrics_interval_s=0.2)
    tracker = create_tracker(cfg, run_dir=tmp_path / "run", job_name="job-a", rank=0, resume_run_id=None)
    config_file = tmp_path / "config.yaml"
    config_file.write_text("model:\n  loops: 4\n")
    tracker.log_params({"model": {"loops": 4, "mixture": "x" * 900}, "data": {"weights": [0.5, 0.5]}})
    tracker.set_tags(default_tags(world_size=2))
    tracker.log_artifact(config_file, "config")
    _simulate(tracker, range(20))
    tracker.log_quality_budget({1: 3.0, 2: 2.5, 4: 2.25}, step=9)
    tracker.log_quality_budget({1: 2.9, 2: 2.4, 4: 2.0}, step=19)
    assert tracker.flush(FLUSH_S), tracker.stats()
    run_id = tracker.run_id
    tracker.close(FLUSH_S)
    assert run_id is not None

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "job-a"
    params = run.data.params
    assert params["model.loops"] == "4" and params["data.weights"] == "[0.5, 0.5]"
    assert len(params["model.mixture"]) == PARAM_VALUE_LIMIT and params["model.mixture"].endswith("[truncated]")
    tags = run.data.tags
    assert tags["host.world_size"] == "2" and tags["version.torch"].startswith("2.")
    assert "git.commit" in tags and "version.megatron_core" in tags

    assert _steps(client, run_id, "loss") == [(s, 10.0 - s) for s in range(20)]  # every step exactly once
    assert [s for s, _ in _steps(client, run_id, routing(0, 1, "max_load"))] == list(range(20))
    assert _steps(client, run_id, "val_loss_loops_4") == [(9, 2.25), (19, 2.0)]
    ((_, ppl),) = [p for p in _steps(client, run_id, "val_ppl_loops_2") if p[0] == 19]
    assert ppl == pytest.approx(math.exp(2.4))
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics), sorted(run.data.metrics)

    artifacts = {a.path for d in ("", "config", "quality_budget") for a in client.list_artifacts(run_id, d)}
    assert {"config/config.yaml", "config/params.json"} <= artifacts
    assert {"quality_budget/quality_budget.png", "quality_budget/quality_budget.csv"} <= artifacts
    local = Path(client.download_artifacts(run_id, "quality_budget", str(tmp_path / "dl")))
    assert (local / "quality_budget.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(io.StringIO((local / "quality_budget.csv").read_text())))
    assert [(r["step"], r["loops"]) for r in rows] == [(s, k) for s in ("9", "19") for k in ("1", "2", "4")]
    full = json.loads(Path(client.download_artifacts(run_id, "config/params.json", str(tmp_path / "p"))).read_text())
    assert full["model.mixture"] == "x" * 900
    assert json.loads((tmp_path / "run" / "mlflow" / "run.json").read_text())["run_id"] == run_id

    # The `runs` command shows it: name, id, status, last step, last loss, val loss per loop count.
    assert cli_main(["runs", "--uri", mlflow_server.uri, "--experiment", "short-run"]) == 0


def test_runs_command_table_and_errors(
    mlflow_server: Any,
    fast_cfg: Callable[..., TrackingConfig],
    tmp_path: Path,
    capsys: Any,
    dead_uri: str,
    no_env_uri: None,
) -> None:
    tracker = create_tracker(
        fast_cfg(uri=mlflow_server.uri, experiment="table"), run_dir=tmp_path, job_name="tbl", rank=0
    )
    _simulate(tracker, range(5))
    tracker.log_quality_budget({1: 3.0, 2: 2.5}, step=4)
    tracker.close(FLUSH_S)
    capsys.readouterr()
    assert cli_main(["runs", "--uri", mlflow_server.uri, "-e", "table"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["NAME", "RUN", "ID", "STATUS", "STEP", "LOSS", "VAL_LOSS@1", "VAL_LOSS@2"]
    assert lines[2].split() == ["tbl", tracker.run_id, "FINISHED", "4", "6.0000", "3.0000", "2.5000"]
    # RUN_DIR: the experiment comes from the run.json the tracker wrote; the server it names is used only
    # when the user passes it (a shared run directory must not choose where credentials go: docs/security.md)
    assert cli_main(["runs", str(tmp_path)]) == 2
    assert f"says the run logged to {mlflow_server.uri}" in capsys.readouterr().err
    assert cli_main(["runs", str(tmp_path), "--uri", mlflow_server.uri]) == 0
    assert tracker.run_id in capsys.readouterr().out

    assert cli_main(["runs", "--uri", mlflow_server.uri, "-e", "no-such-experiment"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "experiment 'no-such-experiment' not found" in err and "--experiment" in err
    assert cli_main(["runs", "--uri", dead_uri, "-e", "table"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot reach MLflow" in err


def test_resume_continues_the_run_without_duplicate_steps(
    mlflow_server: Any, fast_cfg: Callable[..., TrackingConfig], tmp_path: Path, caplog: Any
) -> None:
    cfg = fast_cfg(uri=mlflow_server.uri, experiment="resume")
    first = create_tracker(cfg, run_dir=tmp_path, job_name="job-r", rank=0)
    first.log_params({"train": {"steps": 100, "lr": 0.001}})
    _simulate(first, range(10))  # steps 0..9 logged; the last checkpoint was at step 4
    first.log_quality_budget({1: 3.0, 2: 2.5}, step=8)
    assert first.flush(FLUSH_S)
    run_id = first.run_id
    first.close(FLUSH_S, status="KILLED")  # preempted

    caplog.set_level(logging.WARNING, logger="elastic_pretrain.tracking")
    second = create_tracker(cfg, run_dir=tmp_path, job_name="job-r", rank=0, resume_run_id=run_id)
    second.log_params({"train": {"steps": 200, "lr": 0.001}})  # the resumed job extended training
    _simulate(second, range(5, 15), offset=100.0)  # repeats steps 5..9 after restoring step 4
    second.log_quality_budget({1: 2.8, 2: 2.3}, step=14)
    assert second.flush(FLUSH_S)
    assert second.run_id == run_id
    assert MlflowClient(mlflow_server.uri).get_run(run_id).info.status == "RUNNING"
    second.close(FLUSH_S)

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    # Steps 5..9 keep the first attempt's values (the documented rule), 10..14 come from the resumed job.
    assert _steps(client, run_id, "loss") == [(s, 10.0 - s) for s in range(10)] + [
        (s, 110.0 - s) for s in range(10, 15)
    ]
    assert run.data.params["train.steps"] == "100"  # params are write-once in MLflow
    assert run.data.tags["param_changed/train.steps"] == "200"
    assert sum("differ from the MLflow run's params" in r.getMessage() for r in caplog.records) == 1
    table = (tmp_path / "mlflow" / "quality_budget" / "quality_budget.csv").read_text()
    assert [line.split(",")[0] for line in table.splitlines()[1:]] == ["8", "8", "14", "14"]  # history continues


def test_resume_with_unknown_run_id_starts_a_new_run(
    mlflow_server: Any, fast_cfg: Callable[..., TrackingConfig], tmp_path: Path, caplog: Any
) -> None:
    caplog.set_level(logging.WARNING, logger="elastic_pretrain.tracking")
    missing = "0" * 32
    tracker = create_tracker(
        fast_cfg(uri=mlflow_server.uri, experiment="resume-unknown"),
        run_dir=tmp_path,
        job_name="job-u",
        rank=0,
        resume_run_id=missing,
    )
    tracker.log_metrics({"loss": 1.0}, step=7)
    assert tracker.flush(FLUSH_S)
    tracker.close(FLUSH_S)
    assert tracker.run_id not in (None, missing)
    assert [r.getMessage() for r in caplog.records if "cannot continue MLflow run" in r.getMessage()]


def test_metric_names_we_document_pass_mlflow_validation() -> None:
    for name in ("loss", "loss_loops_4", "val_ppl_loops_2", "tokens_per_s", routing(11, 3, "entropy"), "system/x"):
        _validate_metric_name(name)


def test_refused_run_turns_tracking_off_with_one_warning(
    mlflow_server: Any, fast_cfg: Callable[..., TrackingConfig], tmp_path: Path, caplog: Any
) -> None:
    client = MlflowClient(mlflow_server.uri)
    client.delete_experiment(client.create_experiment("deleted-in-the-ui"))  # runs cannot be created in it
    caplog.set_level(logging.WARNING, logger="elastic_pretrain.tracking")
    tracker = create_tracker(
        fast_cfg(uri=mlflow_server.uri, experiment="deleted-in-the-ui"), run_dir=tmp_path, job_name="x", rank=0
    )
    tracker.log_metrics({"loss": 1.0}, step=0)
    assert not tracker.flush(FLUSH_S)  # returns as soon as the sender gave up, not after FLUSH_S
    for step in range(1, 100):
        tracker.log_metrics({"loss": 1.0}, step=step)  # accepted and ignored, nothing buffered
    assert tracker.run_id is None and tracker.stats().buffered == 0
    tracker.close(FLUSH_S)
    (off,) = [r.getMessage() for r in caplog.records if "tracking off" in r.getMessage()]
    assert "refused the run" in off
    assert not [r for r in caplog.records if "unreachable" in r.getMessage() or "closed with" in r.getMessage()]
