"""The real trainer on the local Slurm cluster: `elastic-pretrain submit jobs/tiny-cpu.yaml --nodes 2`.

Same cluster as test_cluster.py, but the jobs run `elastic-pretrain train` itself (the tiny looped
MoE, expert parallel 2 over two nodes x one process, gloo) instead of the stand-in trainer:

* an uninterrupted reference run trains, commits checkpoints and ends with FINISHED;
* a run signalled like at the time limit (`scancel --signal=TERM --batch`) once a checkpoint exists
  saves at the next step boundary, requeues, resumes from that checkpoint, continues the same
  MLflow run, and ends with a per-step loss curve bitwise equal to the reference's;
* a run whose training shards are corrupt stops on that user error: its one line is in the log
  once for the whole job (not once per rank), with no launcher traceback, and the job exits 2.

The retry cap, a killed rank, cancel and real partition preemption are test_cluster.py's (the
batch script decides those; the real trainer's part, save and exit 0 on the signal, is the same).
The jobs are submitted at once and run side by side (each start imports torch and megatron on
four processes, which dominates on two cores). Unlike the stand-in, the real trainer cannot hold
mid-run, so the interrupted run is signalled as soon as its first checkpoint is committed;
train.steps leaves many steps after that, and the test checks that the signal landed mid-run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from slurm_helpers import MAIN_NODES, REPO, Cluster, job_log, log_tail, wait_checkpoint, wait_job_end

from elastic_pretrain import cli
from elastic_pretrain.launch.layout import last_committed_step
from elastic_pretrain.rundir import RunFiles

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 16
INTERVAL = 4  # checkpoint.interval
LOG_INTERVAL = 4
OVERRIDES = [
    f"train.steps={STEPS}", "train.warmup_steps=4", f"train.log_interval={LOG_INTERVAL}", "train.eval_interval=0",
    "train.eval_sequences=8", f"checkpoint.interval={INTERVAL}",
    # node3+node4 belong to test_cluster.py's partition-preemption test
    f"slurm.sbatch_args=['--nodelist={MAIN_NODES}']",
]  # fmt: skip
# 2 jobs x 4 processes importing torch+megatron side by side on 2 shared cores, then a few steps
START_TIMEOUT_S = 420
END_TIMEOUT_S = 600  # + the rest of the run, one requeue (~cred_expire + scheduling) and a second start


class Job(NamedTuple):
    job_id: str
    run_dir: Path


def submit_real(run_dir: Path, *flags: str) -> Job:
    argv = ["submit", str(REPO / "jobs" / "tiny-cpu.yaml"), *OVERRIDES, "--nodes", "2", "--run-dir", str(run_dir)]
    assert cli.main([*argv, *flags]) == 0
    return Job(RunFiles(run_dir).job_id.read_text().strip(), run_dir)


@pytest.fixture(scope="module")
def jobs(slurm_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    base = tmp_path_factory.mktemp("real")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the job's working directory: data/ and cache/ paths are relative to it
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # each run's own local store (sbatch exports the env)
        prep = [sys.executable, "-m", "elastic_pretrain.cli", "prepare-data", "stdlib-code"]
        subprocess.run(prep, cwd=REPO, check=True, capture_output=True, timeout=300)
        jobs = {
            "reference": submit_real(base / "reference", "--retries", "1"),
            "preempted": submit_real(base / "preempted", "--retries", "1"),
            # on_failure=requeue: a user error must stop the job all the same (a restart fails the same way)
            "bad_shards": submit_real(base / "bad shards", f"data={corrupt_copy(base)}", "slurm.on_failure=requeue",
                                      "--retries", "2"),
        }  # fmt: skip
    try:
        # what Slurm does `signal_lead_s` before the time limit: signal the batch shell only
        job_id, run_dir = jobs["preempted"]
        wait_checkpoint(job_id, run_dir, step=INTERVAL, timeout=START_TIMEOUT_S)
        subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], check=True)
        yield jobs
    finally:
        for job in jobs.values():  # a failed test may leave its job running
            subprocess.run(["scancel", job.job_id], capture_output=True)


def corrupt_copy(base: Path) -> Path:
    """A recipe reading a copy of the prepared corpus whose training shards each have one byte flipped."""
    src = yaml.safe_load((REPO / "data" / "stdlib-code.yaml").read_text())
    copy = base / "corrupt-stdlib-code"
    shutil.copytree(REPO / src["prepare"]["output"], copy)
    shards = [p for p in (copy / "train").iterdir() if p.is_file() and p.name != "index.json"]
    assert shards, f"no shards in {copy / 'train'}"
    for shard in shards:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    recipe = {k: v for k, v in src.items() if k != "prepare"}
    recipe["streams"] = [{**s, "path": str(copy)} for s in src["streams"]]
    recipe["validation"] = {**src["validation"], "path": str(copy)}
    path = base / "corrupt-stdlib-code.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def stopped_at(log: str, sig: str) -> int:
    """The step at which the signalled trainer saved and stopped (from its log)."""
    # "SIGTERM", or "SIGTERM on rank 0" when the signal reached the ranks on either side of a step boundary
    found = re.findall(rf"stopped \(SIG{sig}(?: on ranks? [\d, ]+)?\) at step (\d+)/{STEPS}: checkpoint saved", log)
    assert len(found) == 1, f"the trainer did not save on SIG{sig} (once):\n{log[-6000:]}"
    return int(found[0])


def mlflow_runs(run_dir: Path) -> list[Any]:
    from mlflow.tracking import MlflowClient

    from elastic_pretrain.tracking.config import local_store_uri

    client = MlflowClient(tracking_uri=local_store_uri(run_dir))
    return [run for exp in client.search_experiments() for run in client.search_runs([exp.experiment_id])]


def loss_metric(run_dir: Path, run_id: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    from elastic_pretrain.tracking.config import local_store_uri

    history = MlflowClient(tracking_uri=local_store_uri(run_dir)).get_metric_history(run_id, "loss")
    return sorted((m.step, m.value) for m in history)


def test_two_node_real_trainer_trains_checkpoints_and_finishes(jobs: dict[str, Job]) -> None:
    job_id, run_dir = jobs["reference"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    assert state.state == "COMPLETED" and state.restarts == 0, f"{state}\n{log_tail(run_dir)}"
    files = RunFiles(run_dir)
    assert json.loads(files.finished.read_text())["step"] == STEPS
    assert last_committed_step(files) == STEPS
    kept = sorted(p.name for p in files.checkpoints.glob("step_*"))
    assert kept == [f"step_{STEPS - INTERVAL}", f"step_{STEPS}"], "keep_last=2 of the committed checkpoints"
    s = summary(run_dir)
    assert [h["step"] for h in s["history"]] == list(range(1, STEPS + 1))
    assert s["layout"] == {"world_size": 2, "tp": 1, "ep": 2, "pp": 1, "dp": 2, "device": "cpu"}
    assert s["stopped"] is None
    log = job_log(files.run_dir).read_text()
    assert "2 node(s) node[1-2] x 1 process(es)" in log and "training finished" in log
    (run,) = mlflow_runs(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_id == files.mlflow_run_id.read_text().strip()


def test_preempted_real_run_resumes_same_mlflow_run_and_matches_reference_bitwise(jobs: dict[str, Job]) -> None:
    job_id, run_dir = jobs["preempted"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    files = RunFiles(run_dir)
    log = job_log(files.run_dir).read_text()
    assert state.state == "COMPLETED" and state.restarts == 1, f"{state}\n{log_tail(run_dir)}"
    assert "got SIGTERM" in log and "requeueing as restart 1 of 1" in log
    step = stopped_at(log, "TERM")
    assert INTERVAL <= step < STEPS, "the signal must land mid-run"
    assert f"resumed from {files.checkpoints / f'step_{step}'} (step {step}," in log
    assert json.loads(files.finished.read_text())["step"] == STEPS

    ref_dir = jobs["reference"].run_dir
    wait_job_end(jobs["reference"].job_id, ref_dir, timeout=END_TIMEOUT_S)
    # bitwise numerics; the estimated ghost time is a wall-clock value (as tests/checkpoint/runs.py TIMING_KEYS)
    ours, ref = (
        [{k: v for k, v in h.items() if k != "ghost_time_s"} for h in summary(d)["history"]] for d in (run_dir, ref_dir)
    )
    assert [h["step"] for h in ours] == list(range(1, STEPS + 1))
    # bitwise: the same floats, per step and per loop count, before and after the resume
    assert ours == ref, next(f"step {a['step']}: {a} != {b}" for a, b in zip(ours, ref) if a != b)

    # one MLflow run across both starts, its curve logged once per step and equal to the reference's
    (run,) = mlflow_runs(run_dir)
    assert run.info.status == "FINISHED"
    assert files.mlflow_run_id.read_text().strip() == run.info.run_id
    curve = loss_metric(run_dir, run.info.run_id)
    assert [s for s, _ in curve] == list(range(LOG_INTERVAL, STEPS + 1, LOG_INTERVAL))
    ref_run_id = RunFiles(ref_dir).mlflow_run_id.read_text().strip()
    assert curve == loss_metric(ref_dir, ref_run_id)


def test_user_error_on_two_nodes_prints_once_without_traceback_and_exits_2(jobs: dict[str, Job]) -> None:
    """Every rank (one per node) reads a corrupt shard: the ranks leave their line in slurm/errors, the
    node launchers exit 2 quietly, the batch script prints it once and ends the job with exit 2, not
    requeued although slurm.on_failure=requeue."""
    job_id, run_dir = jobs["bad_shards"]
    state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    log = job_log(run_dir).read_text()
    assert state.state == "FAILED" and state.exit_code == "2:0", f"{state}\n{log[-6000:]}"
    assert state.restarts == 0, "a user error must not be requeued"
    for noise in ("Traceback", "ChildFailedError", "torch.distributed.elastic"):
        assert noise not in log, log[-6000:]
    errors = [line for line in log.splitlines() if "delete it and re-run prepare-data" in line]
    assert len(errors) == 1, log[-6000:]
    assert "] error: " in errors[0] and "corrupt-stdlib-code [train]: shard " in errors[0], errors[0]
    assert "training stopped on this user error: not requeueing" in log
    assert not RunFiles(run_dir).finished.exists() and last_committed_step(RunFiles(run_dir)) is None
