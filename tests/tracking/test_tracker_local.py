"""The offline default: no URI, no server — a sqlite store inside the run directory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow import MlflowClient

from elastic_pretrain.cli import main as cli_main
from elastic_pretrain.tracking.config import TrackingConfig, local_store_uri
from elastic_pretrain.tracking.tracker import create_tracker

FLUSH_S = 120.0


def test_local_sqlite_default_without_server(
    fast_cfg: Callable[..., TrackingConfig], tmp_path: Path, no_env_uri: None, capsys: Any
) -> None:
    run_dir = tmp_path / "runs" / "tiny"
    tracker = create_tracker(fast_cfg(), run_dir=run_dir, job_name="tiny", rank=0, resume_run_id=None)
    tracker.log_params({"model": {"loops": 3}})
    notes = tmp_path / "notes.txt"
    notes.write_text("first")
    tracker.log_artifact(notes)
    notes.write_text("second")  # edited after the call: the upload is the copy taken at the call
    for step in range(5):
        tracker.log_metrics({"loss": 5.0 - step}, step=step)
        tracker.log_metrics({"loss": -1.0}, step=step)  # a second value at the same step is skipped
    tracker.log_quality_budget({1: 2.0, 3: 1.5}, step=4)
    assert tracker.flush(FLUSH_S), tracker.stats()
    assert tracker.stats().skipped == 5
    run_id = tracker.run_id
    tracker.close(FLUSH_S)
    assert run_id is not None

    assert (run_dir / "mlflow" / "mlflow.db").is_file()
    client = MlflowClient(local_store_uri(run_dir))
    run = client.get_run(run_id)
    assert run.info.experiment_id == client.get_experiment_by_name("tiny").experiment_id
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss")) == [
        (s, 5.0 - s) for s in range(5)
    ]
    assert run.data.params == {"model.loops": "3"}
    # Artifacts live beside the store, in the run directory, not in the current directory.
    assert (run_dir / "mlflow" / "artifacts" / run_id / "artifacts" / "quality_budget" / "quality_budget.png").is_file()
    assert (run_dir / "mlflow" / "artifacts" / run_id / "artifacts" / "notes.txt").read_text() == "first"
    assert not list((run_dir / "mlflow" / "staging").iterdir())  # private copies removed after upload

    capsys.readouterr()
    assert cli_main(["runs", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert run_id in out and "VAL_LOSS@3" in out and "FINISHED" in out


def test_runs_command_on_a_run_dir_without_store(tmp_path: Path, no_env_uri: None, capsys: Any) -> None:
    assert cli_main(["runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no MLflow store at" in err
    assert not (tmp_path / "mlflow").exists()  # looking must not create an empty store
