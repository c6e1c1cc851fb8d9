"""The rendered slurm/train.sbatch on a real Slurm cluster (4 local nodes), with the stand-in trainer.

No mocks: sbatch, srun, scontrol and torchrun (gloo across two nodes) are the real ones. Waits
are bounded (Slurm signals can land seconds late; a requeue takes ~cred_expire + a scheduling
pass) and nothing asserts a duration.

Every start imports torch four times (torchrun + trainer on each of 2 nodes), which dominates on
two cores, so the `jobs` fixture submits all jobs at once and they run side by side; each test
then acts on its own job. Jobs that a test interrupts hold at step HOLD_AT of their first start
until signalled (fake_trainer.py --hold-at), so no test races the clock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from slurm_helpers import (
    CLUSTER_SCRIPTS,
    CPUS_PER_NODE,
    PREEMPT_NODES,
    REPO,
    SAVE_EVERY,
    STEPS,
    Cluster,
    expected_value,
    job_log,
    log_tail,
    submit_fake,
    wait_for,
    wait_holding,
    wait_job_end,
)

from elastic_pretrain import cli
from elastic_pretrain.launch.layout import last_committed_step
from elastic_pretrain.launch.slurm import cancel, query_job
from elastic_pretrain.rundir import RunFiles

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]

START_TIMEOUT_S = 240  # job start + ~24 torch imports side by side on 2 shared cores + a few steps
END_TIMEOUT_S = 240  # includes one requeue (~cred_expire + scheduling) and a second start
HOLD_AT = SAVE_EVERY + 1  # interrupted jobs wait here: after one cadence checkpoint, before the next


class Job(NamedTuple):
    job_id: str
    run_dir: Path


@pytest.fixture(scope="module")
def jobs(slurm_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    """Submit every job of this module at once, then interrupt each as its scenario says.

    The cluster runs them side by side, so requeues and restarts overlap instead of adding up;
    each test below checks what became of one job.
    """
    base = tmp_path_factory.mktemp("jobs")
    plan: dict[str, tuple[Path, dict[str, Any]]] = {
        # the uninterrupted reference run, in a run dir whose path needs quoting everywhere
        "reference": (base / "run dir 'sq' \"dq\" #h $HOME `x` %j", {}),
        "cancelled": (base / "cancelled", {"hold_at": HOLD_AT, "retries": 3}),
        "preempted": (base / "preempted", {"hold_at": HOLD_AT, "retries": 2}),
        # real preemption: alone on node3+node4, which the preemptor then takes whole
        "partition": (base / "partition", {"hold_at": HOLD_AT, "retries": 2, "signal": "USR2",
                                           "partition": "debug", "nodelist": PREEMPT_NODES}),
        "early": (base / "early", {"hold_at": HOLD_AT, "retries": 1}),
        "capped": (base / "capped", {"hold_at": HOLD_AT, "retries": 0, "signal": "USR1"}),
        "killed": (base / "killed", {"hold_at": HOLD_AT, "retries": 3}),
        "step_signalled": (base / "step_signalled", {"hold_at": HOLD_AT, "retries": 2}),
        # the same, but rank 1 then exits 1 on its way out, after the save and STOPPED
        "stop_then_fail": (base / "stop_then_fail", {"hold_at": HOLD_AT, "retries": 2,
                                                     "extra": ("--fail-after-stop",)}),
        # a trainer that ends cleanly but forgets FINISHED must not be requeued over and over
        "unfinished": (base / "unfinished", {"steps": 2, "retries": 3, "extra": ("--forget-finished",)}),
    }  # fmt: skip
    jobs = {name: Job(submit_fake(run_dir, **kw), run_dir) for name, (run_dir, kw) in plan.items()}
    cleanup = [job.job_id for job in jobs.values()]
    try:
        # cancel as soon as the batch script runs (`elastic-pretrain cancel` does the same)
        job_id, run_dir = jobs["cancelled"]
        log = job_log(run_dir)  # created when the batch script starts
        wait_for(log.exists, timeout=START_TIMEOUT_S, what="the batch script to start", run_dir=run_dir, job_id=job_id)
        cancel(run_dir)
        # signalled while the trainer is still starting (no step yet, then no handler yet)
        job_id, run_dir = jobs["early"]
        log = job_log(run_dir)
        wait_for(lambda: log.exists() and "restart 0:" in log.read_text(), timeout=START_TIMEOUT_S,
                 what="the batch script's first line", run_dir=run_dir, job_id=job_id)  # fmt: skip
        subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], check=True)
        # what Slurm does `signal_lead_s` before the time limit: signal the batch shell only
        job_id, run_dir = jobs["preempted"]
        wait_holding(job_id, run_dir, timeout=START_TIMEOUT_S)
        subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], check=True)
        # a job in the higher-tier `high` partition that needs every CPU of node3+node4
        job_id, run_dir = jobs["partition"]
        wait_holding(job_id, run_dir, timeout=START_TIMEOUT_S)
        preemptor = ["-p", "high", "-w", PREEMPT_NODES, f"--ntasks-per-node={CPUS_PER_NODE}", "-o", "/dev/null"]
        high = subprocess.run(["sbatch", "--parsable", *preemptor, "--wrap", "sleep 1"], capture_output=True, text=True)
        assert high.returncode == 0, high.stderr
        cleanup.append(high.stdout.strip())
        # preempted with no retries left
        job_id, run_dir = jobs["capped"]
        wait_holding(job_id, run_dir, timeout=START_TIMEOUT_S)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
        # a stop signal to the job step only, not to the batch shell (what a returning node's step daemon did
        # in the dead-node test)
        for name in ("step_signalled", "stop_then_fail"):
            job_id, run_dir = jobs[name]
            wait_holding(job_id, run_dir, timeout=START_TIMEOUT_S)
            subprocess.run(["scancel", "--signal=TERM", job_id], check=True)
        # rank 1 dies mid-run on node2
        job_id, run_dir = jobs["killed"]
        wait_holding(job_id, run_dir, timeout=START_TIMEOUT_S)
        os.kill(int((run_dir / "pids" / "rank1").read_text()), signal.SIGKILL)
        yield jobs
    finally:
        for job_id in cleanup:  # a failed test may leave its job running
            subprocess.run(["scancel", job_id], capture_output=True)


def starts(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()]


def finished_value(run_dir: Path) -> float:
    return float(json.loads(RunFiles(run_dir).finished.read_text())["value"])


def test_preempted_job_requeues_resumes_and_matches_uninterrupted_run(jobs: dict[str, Job]) -> None:
    """Signalled like at the time limit (by the fixture): save, requeue, resume, same result."""
    job_id, run_dir = jobs["preempted"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "COMPLETED", f"{state}\n{log_tail(run_dir)}"
    assert state.restarts == 1
    first, second = starts(run_dir)
    assert (first["restart"], first["start_step"]) == (0, 0)
    assert second["restart"] == 1 and second["start_step"] == HOLD_AT, "the requeued job did not resume"
    ref_id, ref_dir = jobs["reference"]
    wait_job_end(ref_id, ref_dir, timeout=END_TIMEOUT_S)
    assert finished_value(run_dir) == finished_value(ref_dir) == expected_value()
    log = job_log(run_dir).read_text()
    assert "got SIGTERM" in log and "requeueing as restart 1 of 2" in log


def test_partition_preemption_signals_requeues_and_resumes(jobs: dict[str, Job]) -> None:
    """Real preemption (by the fixture's `high` job): Slurm signals, the job saves, requeues, resumes."""
    job_id, run_dir = jobs["partition"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "COMPLETED", f"{state}\n{log_tail(run_dir)}"
    # the requeued job can start again before the preemptor got the nodes, and be preempted once more
    # (seen on a loaded machine): each start then resumes where the one before saved
    assert state.restarts is not None and state.restarts >= 1
    assert [s["start_step"] for s in starts(run_dir)][:2] == [0, HOLD_AT], "the preempted job did not resume"
    assert finished_value(run_dir) == expected_value()
    # the script requeues the job itself once the step ends; if that takes longer than the
    # partition's GraceTime, Slurm kills and requeues it instead: either way it resumes
    assert "got SIGUSR2" in job_log(run_dir).read_text()


def test_signal_during_startup_still_requeues_and_finishes(jobs: dict[str, Job]) -> None:
    """Signalled while the step is starting: the trainer cannot save yet (the script repeats the
    signal until it can, or the signal ends the half-started step), the job requeues and finishes."""
    job_id, run_dir = jobs["early"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "COMPLETED" and state.restarts == 1, f"{state}\n{log_tail(run_dir)}"
    assert "got SIGTERM" in job_log(run_dir).read_text()
    assert finished_value(run_dir) == expected_value()


def test_retry_cap_stops_requeueing(jobs: dict[str, Job]) -> None:
    """Signalled with retries=0: the trainer saves, the job ends FAILED (exit 3), no requeue."""
    job_id, run_dir = jobs["capped"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "FAILED" and state.exit_code == "3:0", f"{state}\n{log_tail(run_dir)}"
    assert state.restarts == 0
    files = RunFiles(run_dir)
    assert not files.finished.exists()
    assert last_committed_step(files) == HOLD_AT, "the signalled trainer should have saved"
    assert "reached the retry cap slurm.retries=0" in job_log(files.run_dir).read_text()


def test_stop_signal_to_the_step_only_requeues_and_finishes(jobs: dict[str, Job]) -> None:
    """The trainer got a stop signal the batch shell did not: it saved and wrote STOPPED, so the script
    requeues it like a preemption (not exit 5, 'exited 0 without being signalled'); the restart resumes."""
    job_id, run_dir = jobs["step_signalled"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "COMPLETED" and state.restarts == 1, f"{state}\n{log_tail(run_dir)}"
    assert [s["start_step"] for s in starts(run_dir)] == [0, HOLD_AT], "the stopped job did not resume"
    assert finished_value(run_dir) == expected_value()
    files = RunFiles(run_dir)
    log = job_log(files.run_dir).read_text()
    assert "the trainer stopped on a signal that did not come through this script" in log, log
    assert "got SIGTERM" not in log and "requeueing as restart 1 of 2" in log, log
    assert not files.stopped.exists(), "the restart that finished must clear the earlier start's STOPPED"


def test_a_failure_after_the_stop_save_still_requeues(jobs: dict[str, Job]) -> None:
    """Stopped through the step as above, saved, STOPPED written, then a rank exited 1 on its way out:
    the checkpoint is complete, so the script requeues (on_failure=fail is about trainer failures, and
    this start's save is what a restart needs); the restart resumes and finishes."""
    job_id, run_dir = jobs["stop_then_fail"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "COMPLETED" and state.restarts == 1, f"{state}\n{log_tail(run_dir)}"
    assert [s["start_step"] for s in starts(run_dir)] == [0, HOLD_AT], "the stopped job did not resume"
    assert finished_value(run_dir) == expected_value()
    log = job_log(run_dir).read_text()
    assert "after the trainer saved and stopped" in log, log  # the exit: 1, or 137 when srun ended the step
    assert "the trainer failed" not in log and "requeueing as restart 1 of 2" in log, log


def test_killed_task_fails_the_job_without_hanging(jobs: dict[str, Job]) -> None:
    """One rank SIGKILLed: the whole step is torn down and the job ends FAILED, not requeued."""
    job_id, run_dir = jobs["killed"]
    state = wait_job_end(job_id, run_dir, timeout=120)
    assert state.state == "FAILED", f"{state}\n{log_tail(run_dir)}"
    assert state.restarts == 0, "on_failure=fail must not requeue a crashed trainer"
    assert "the trainer failed" in job_log(run_dir).read_text()


def test_clean_exit_without_finished_marker_fails_instead_of_requeueing(jobs: dict[str, Job]) -> None:
    job_id, run_dir = jobs["unfinished"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "FAILED" and state.exit_code == "5:0", f"{state}\n{log_tail(run_dir)}"
    assert state.restarts == 0
    assert "without writing" in job_log(run_dir).read_text()


def test_two_node_job_runs_on_distinct_hosts_and_finishes(jobs: dict[str, Job]) -> None:
    job_id, run_dir = jobs["reference"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "COMPLETED" and state.restarts == 0, f"{state}\n{log_tail(run_dir)}"
    files = RunFiles(run_dir)
    assert job_log(files.run_dir).is_file(), "sbatch --output did not land at the literal run dir path"
    assert files.job_id.read_text().strip() == job_id
    (start,) = starts(run_dir)
    assert start["start_step"] == 0 and start["restart"] == 0
    assert sorted(start["hosts"]) == ["node1", "node2"], "the two ranks must run on two distinct hosts"
    assert finished_value(run_dir) == expected_value()
    assert last_committed_step(files) == STEPS // SAVE_EVERY * SAVE_EVERY
    assert "training finished" in job_log(files.run_dir).read_text()


def test_status_reports_job_restarts_and_last_step(jobs: dict[str, Job], capsys: pytest.CaptureFixture[str]) -> None:
    job_id, run_dir = jobs["preempted"]
    wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    run_id = "0123abcd" * 4  # an MLflow run id: 32 hex digits (status refuses anything else)
    RunFiles(run_dir).mlflow_run_id.write_text(run_id + "\n")
    assert cli.main(["status", str(run_dir), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["job_id"] == job_id and st["finished"] is True
    assert st["last_step"] == STEPS // SAVE_EVERY * SAVE_EVERY
    assert st["job"]["state"] == "COMPLETED" and st["job"]["restarts"] == 1
    assert st["mlflow_run_id"] == run_id
    assert cli.main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "COMPLETED" in out and run_id in out


def test_cancel_stops_the_job_for_good(jobs: dict[str, Job], capsys: pytest.CaptureFixture[str]) -> None:
    """Cancelled by the fixture: CANCELLED, never requeued; cancelling again is a no-op."""
    job_id, run_dir = jobs["cancelled"]
    state = wait_job_end(job_id, run_dir, timeout=120)
    assert state.state == "CANCELLED" and state.restarts == 0, f"{state}\n{log_tail(run_dir)}"
    assert RunFiles(run_dir).cancelled.read_text().strip() == job_id
    assert cli.main(["cancel", str(run_dir)]) == 0
    assert f"job {job_id} already ended (CANCELLED)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "hint"),
    [(["--partition", "nope"], "--partition"), (["--nodes", "5"], "--nodes"), (["--time", "1:2:3:4"], "--time")],
)
def test_bad_slurm_options_are_one_line_user_errors(
    slurm_cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], hint: str
) -> None:
    # a valid job (submit validates the whole job before sbatch), bad Slurm options only
    job = REPO / "jobs" / "tiny-cpu.yaml"
    argv = ["submit", str(job), "--nodes", "2", *flags, "--run-dir", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and hint in err, err
    assert not (tmp_path / "run" / "slurm" / "job_id").exists()


def test_up_is_idempotent_while_jobs_run(jobs: dict[str, Job], slurm_cluster: Cluster) -> None:
    """A second up.sh keeps the running daemons (and so the jobs) and just checks the nodes."""
    up = subprocess.run(["bash", str(CLUSTER_SCRIPTS / "up.sh")], env=slurm_cluster.env, capture_output=True, text=True)
    assert up.returncode == 0, up.stderr
    assert "slurmctld already running" in up.stdout and "cluster up" in up.stdout
    assert all(query_job(job.job_id) is not None for job in jobs.values())
