"""The rendered slurm/train.sbatch on a real 2-node Slurm cluster, with the stand-in trainer.

No mocks: sbatch, srun, scontrol and torchrun (gloo across the two nodes) are the real ones.
Waits are bounded (Slurm signals can land seconds late; a requeue takes ~cred_expire + a
scheduling pass), and nothing asserts a duration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from slurm_helpers import (
    SAVE_EVERY,
    STEPS,
    Cluster,
    expected_value,
    log_tail,
    submit_fake,
    wait_checkpoint,
    wait_for,
    wait_job_end,
)

from elastic_pretrain import cli
from elastic_pretrain.launch.layout import RunFiles, last_committed_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(240)]

START_TIMEOUT_S = 120  # first checkpoint: job start + 4 torch imports on 2 shared cores + a few steps
END_TIMEOUT_S = 150  # includes one requeue (~cred_expire + scheduling) and a second start


def starts(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()]


def finished_value(run_dir: Path) -> float:
    return float(json.loads(RunFiles(run_dir).finished.read_text())["value"])


@pytest.fixture(scope="module")
def reference_run(slurm_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One uninterrupted 2-node run, in a run dir whose path needs quoting everywhere."""
    run_dir = tmp_path_factory.mktemp("ref") / "run dir 'sq' \"dq\" #h $HOME `x` %j"
    job_id = submit_fake(run_dir)
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "COMPLETED", f"{state}\n{log_tail(run_dir)}"
    return job_id, run_dir


def test_two_node_job_runs_on_distinct_hosts_and_finishes(reference_run: tuple[str, Path]) -> None:
    job_id, run_dir = reference_run
    files = RunFiles(run_dir)
    assert files.log.is_file(), "sbatch --output did not land at the literal run dir path"
    assert files.script.is_file() and files.job_id.read_text().strip() == job_id
    (start,) = starts(run_dir)
    assert start["start_step"] == 0 and start["restart"] == 0
    assert sorted(start["hosts"]) == ["node1", "node2"], "the two ranks must run on two distinct hosts"
    assert finished_value(run_dir) == expected_value()
    assert last_committed_step(files) == STEPS // SAVE_EVERY * SAVE_EVERY
    assert "training finished" in files.log.read_text()


def test_status_reports_job_restarts_and_last_step(
    reference_run: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    job_id, run_dir = reference_run
    RunFiles(run_dir).mlflow_run_id.write_text("0123abcd\n")
    assert cli.main(["status", str(run_dir), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["job_id"] == job_id and st["finished"] is True and st["last_step"] == 12
    assert st["job"]["state"] == "COMPLETED" and st["job"]["restarts"] == 0
    assert st["mlflow_run_id"] == "0123abcd"
    assert cli.main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "COMPLETED" in out and "0123abcd" in out


def test_preempted_job_requeues_resumes_and_matches_uninterrupted_run(
    reference_run: tuple[str, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "preempted"
    job_id = submit_fake(run_dir, retries=2)
    wait_checkpoint(job_id, run_dir, step=SAVE_EVERY, timeout=START_TIMEOUT_S)
    # what Slurm does `signal_lead_s` before the time limit: signal the batch shell only
    subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], check=True)
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "COMPLETED", f"{state}\n{log_tail(run_dir)}"
    assert state.restarts == 1
    first, second = starts(run_dir)
    assert (first["restart"], first["start_step"]) == (0, 0)
    assert second["restart"] == 1 and second["start_step"] >= SAVE_EVERY, "the requeued job did not resume"
    assert finished_value(run_dir) == finished_value(reference_run[1]) == expected_value()
    log = RunFiles(run_dir).log.read_text()
    assert "got SIGTERM" in log and "requeueing as restart 1 of 2" in log


def test_retry_cap_stops_requeueing(slurm_cluster: Cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "capped"
    job_id = submit_fake(run_dir, retries=0, signal="USR1")
    wait_checkpoint(job_id, run_dir, step=SAVE_EVERY, timeout=START_TIMEOUT_S)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "FAILED" and state.exit_code == "3:0", f"{state}\n{log_tail(run_dir)}"
    assert state.restarts == 0
    files = RunFiles(run_dir)
    assert not files.finished.exists()
    assert (last_committed_step(files) or 0) >= SAVE_EVERY, "the signalled trainer should have saved"
    assert "reached the retry cap slurm.retries=0" in files.log.read_text()


def test_killed_task_fails_the_job_without_hanging(slurm_cluster: Cluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    job_id = submit_fake(run_dir, steps=1000, retries=3)
    pid_file = run_dir / "pids" / "rank1"
    wait_checkpoint(job_id, run_dir, step=SAVE_EVERY, timeout=START_TIMEOUT_S)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)  # rank 1 dies mid-step on node2
    state = wait_job_end(job_id, run_dir, timeout=90)
    assert state.state == "FAILED", f"{state}\n{log_tail(run_dir)}"
    assert state.restarts == 0, "on_failure=fail must not requeue a crashed trainer"
    assert "the trainer failed" in RunFiles(run_dir).log.read_text()


def test_cancel_stops_the_job_for_good(
    slurm_cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "cancelled"
    job_id = submit_fake(run_dir, steps=1000, retries=3)
    wait_for(lambda: (run_dir / "starts.jsonl").exists(), timeout=START_TIMEOUT_S, what="the trainer to start",
             run_dir=run_dir, job_id=job_id)  # fmt: skip
    assert cli.main(["cancel", str(run_dir)]) == 0
    assert f"cancelled job {job_id}" in capsys.readouterr().out
    state = wait_job_end(job_id, run_dir, timeout=60)
    assert state.state == "CANCELLED" and state.restarts == 0, f"{state}\n{log_tail(run_dir)}"
    assert RunFiles(run_dir).cancelled.exists()
    assert cli.main(["cancel", str(run_dir)]) == 0
    assert "already ended" in capsys.readouterr().out


def test_partition_preemption_signals_requeues_and_resumes(
    reference_run: tuple[str, Path], slurm_cluster: Cluster, tmp_path: Path
) -> None:
    """Real preemption: a job in the `high` partition needs the CPUs of the running `debug` job."""
    run_dir = tmp_path / "preempt-partition"
    job_id = submit_fake(run_dir, retries=2, signal="USR2", partition="debug")
    wait_checkpoint(job_id, run_dir, step=SAVE_EVERY, timeout=START_TIMEOUT_S)
    needs_all_cpus = ["-p", "high", "-N", "2", "--ntasks-per-node=2", "-o", "/dev/null", "--wrap", "sleep 1"]
    high = subprocess.run(["sbatch", "--parsable", *needs_all_cpus], capture_output=True, text=True, check=True)
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    subprocess.run(["scancel", high.stdout.strip()], capture_output=True)
    assert state.state == "COMPLETED", f"{state}\n{log_tail(run_dir)}"
    assert (state.restarts or 0) >= 1
    assert starts(run_dir)[1]["start_step"] >= SAVE_EVERY, "the preempted job did not resume"
    assert finished_value(run_dir) == finished_value(reference_run[1])
    assert "got SIGUSR2" in RunFiles(run_dir).log.read_text()


@pytest.mark.parametrize(
    ("flags", "hint"),
    [(["--partition", "nope"], "--partition"), (["--nodes", "3"], "--nodes")],
)
def test_sbatch_rejections_are_one_line_user_errors(
    slurm_cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], hint: str
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: tiny\n")
    argv = ["submit", str(job), "--nodes", "2", *flags, "--run-dir", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sbatch rejected the job" in err and hint in err, err
    assert not (tmp_path / "run" / "slurm" / "job_id").exists()
