"""The experiment command end to end (``--quick``, one subprocess): trains the kv-cache job set, writes the
report, table and plot from those runs; a rerun after one job file changed retrains that job only and reuses
the other.
Also: every experiment job file parses, and the registry names exactly the job sets that exist."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from elastic_pretrain.config import ConfigError, load_yaml
from elastic_pretrain.experiments.runner import base_job, fingerprint, job_diff, load_jobs
from elastic_pretrain.job import dump_job, load_job
from tests.conftest import REPO

JOB_FILES = sorted((REPO / "jobs/experiments").glob("*/*.yaml"))

# Runs in a fresh process (the trainer owns the process group and tears it down): the command twice,
# a job file edited in between, then an independent evaluation of one checkpoint.
CYCLE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from elastic_pretrain.cli import main

    def mtimes():
        runs = Path("runs/experiments-quick/kv-cache")
        return {p.parent.name: p.stat().st_mtime_ns for p in runs.glob("*/summary.json")}

    if __name__ == "__main__":
        out = {}
        assert main(["experiment", "kv-cache", "--quick"]) == 0
        out["first"] = mtimes()
        job = Path("jobs/experiments/kv-cache/late-switch.yaml")
        job.write_text(job.read_text().replace("lr: 3.0e-3", "lr: 2.0e-3"))
        assert main(["experiment", "kv-cache", "--quick"]) == 0
        out["third"] = mtimes()
        # the number the report shows, measured here independently from the checkpoint
        import torch
        from elastic_pretrain.data.loader import load_validation
        from elastic_pretrain.checkpoint.tensors import load_model
        from elastic_pretrain.model.inference import teacher_forced_loss
        from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
        init_mesh(ParallelConfig(), seed=0)
        job, model = load_model(Path("runs/experiments-quick/kv-cache/fixed-depth"))
        tokens = load_validation(job.data, num_sequences=2)[:, :33]  # --quick: 2 x 32 predicted tokens
        out["per_loop"] = teacher_forced_loss(model, tokens, loops=4, kv_cache="per-loop").loss
        teardown()
        print("CYCLE " + json.dumps(out))
    """
)


@pytest.mark.slow
def test_quick_experiment_reports_reuses_and_retrains(tmp_path: Path) -> None:
    # a private copy of the repository's declarative side, so that editing a job file touches nothing here
    for folder in ("data", "parallel"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    shutil.copytree(REPO / "jobs/experiments/kv-cache", tmp_path / "jobs/experiments/kv-cache")
    if not (REPO / "cache/stdlib-code/manifest.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "elastic_pretrain.cli", "prepare-data", "stdlib-code"],
            cwd=REPO,
            check=True,
            capture_output=True,
            timeout=300,
        )
    (tmp_path / "cache").symlink_to(REPO / "cache")
    (tmp_path / "cycle.py").write_text(CYCLE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "cycle.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    cycle = json.loads(proc.stdout.split("CYCLE ", 1)[1])

    # reuse when unchanged, retrain only the job whose file changed
    assert set(cycle["first"]) == {"fixed-depth", "late-switch"}
    assert cycle["third"]["fixed-depth"] == cycle["first"]["fixed-depth"]
    assert cycle["third"]["late-switch"] > cycle["first"]["late-switch"]
    assert proc.stdout.count("fixed-depth: reused") == 1 and "late-switch: reused" not in proc.stdout
    assert proc.stdout.count("late-switch: trained") == 2

    results = tmp_path / "runs/experiments-quick/results"
    report = (results / "kv-cache.md").read_text()
    numbers = json.loads((results / "kv-cache.json").read_text())
    assert "elastic-pretrain experiment kv-cache --quick" in report and "Seed** 1234" in report
    assert (results / "kv-cache.png").read_bytes()[:4] == b"\x89PNG"
    # the table's numbers are the runs': steps and tokens from summary.json, losses from the checkpoint
    for run in numbers["runs"]:
        summary = json.loads((tmp_path / run["run_dir"] / "summary.json").read_text())
        assert (run["steps"], run["tokens"]) == (summary["steps"], summary["tokens"]) == (2, 4096)
        assert f"| {run['job']} | `{run['file']}` | {run['parameters']:,} |" in report
    assert f"| fixed-depth | 4 | 3,072 | 1,536 | {cycle['per_loop']:.4f} | " in report
    assert numbers["teacher_forced"]["fixed-depth"]["4"]["per-loop"]["loss"] == pytest.approx(cycle["per_loop"])
    lr = json.loads((tmp_path / "runs/experiments-quick/kv-cache/late-switch/summary.json").read_text())
    assert (
        lr["steps"] == 2
        and "lr: 0.002" in (tmp_path / "runs/experiments-quick/kv-cache/late-switch/config.yaml").read_text()
    )


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_experiment_job_files_parse(path: Path) -> None:
    base = base_job(path)
    if base is not None:  # post-trains a job of its set: loads once that job has a run (the runner does it)
        with pytest.raises(ConfigError, match=r"decider.init_from: .*\.yaml is a job file .*decider.init_from=runs/"):
            load_job(path)
        path = path.with_name(f"{base}.yaml")
        assert base_job(path) is None
    job = load_job(path)
    assert job.parallel.tensor == job.parallel.expert == 1 and job.tracking.backend == "none"


def test_registry_matches_job_sets_and_jobs_of_a_set_share_tokens_and_seed() -> None:
    from elastic_pretrain.experiments.registry import EXPERIMENTS

    sets = {p.parent.name for p in JOB_FILES}
    assert set(EXPERIMENTS) == sets
    for path in filter(base_job, JOB_FILES):  # a post-training job trains on its base's tokens, in their order
        base = load_yaml(path.with_name(f"{base_job(path)}.yaml"))
        assert {k: load_yaml(path)[k] for k in ("data", "train")} == {k: base[k] for k in ("data", "train")}
    for name in sets:
        jobs = [load_job(p) for p in JOB_FILES if p.parent.name == name and base_job(p) is None]
        assert len({(j.train.steps, j.tokens_per_step, j.data.shuffle_seed) for j in jobs}) == 1
        differing = {k for k in job_diff(jobs) if k.startswith(("data.", "train."))}
        assert differing == set(EXPERIMENTS[name].varies), name


def test_a_post_training_job_loads_after_its_base(tmp_path: Path) -> None:
    # the decider set: the base first (loaded now), the decider job after it (loaded once the base has a run)
    jobs = load_jobs("decider", tmp_path, [], jobs_dir=REPO / "jobs/experiments")
    assert [(p.name, j is None) for p, j in jobs] == [("late-switch.yaml", False), ("decider.yaml", True)]
    assert jobs[0][1] is not None and jobs[0][1].run_path == tmp_path / "decider/late-switch"
    bad = tmp_path / "jobs/bad"
    bad.mkdir(parents=True)
    (bad / "a.yaml").write_text("decider:\n  init_from: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"a.yaml: decider.init_from: nope.yaml is not a job of .*bad/"):
        load_jobs("bad", tmp_path, [], jobs_dir=tmp_path / "jobs")


def test_fingerprint_ignores_the_run_name_only() -> None:
    a = load_job(REPO / "jobs/experiments/kv-cache/late-switch.yaml", ["name=a", "run_dir=/x"])
    b = load_job(REPO / "jobs/experiments/route-replay/replay-off.yaml", ["name=b", "run_dir=/y"])
    c = load_job(REPO / "jobs/experiments/route-replay/replay-on.yaml")
    from elastic_pretrain.experiments.runner import job_fingerprint

    assert job_fingerprint(a) == job_fingerprint(b) != job_fingerprint(c)
    assert fingerprint({"name": "x", "train": {"lr": 1}}) == fingerprint({"name": "y", "train": {"lr": 1}})


def test_a_run_from_before_a_config_field_existed_is_reused(tmp_path: Path) -> None:
    from elastic_pretrain.experiments.runner import job_fingerprint, run_fingerprint

    job = load_job(REPO / "jobs/experiments/kv-cache/late-switch.yaml")
    old = yaml.safe_load(dump_job(job))
    del old["decider"]  # a run trained before the decider section existed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert run_fingerprint(tmp_path) == job_fingerprint(job)
    old["train"]["lr"] = 1.0
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert run_fingerprint(tmp_path) != job_fingerprint(job)
    old["removed_key"] = 1  # no longer builds: compared as written, never equal
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert run_fingerprint(tmp_path) not in (None, job_fingerprint(job))


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from elastic_pretrain.cli import main

    assert main(["experiment", "nope"]) == 2
    assert "unknown experiment 'nope' (known: exit-schedules" in capsys.readouterr().err
    assert main(["experiment", "kv-cache", "--quick", "modle.loops=2"]) == 2
    assert "unknown key 'modle'" in capsys.readouterr().err
    assert main(["experiment", "--list"]) == 0 and "route-replay" in capsys.readouterr().out
