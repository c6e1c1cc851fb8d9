"""End to end: the default job (2 gloo ranks, EP=2) trains a few steps and its loss decreases."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO, VENV_BIN

pytestmark = pytest.mark.slow


def test_tiny_job_trains_and_reports_every_loop_count(tmp_path, monkeypatch):
    cli = str(VENV_BIN / "elastic-pretrain")
    subprocess.run([cli, "prepare-data", "stdlib-code"], cwd=REPO, check=True, capture_output=True, timeout=300)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            cli,
            "train",
            "jobs/tiny-cpu.yaml",
            "--nproc-per-node",
            "2",
            "--run-dir",
            str(run_dir),
            "train.steps=30",
            "train.warmup_steps=5",
            "train.log_interval=10",
            "train.eval_interval=0",
            "train.eval_sequences=16",
            "train.peak_tflops=0.1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "validation loss per loop count" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert sorted(summary["val_loss_by_loops"]) == ["1", "2", "3", "4"]
    assert summary["layout"] == {"world_size": 2, "tp": 1, "ep": 2, "pp": 1, "dp": 2, "device": "cpu"}
    assert (run_dir / "config.yaml").is_file()
    # the run is in the local MLflow store with its curves and the quality-budget plot
    from mlflow.tracking import MlflowClient

    from elastic_pretrain.tracking.config import local_store_uri

    client = MlflowClient(tracking_uri=local_store_uri(run_dir))
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [10, 20, 30]
    assert {f"val_loss_loops_{k}" for k in range(1, 5)} <= set(run.data.metrics)
    assert run.data.params["model.flatten"] == "2"
    # MFU against the named peak (0.1 TFLOP/s given on the command line: CPUs have no known peak)
    monkeypatch.chdir(run_dir / "mlflow")  # artifact locations are relative to the store's folder (docs/tracking.md)
    index = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")]
    assert index == ["checkpoints/index.json"]  # the checkpoint index, logged at the end
    assert 0 < run.data.metrics["mfu"] < 1 and "train.peak_tflops" in run.data.tags["mfu.peak_flops_per_s"]
    assert run.data.metrics["hfu"] >= run.data.metrics["mfu"] and 0 <= run.data.metrics["ghost_pass_fraction"] < 1
    # depth efficiency (issue 19): every step, the run's mean, MLflow, and the progress line once mixed
    assert all(0 < h["depth_efficiency"] <= 1 and h["ghost_time_s"] >= 0 for h in summary["history"])
    assert summary["depth_efficiency"] == pytest.approx(sum(h["depth_efficiency"] for h in summary["history"]) / 30)
    assert run.data.metrics["depth_efficiency"] == pytest.approx(1 - run.data.metrics["ghost_pass_fraction"])
    assert "mixed depth eff " in proc.stdout and "loss (mixed ℓ)" in proc.stdout
    # issue 33: the banner gives the shape as the job file states it and as flattened, and one parameter line
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.model.params import count_parameters, format_count

    counts = count_parameters(load_job(REPO / "jobs" / "tiny-cpu.yaml").model)
    assert "core 2 layers x 2 loops x 4 experts -> flattened x2: 1 x 4 passes x 8 experts" in proc.stdout
    assert f"parameters {format_count(counts.total)} total, {format_count(counts.active)} active" in proc.stdout
    assert "CPU patches" not in proc.stdout + proc.stderr and "NumExpr" not in proc.stdout + proc.stderr


def test_tiny_model_trains_from_webdataset_shards(tmp_path):
    """The other shard format end to end (one process): prepare WDS shards, train, loss decreases."""
    cli = str(VENV_BIN / "elastic-pretrain")
    out = tmp_path / "shards"
    subprocess.run(
        [cli, "prepare-data", "stdlib-code-wds", "prepare.max_tokens=1000000", f"prepare.output={out}"],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=300,
    )
    run_dir = tmp_path / "wds"
    streams = f"data.streams=[{{path: {out}, split: train}}]"
    validation = f"data.validation={{path: {out}, split: val}}"
    proc = subprocess.run(
        [
            cli,
            "train",
            "jobs/tiny-cpu.yaml",
            "data=stdlib-code-wds",
            streams,
            validation,
            "parallel=single",
            "--run-dir",
            str(run_dir),
            "train.steps=12",
            "train.warmup_steps=2",
            "train.lr=1e-2",
            "train.global_batch_size=4",
            "train.eval_interval=0",
            "train.eval_sequences=4",
            "checkpoint.interval=0",
            "tracking.backend=none",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    losses = [h["loss"] for h in json.loads((run_dir / "summary.json").read_text())["history"]]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]) - 1.0
