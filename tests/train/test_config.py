"""Job files, presets and overrides: every YAML builds; bad input is one line naming the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_pretrain.config import ConfigError, build, load_yaml, to_dict
from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.job import dump_job
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.parallel.mesh import ParallelConfig
from tests.conftest import REPO, VENV_BIN

JOBS = sorted((REPO / "jobs").glob("*.yaml"))


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_every_job_builds(path, tmp_path):
    overrides = []
    if "decider" in load_yaml(path):  # a decider job reads its base checkpoint's trainer.json (model, phase)
        base = tmp_path / "base" / "step_1"
        base.mkdir(parents=True)
        meta = {"config": to_dict(load_job(REPO / "jobs/tiny-cpu.yaml")), "controller": {"phase": "mixed"}}
        (base / "trainer.json").write_text(json.dumps(meta))
        overrides.append(f"decider.init_from={base}")
    job = load_job(path, overrides)
    assert job.name and job.train.steps > 0
    assert load_job(path, overrides).name == job.name
    dump_job(job)


@pytest.mark.parametrize("path", sorted((REPO / "parallel").glob("*.yaml")), ids=lambda p: p.name)
def test_every_parallel_preset_builds(path):
    assert isinstance(build(ParallelConfig, load_yaml(path)), ParallelConfig)


@pytest.mark.parametrize("path", sorted((REPO / "data").glob("*.yaml")), ids=lambda p: p.name)
def test_every_data_recipe_builds(path):
    assert isinstance(build(DataConfig, load_yaml(path)), DataConfig)


def test_overrides_reach_nested_keys_and_presets():
    job = load_job(REPO / "jobs/tiny-cpu.yaml", ["model.loops=3", "train.lr=1e-3", "parallel=cpu-tp2"])
    assert job.model.loops == 3 and job.train.lr == 1e-3 and job.parallel.tensor == 2
    job = load_job(REPO / "jobs/tiny-cpu.yaml", ["parallel.expert=1"])
    assert job.parallel.expert == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["modle.loops=3"], "unknown key 'modle': did you mean 'model'?"),
        (["model.loops=x"], "model.loops: expected an integer, got 'x'"),
        (["model.flatten=3"], "model.flatten: 3 does not divide core_layers"),
        (["schedule.loops=9"], "schedule.loops=9 is outside [1, 4]"),
        (["schedule.sampler=sometimes"], "schedule.sampler: 'sometimes' is not one of"),
        (["parallel=nope"], "parallel: no preset 'nope' in parallel/"),
        (["train.global_batch_size=0"], "train.global_batch_size: must be >= 1"),
        (["model.loops"], "has no '='"),
    ],
)
def test_bad_values_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_job(REPO / "jobs/tiny-cpu.yaml", overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_malformed_yaml_names_the_line(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: [\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+ is not valid YAML"):
        load_job(bad)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "jobs/tiny-cpu.yaml", "modle.loops=3"], "unknown key 'modle'"),
        (["train", "jobs/tiny-cpu.yaml", "schedule.loops=5"], "schedule.loops=5 is outside [1, 4]"),
        (["train", "jobs/missing.yaml"], "jobs/missing.yaml: no such file"),
        (["train"], "the following arguments are required"),
        # issue 33: without a launcher the job runs as one rank; the EP error named no launcher flag
        (
            ["train", "jobs/tiny-cpu.yaml", "train.steps=10", "train.warmup_steps=1"],
            "add --nproc-per-node 2 (this job's smallest world size), or run it as one process with parallel=single",
        ),
        (["train", "jobs/tiny-cpu.yaml", "--nproc-per-node", "0"], "0: give at least 1 process per node"),
        (
            ["train", "jobs/tiny-cpu.yaml", "--nproc-per-node", "2", "--run-dir", "README.md"],
            "run directory README.md exists and is not a directory: pick another --run-dir",
        ),
        (
            ["train", "jobs/tiny-cpu.yaml", "--nproc-per-node", "2", "--run-dir", "README.md/run"],
            "run directory README.md/run: Not a directory",
        ),
        (
            ["train", "jobs/tiny-cpu.yaml", "--nproc-per-node", "2", "model.hidden_size=100"],
            "head dimension 25, which rotary position embeddings need even: use hidden_size 104",
        ),
    ],
)
def test_cli_errors_are_one_line_without_traceback(args, message):
    proc = subprocess.run(
        [str(VENV_BIN / "elastic-pretrain"), *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_command_prints_the_resolved_job():
    proc = subprocess.run(
        [str(VENV_BIN / "elastic-pretrain"), "config", "jobs/tiny-cpu.yaml", "model.loops=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "loops: 3" in proc.stdout and "expert: 2" in proc.stdout


def test_job_validation_does_not_import_torch() -> None:
    """The CLI validates a job before it starts torchrun: that must stay cheap (no torch, no megatron),
    or every launch and every one-line config error pays seconds of imports."""
    code = (
        "import sys; from elastic_pretrain.cli import main; from elastic_pretrain.job_loader import load_job; "
        "load_job('jobs/tiny-cpu.yaml', []); "
        "heavy = [m for m in ('torch', 'megatron') if m in sys.modules]; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
