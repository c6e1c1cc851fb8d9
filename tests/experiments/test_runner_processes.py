"""The experiment runner trains a job with ``slurm.nproc_per_node: N`` in N local processes (issue 19 item 4):
through the launcher of ``train --nproc-per-node`` (2 gloo ranks, EP = 2, ``--quick``: 2 steps), and a rerun
reuses that run; a layout that does not fit N processes is refused in one line before anything trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_pretrain.config import ConfigError
from elastic_pretrain.experiments.runner import (
    QUICK_OVERRIDES,
    ensure_trained,
    job_fingerprint,
    load_jobs,
    processes,
    run_fingerprint,
)
from tests.conftest import REPO

JOBS = REPO / "jobs/experiments"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_with_nproc_2_trains_in_two_processes_and_is_reused(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(REPO)  # the data preset's cache/ and parallel/ presets
    jobs = load_jobs("samplers-ep2", tmp_path, [*QUICK_OVERRIDES], jobs_dir=JOBS, seeds="1")
    path, _, job = next(j for j in jobs if j[0].stem == "expert-group")
    assert job is not None and processes(job) == 2 and job.parallel.expert == 2
    run = ensure_trained(path, job, tmp_path)
    assert run.status == "trained" and "expert-group: trained in" in capsys.readouterr().out
    summary = json.loads((run.run_dir / "summary.json").read_text())
    # two ranks, data-parallel 2 and expert-parallel 2: one process could not have written this layout
    assert summary["layout"] == {"world_size": 2, "tp": 1, "ep": 2, "pp": 1, "dp": 2, "device": "cpu"}
    assert summary["steps"] == 2 and summary["tokens"] == 2 * job.tokens_per_step
    assert summary["depth_efficiency"] == 1.0  # expert_group: both replicas of the EP group agree on ℓ
    # the ranks trained exactly the resolved job (seed, overrides, run directory): a rerun finds and reuses it
    assert run_fingerprint(run.run_dir) == job_fingerprint(job)
    again = ensure_trained(path, job, tmp_path)
    assert again.status == "reused" and again.run_dir == run.run_dir


def test_a_layout_that_does_not_fit_its_processes_is_refused_in_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    folder = tmp_path / "jobs" / "bad"
    folder.mkdir(parents=True)
    text = (JOBS / "samplers-ep2/expert-group.yaml").read_text()
    (folder / "one.yaml").write_text(text.replace("nproc_per_node: 2", "nproc_per_node: 3"))
    with pytest.raises(ConfigError, match=r"one\.yaml: at 3 process\(es\) \(slurm\.nproc_per_node: 3\): .*expert"):
        load_jobs("bad", tmp_path, [], jobs_dir=tmp_path / "jobs")
    # a single-process job with expert parallelism: the runner no longer assumes one process, it checks
    (folder / "one.yaml").write_text(text.replace("nproc_per_node: 2", "nproc_per_node: 1"))
    with pytest.raises(ConfigError, match=r"at 1 process\(es\)"):
        load_jobs("bad", tmp_path, [], jobs_dir=tmp_path / "jobs")
