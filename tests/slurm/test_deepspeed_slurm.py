"""An ``engine: deepspeed`` job on the local Slurm cluster: `elastic-pretrain submit jobs/tiny-cpu.yaml --nodes 2
engine=deepspeed parallel=single` (ZeRO-2, data parallel over two nodes x one process, gloo).

The job is signalled like at the time limit (`scancel --signal=TERM --batch`) once its first checkpoint is
committed: the DeepSpeed trainer saves at the next step boundary (DeepSpeed's own files in
``step_<N>/model_optim``, the project's commit marker), exits 0, the batch script requeues it, the restart resumes
from that checkpoint through DeepSpeed's load (weights-only, engine/safe_load.py) and finishes. The loss history
continues: every step once, the steps before the signal exactly as the first start logged them, one MLflow run
across both starts. (The numbers after a resume are the uninterrupted run's bitwise: tests/engine/
test_deepspeed_checkpoint.py, without Slurm; here one job, no reference job, keeps the test cheap.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_helpers import MAIN_NODES, REPO, Cluster, job_log, log_tail, wait_checkpoint, wait_job_end

from elastic_pretrain import cli
from elastic_pretrain.rundir import RunFiles

pytest.importorskip("deepspeed")
# long: two starts of a 2-node DeepSpeed job; CI runs the DeepSpeed stop/resume without Slurm (tests/engine/
# test_deepspeed_checkpoint.py) and the batch script's preemption path with the megatron engine (docs/testing.md)
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(900)]

STEPS = 12
INTERVAL = 3  # checkpoint.interval
OVERRIDES = [
    "engine=deepspeed", "parallel=single", "deepspeed.zero_stage=2",
    f"train.steps={STEPS}", "train.warmup_steps=2", "train.log_interval=1", "train.eval_interval=0",
    "train.eval_sequences=4", "train.global_batch_size=8", f"checkpoint.interval={INTERVAL}",
    f"slurm.sbatch_args=['--nodelist={MAIN_NODES}']",  # node3+node4: test_cluster.py's preemption test
]  # fmt: skip
START_TIMEOUT_S = 420  # 2 processes importing torch, megatron and DeepSpeed on 2 shared cores, then a few steps
END_TIMEOUT_S = 600  # the rest of the run, one requeue and a second start


def logged_losses(log: str) -> dict[int, str]:
    """step -> the loss as the progress line printed it (each start prints its own steps)."""
    return {int(s): v for s, v in re.findall(rf"step +(\d+)/{STEPS} .*?loss ([0-9.]+)", log)}


def test_deepspeed_job_is_preempted_requeued_and_resumes(
    slurm_cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "deepspeed"
    monkeypatch.chdir(REPO)  # the job's working directory: data/ and cache/ paths are relative to it
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run's own local store
    prep = [sys.executable, "-m", "elastic_pretrain.cli", "prepare-data", "stdlib-code"]
    subprocess.run(prep, cwd=REPO, check=True, capture_output=True, timeout=300)
    argv = ["submit", str(REPO / "jobs" / "tiny-cpu.yaml"), *OVERRIDES, "--nodes", "2", "--run-dir", str(run_dir),
            "--retries", "1"]  # fmt: skip
    assert cli.main(argv) == 0
    files = RunFiles(run_dir)
    job_id = files.job_id.read_text().strip()
    try:
        wait_checkpoint(job_id, run_dir, step=INTERVAL, timeout=START_TIMEOUT_S)
        subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], check=True)
        state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    log = job_log(files.run_dir).read_text()
    assert state.state == "COMPLETED" and state.restarts == 1, f"{state}\n{log_tail(run_dir)}"
    assert "engine deepspeed: ZeRO-2" in log and "got SIGTERM" in log and "requeueing as restart 1 of 1" in log
    found = re.findall(rf"stopped \(SIGTERM(?: on ranks? [\d, ]+)?\) at step (\d+)/{STEPS}: checkpoint saved", log)
    assert len(found) == 1, log[-6000:]
    step = int(found[0])
    assert INTERVAL <= step < STEPS, "the signal must land mid-run"
    assert f"resumed from {files.checkpoints / f'step_{step}'} (step {step}," in log
    newest = sorted(files.checkpoints.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    assert newest.name == f"step_{STEPS}" and any((newest / "model_optim").glob("*_model_states.pt"))  # DeepSpeed's
    assert json.loads(files.finished.read_text())["step"] == STEPS

    # the loss history continues: every step once; the first start's steps as it printed them
    history = json.loads((run_dir / "summary.json").read_text())["history"]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    printed = logged_losses(log.split("requeueing as restart 1")[0])  # the first start's lines
    assert set(range(1, step + 1)) <= set(printed), printed
    for h in history[:step]:
        assert abs(h["loss"] - float(printed[h["step"]])) < 10 ** -(len(printed[h["step"]].split(".")[1])), h

    from mlflow.tracking import MlflowClient

    from elastic_pretrain.tracking.config import local_store_uri

    client = MlflowClient(tracking_uri=local_store_uri(run_dir))
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    curve = sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "loss"))
    assert [s for s, _ in curve] == list(range(1, STEPS + 1))
    assert [v for _, v in curve] == pytest.approx([h["loss"] for h in history], abs=1e-6)
