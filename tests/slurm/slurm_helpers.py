"""Helpers of the Slurm tests: submit the stand-in trainer, bounded waits, expected results."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from elastic_pretrain.launch.config import SlurmConfig
from elastic_pretrain.launch.layout import last_committed_step
from elastic_pretrain.launch.render import LaunchSpec
from elastic_pretrain.launch.slurm import JobState, query_job, submit
from elastic_pretrain.rundir import RunFiles

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CLUSTER_SCRIPTS = REPO / "slurm" / "local-cluster"
FAKE_TRAINER = HERE / "fake_trainer.py"
# The test cluster: jobs run on node1+node2 (CPUs declared for several 2-node jobs side by side);
# node3+node4 are kept for the partition-preemption test, whose preemptor takes all their CPUs.
CLUSTER_NODES = 4
CPUS_PER_NODE = 8
MAIN_NODES = "node[1-2]"
PREEMPT_NODES = "node[3-4]"
# Fake-trainer run shape (kept small: every start imports torch 4 times on 2 shared cores).
STEPS = 16
STEP_TIME_S = 0.2
SAVE_EVERY = 3


@dataclasses.dataclass(frozen=True)
class Cluster:
    home: Path
    conf: Path
    env: dict[str, str]


def fake_spec(run_dir: Path, *, steps: int = STEPS, hold_at: int = 0, extra: tuple[str, ...] = ()) -> LaunchSpec:
    """A launch of the stand-in trainer (instead of ``-m elastic_pretrain.cli train``)."""
    trainer = [str(FAKE_TRAINER), "--run-dir", str(run_dir), "--steps", str(steps), "--hold-at", str(hold_at)]
    trainer += ["--step-time", str(STEP_TIME_S), "--save-every", str(SAVE_EVERY), *extra]
    return LaunchSpec(job_name=f"fake-{run_dir.name}", run_dir=run_dir, workdir=REPO, trainer=trainer)


def submit_fake(
    run_dir: Path,
    *,
    steps: int = STEPS,
    hold_at: int = 0,
    extra: tuple[str, ...] = (),
    nodelist: str = MAIN_NODES,
    **slurm: object,
) -> str:
    """Submit the stand-in trainer on 2 nodes; ``slurm`` overrides SlurmConfig fields."""
    fields: dict[str, object] = {"nodes": 2, "retries": 1, "python": sys.executable, **slurm}
    fields["sbatch_args"] = [f"--nodelist={nodelist}"]
    cfg = SlurmConfig(**fields)  # type: ignore[arg-type]
    return submit(cfg, fake_spec(run_dir, steps=steps, hold_at=hold_at, extra=extra))


def expected_value(steps: int = STEPS, world: int = 2) -> float:
    """The fake trainer's final value for an uninterrupted run (same float64 arithmetic)."""
    value = 0.0
    for step in range(1, steps + 1):
        value = value / 2 + float(step * world * (world + 1) // 2)
    return value


def tiny_data(site: Path) -> str:
    """A small corpus prepared into ``site``/cache/tiny, as the data recipe ``site``/data/tiny.yaml (paths relative
    to ``site``, the submit directory): submit checks that a job's shards exist (launch/preflight.py)."""
    from elastic_pretrain.data.prepare import prepare_data
    from tests.data.conftest import recipe, write_corpus

    prepare_data(recipe(site / "cache" / "tiny", [str(write_corpus(site / "corpus"))]), progress=False)
    (site / "data" / "tiny.yaml").write_text(
        "format: mds\nseq_len: 16\nstreams: [{path: cache/tiny}]\nvalidation: {path: cache/tiny, split: val}\n"
    )
    return "tiny"


def job_log(run_dir: Path) -> Path:
    """The log of the run's latest job (``slurm/train-<job id>.log``; submit records the id before sbatch runs it)."""
    files = RunFiles(run_dir)
    return files.job_log(files.job_id.read_text().strip())


def log_tail(run_dir: Path, lines: int = 40) -> str:
    log = job_log(run_dir)
    text = log.read_text(errors="replace") if log.exists() else "(no log yet)"
    return "\n".join(text.splitlines()[-lines:])


def wait_for(check: Callable[[], bool], *, timeout: float, what: str, run_dir: Path, job_id: str) -> None:
    """Poll ``check`` until it holds; on timeout cancel the job and fail with its log."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            state = query_job(job_id)
            subprocess.run(["scancel", job_id], capture_output=True)
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; job {state}\n{log_tail(run_dir)}")
        time.sleep(0.3)


def wait_job_end(job_id: str, run_dir: Path, *, timeout: float) -> JobState:
    """Wait (bounded) until the job has ended for good (requeued restarts count as still alive)."""
    final: list[JobState] = []

    def ended() -> bool:
        state = query_job(job_id)
        if state is not None and not state.live:
            final.append(state)
            return True
        return False

    wait_for(ended, timeout=timeout, what=f"job {job_id} to end", run_dir=run_dir, job_id=job_id)
    return final[-1]


def wait_holding(job_id: str, run_dir: Path, *, timeout: float) -> None:
    """Wait until the stand-in trainer (``hold_at``) waits mid-run for a signal."""
    wait_for((run_dir / "holding").exists, timeout=timeout, what="the trainer to hold mid-run", run_dir=run_dir,
             job_id=job_id)  # fmt: skip


def wait_checkpoint(job_id: str, run_dir: Path, *, step: int, timeout: float) -> None:
    """Wait until the run has committed a checkpoint at ``step`` or later (the trainer is mid-run)."""
    files = RunFiles(run_dir)
    wait_for(
        lambda: (last_committed_step(files) or 0) >= step,
        timeout=timeout,
        what=f"a checkpoint at step >= {step}",
        run_dir=run_dir,
        job_id=job_id,
    )
