"""A node dies mid-job: the real trainer on 2 Slurm nodes, one node's slurmd and every process on it
SIGKILLed at once (what a power loss leaves), then the node comes back.

On node[3-4] of the test cluster (node[1-2] run the other modules' jobs; node3+node4 are free once
test_cluster.py's partition test has ended). The job runs with ``slurm.on_failure=requeue``. After
the kill: the step ends (the surviving rank's gloo peer is gone), Slurm marks the node DOWN
(``SlurmdTimeout``) and requeues the job itself (``sbatch --requeue``); it waits for two nodes. When
node4's slurmd is back, the requeued job starts, resumes from the last checkpoint committed before
the kill, and finishes. Its per-step loss history equals, bitwise, an uninterrupted 2-process run of
the same job (``elastic-pretrain train --nproc-per-node 2``: the same layout EP 2 x DP 2, the same
threads per rank). docs/faults.md ("Dead node") shows what the user sees.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_helpers import (
    CLUSTER_SCRIPTS,
    PREEMPT_NODES,
    REPO,
    Cluster,
    job_log,
    log_tail,
    wait_checkpoint,
    wait_for,
    wait_job_end,
)

from elastic_pretrain import cli
from elastic_pretrain.checkpoint.store import CheckpointStore
from elastic_pretrain.launch.slurm import query_job
from elastic_pretrain.rundir import RunFiles
from tests.checkpoint.runs import COMMON, history, train

# long: 5-10 min of one scenario (a node kill, Slurm noticing it, the requeue, the revival) beyond the CI budget
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(1500)]

STEPS = 20
INTERVAL = 4
DEAD = "node4"
RUN = [f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}", "checkpoint.keep_last=10"]
SLURM = ["slurm.on_failure=requeue", "slurm.retries=2", f"slurm.sbatch_args=['--nodelist={PREEMPT_NODES}']"]
START_TIMEOUT_S = 600  # 4 processes importing torch + megatron on 2 shared cores, then the first checkpoint
DOWN_TIMEOUT_S = 240  # SlurmdTimeout (30 s) + the controller's ping cycle + the requeue
BEGIN_DELAY_S = 300  # a requeued batch job's begin time is set ahead (reason BeginTime) before it waits for nodes
END_TIMEOUT_S = 600  # a second start and the rest of the run


def uts_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/uts")


def kill_node(cluster: Cluster, node: str) -> list[int]:
    """SIGKILL the node's slurmd and every process in its UTS namespace (slurmstepd, the batch
    shell if it ran there, torchrun, the trainer): each local node runs in a namespace of its own."""
    slurmd = int((cluster.home / "run" / f"slurmd-{node}.pid").read_text())
    ns = uts_namespace(slurmd)
    victims = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if uts_namespace(int(proc.name)) == ns:
                victims.append(int(proc.name))
        except OSError:
            continue
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return victims


def node_state(node: str) -> str:
    out = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def test_dead_node_requeues_and_resumes_from_the_last_committed_checkpoint(
    slurm_cluster: Cluster, tmp_path: Path
) -> None:
    run_dir, ref_dir = tmp_path / "run", tmp_path / "reference"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the job's working directory: data/ and cache/ paths are relative to it
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        prep = [sys.executable, "-m", "elastic_pretrain.cli", "prepare-data", "stdlib-code"]
        subprocess.run(prep, cwd=REPO, check=True, capture_output=True, timeout=300)
        argv = ["submit", str(REPO / "jobs" / "tiny-cpu.yaml"), *COMMON, *RUN, *SLURM, "--nodes", "2"]
        assert cli.main([*argv, "--run-dir", str(run_dir)]) == 0
    files = RunFiles(run_dir)
    job_id = files.job_id.read_text().strip()
    store = CheckpointStore(files.checkpoints)
    revived = False
    try:
        wait_checkpoint(job_id, run_dir, step=INTERVAL, timeout=START_TIMEOUT_S)
        assert kill_node(slurm_cluster, DEAD), f"no process of {DEAD}"
        # nothing commits once a rank is gone: the resume point is fixed now
        committed = store.newest()
        assert committed is not None and committed.step < STEPS, "the kill must land mid-run"

        # the uninterrupted reference, meanwhile (local, 2 processes: the same layout and numerics)
        train(ref_dir, 2, *RUN)

        # Slurm notices the dead node, the step ends and the job is requeued (pending for 2 nodes)
        def requeued() -> bool:
            state = query_job(job_id)
            return state is not None and (state.restarts or 0) >= 1 and state.state == "PENDING"

        wait_for(requeued, timeout=DOWN_TIMEOUT_S, what="the job to be requeued", run_dir=run_dir, job_id=job_id)
        assert node_state(DEAD).startswith("down"), node_state(DEAD)
        assert not files.finished.exists()

        # a requeued job first waits out Slurm's requeue begin-time delay (reason BeginTime), then waits for
        # the node: ReqNodeNotAvail, UnavailableNodes:node4
        def waits_for_the_node() -> bool:
            state = query_job(job_id)
            return state is not None and state.state == "PENDING" and DEAD in state.reason

        wait_for(waits_for_the_node, timeout=BEGIN_DELAY_S, what=f"the job to wait for {DEAD}", run_dir=run_dir,
                 job_id=job_id)  # fmt: skip
        pending = query_job(job_id)
        # Slurm itself requeued it (the batch script asks for --requeue), whatever the script then decided
        ctld = (slurm_cluster.home / "log" / "slurmctld.log").read_text(errors="replace")
        assert f"requeue job JobId={job_id} due to failure of node {DEAD}" in ctld

        # the node comes back (up.sh starts its slurmd again; ReturnToService=2 makes it usable)
        up = subprocess.run(["bash", str(CLUSTER_SCRIPTS / "up.sh")], env=slurm_cluster.env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        revived = True
        state = wait_job_end(job_id, run_dir, timeout=END_TIMEOUT_S)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        if not revived:
            subprocess.run(["bash", str(CLUSTER_SCRIPTS / "up.sh")], env=slurm_cluster.env, capture_output=True,
                           timeout=300)  # fmt: skip

    log = job_log(files.run_dir).read_text()
    print(f"pending after the kill: {pending}\n{log_tail(run_dir, 80)}")
    assert state.state == "COMPLETED" and state.restarts is not None and state.restarts >= 1, f"{state}\n{log}"
    assert f"resumed from {store.step_dir(committed.step)} (step {committed.step}," in log, log[-6000:]
    assert files.finished.is_file() and not files.stopped.exists()
    ours, ref = history(run_dir), history(ref_dir)
    assert [h["step"] for h in ours] == list(range(1, STEPS + 1))  # each step once: the history continues
    assert ours == ref, next(f"step {a['step']}: {a} != {b}" for a, b in zip(ours, ref) if a != b)
