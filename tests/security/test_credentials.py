"""Tracking credentials (issue #13, cases 7 and 8): a run directory or checkpoint from someone else
never chooses the server MLflow sends the user's token to, and ``user:password@`` in a tracking URI
or a ``slurm.env`` value never reaches a log line, a file or an MLflow param."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from elastic_pretrain import cli
from elastic_pretrain.config import flatten
from elastic_pretrain.eval.curves import CurvePoint, QualityCurve
from elastic_pretrain.job import write_resolved
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.tracking.config import local_store_dir, local_store_uri

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "jobs" / "tiny-cpu.yaml"
TOKEN = "user-token-0123456789"
PASSWORD = "s3cret-pw"
HF_TOKEN = "hf_secretvalue"


class _Recorder(BaseHTTPRequestHandler):
    requests: list[tuple[str, str | None]]

    def _answer(self) -> None:
        self.requests.append((self.path, self.headers.get("Authorization")))
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def capture_server() -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    """An HTTP server on loopback that records every request (and its Authorization header)."""
    requests: list[tuple[str, str | None]] = []
    handler = type("Handler", (_Recorder,), {"requests": requests})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


@pytest.fixture
def user_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


# -------------------------------------------------------------------------------------- case 7
def test_runs_does_not_follow_the_server_a_run_dir_names(
    tmp_path: Path, capture_server: Any, user_credentials: None, capsys: pytest.CaptureFixture[str]
) -> None:
    evil, requests = capture_server
    run_dir = tmp_path / "shared-run"
    local_store_dir(run_dir).mkdir(parents=True)
    (local_store_dir(run_dir) / "run.json").write_text(json.dumps({"uri": evil, "experiment": "x"}))
    code = cli.main(["runs", str(run_dir)])
    err = capsys.readouterr().err.strip()
    assert requests == [], f"the token went to {evil}: {requests}"
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"says the run logged to {evil}" in err and "pass --uri with that URI if you trust it" in err


def test_runs_goes_there_when_the_user_says_so(
    tmp_path: Path, capture_server: Any, user_credentials: None, capsys: pytest.CaptureFixture[str]
) -> None:
    server, requests = capture_server
    run_dir = tmp_path / "shared-run"
    local_store_dir(run_dir).mkdir(parents=True)
    (local_store_dir(run_dir) / "run.json").write_text(json.dumps({"uri": server, "experiment": "x"}))
    assert cli.main(["runs", str(run_dir), "--uri", server]) == 2  # the recorder answers 503
    assert requests and requests[0][1] == f"Bearer {TOKEN}"
    assert "cannot reach MLflow" in capsys.readouterr().err


def _fake_checkpoint(tmp_path: Path, uri: str) -> tuple[Any, Path]:
    """The job a shared checkpoint's trainer.json holds, with a tracking.uri of its author's choosing."""
    job = load_job(JOB, [f"tracking.uri={uri}", "tracking.close_timeout_s=120", "tracking.system_metrics=false"])
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("name: tiny-cpu\n")  # a run directory: eval logs to its store
    (ckpt / "trainer.json").write_text(json.dumps({"config": {}, "mlflow_run_id": None}))
    return job, ckpt


def test_eval_does_not_log_to_the_server_a_checkpoint_names(
    tmp_path: Path, capture_server: Any, user_credentials: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow import MlflowClient

    from elastic_pretrain.eval.commands import track_eval

    evil, requests = capture_server
    job, ckpt = _fake_checkpoint(tmp_path, evil)
    curve = QualityCurve(name="tiny", points=(CurvePoint(loops=1, relative_compute=1.0, loss=2.0),))
    run_id = track_eval(job, ckpt, curve, [], [])
    assert requests == [], f"the token went to {evil}: {requests}"
    assert f"the checkpoint's job logged to {evil}" in capsys.readouterr().err
    run = MlflowClient(local_store_uri(tmp_path / "run")).get_run(run_id)  # the run directory's own store
    assert run.data.metrics["eval/loss_loops_1"] == 2.0


# -------------------------------------------------------------------------------------- case 8
def test_uri_credentials_are_not_in_warnings(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from elastic_pretrain.tracking.config import TrackingConfig
    from elastic_pretrain.tracking.tracker import create_tracker

    caplog.set_level(logging.INFO, logger="elastic_pretrain.tracking")
    # a loopback port where nothing listens: the tracker warns that MLflow is unreachable
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{port}"
    cfg = TrackingConfig(uri=uri, system_metrics=False, flush_interval_s=0.1, close_timeout_s=2, request_timeout_s=2)
    tracker = create_tracker(cfg, run_dir=tmp_path, job_name="j", rank=0)
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.flush(5)
    tracker.close(2)
    text = caplog.text
    assert f"127.0.0.1:{port}" in text and "unreachable" in text, text
    assert PASSWORD not in text and "alice" not in text


def _secret_job() -> Any:
    return load_job(JOB, [f"tracking.uri=http://alice:{PASSWORD}@mlflow.example:5000", f"slurm.env.HF_TOKEN={HF_TOKEN}",
                          "slurm.env.NCCL_DEBUG=INFO"])  # fmt: skip


def test_saved_config_has_no_secrets_and_is_private(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_resolved(_secret_job(), tmp_path / "run")
    text = path.read_text()
    assert PASSWORD not in text and HF_TOKEN not in text
    assert "uri: http://mlflow.example:5000" in text and "HF_TOKEN: <redacted>" in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert cli.main(["config", str(JOB), f"tracking.uri=http://alice:{PASSWORD}@h:1", f"slurm.env.T={HF_TOKEN}"]) == 0
    out = capsys.readouterr().out
    assert PASSWORD not in out and HF_TOKEN not in out


def test_params_and_run_json_have_no_secrets(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Against a real MLflow server reached with user:password@ in the URI (the server ignores them)."""
    from mlflow import MlflowClient

    from elastic_pretrain.job import public_dict
    from elastic_pretrain.tracking.config import TrackingConfig
    from elastic_pretrain.tracking.tracker import create_tracker
    from tests.tracking.conftest import MlflowServer

    caplog.set_level(logging.INFO, logger="elastic_pretrain.tracking")
    server = MlflowServer(tmp_path / "server")
    server.start()
    try:
        uri = server.uri.replace("http://", f"http://alice:{PASSWORD}@")
        job = _secret_job()
        cfg = TrackingConfig(uri=uri, experiment="secrets", system_metrics=False, flush_interval_s=0.2)
        tracker = create_tracker(cfg, run_dir=tmp_path / "run", job_name="j", rank=0)
        tracker.log_params(flatten(public_dict(job)))
        assert tracker.flush(120), tracker.stats()
        run_id = tracker.run_id
        tracker.close(60)
        params = MlflowClient(server.uri).get_run(run_id).data.params
    finally:
        server.stop()
    assert params["tracking.uri"] == "http://mlflow.example:5000"
    assert params["slurm.env.HF_TOKEN"] == "<redacted>" and params["slurm.env.NCCL_DEBUG"] == "<redacted>"
    assert not [k for k, v in params.items() if PASSWORD in v or HF_TOKEN in v]
    run_json = local_store_dir(tmp_path / "run") / "run.json"
    assert json.loads(run_json.read_text())["uri"] == server.uri
    assert stat.S_IMODE(run_json.stat().st_mode) == 0o600
    assert PASSWORD not in caplog.text


def test_submitted_batch_script_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch script holds slurm.env values: owner-only (sbatch here only prints a job id)."""
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.parent.mkdir()
    sbatch.write_text("#!/bin/sh\necho 4242\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{sbatch.parent}{os.pathsep}{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    argv = ["submit", str(JOB), f"slurm.env.HF_TOKEN={HF_TOKEN}", "--nodes", "2", "--run-dir", str(run_dir)]
    assert cli.main(argv) == 0
    script = run_dir / "slurm" / "train.sbatch"
    assert HF_TOKEN in script.read_text()  # the job needs it
    assert stat.S_IMODE(script.stat().st_mode) == 0o600
