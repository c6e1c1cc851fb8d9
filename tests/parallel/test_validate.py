"""Layout checks without a cluster (parallel/validate.py): every shipped job at its intended world size,
and each divisibility rule refused with one line that names the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_pretrain.config import ConfigError, load_yaml, to_dict
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.parallel.memory import estimate_memory
from elastic_pretrain.parallel.validate import check_layout, check_memory
from tests.conftest import REPO

JOBS = sorted(p.relative_to(REPO) for p in (REPO / "jobs").rglob("*.yaml"))
GPU_JOBS = {"jobs/gpu-1node.yaml": 8, "jobs/gpu-2node.yaml": 16, "jobs/gpu-16node.yaml": 128}


def intended_world_size(job) -> int:
    """GPU jobs: their Slurm allocation (nodes x GPUs); CPU jobs: the smallest world their mesh takes
    (tiny-cpu: 2, as README's --nproc-per-node 2)."""
    if job.slurm.gpus_per_node:
        return job.slurm.nodes * job.slurm.procs_per_node
    return job.parallel.tensor * job.parallel.pipeline * job.parallel.expert


@pytest.mark.parametrize("path", [str(p) for p in JOBS])
def test_every_shipped_job_validates(path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(REPO)
    overrides = []
    if "decider" in load_yaml(REPO / path):  # a decider job reads its base checkpoint's trainer.json
        base = tmp_path / "base" / "step_1"
        base.mkdir(parents=True)
        meta = {"config": to_dict(load_job(REPO / "jobs/tiny-cpu.yaml")), "controller": {"phase": "mixed"}}
        (base / "trainer.json").write_text(json.dumps(meta))
        overrides.append(f"decider.init_from={base}")
    job = load_job(REPO / path, overrides)
    world = intended_world_size(job)
    if path in GPU_JOBS:
        assert world == GPU_JOBS[path]
    layout = check_layout(job, world)
    assert layout.tensor * layout.pipeline * layout.data == world
    line = check_memory(job, world, job.slurm.gpu_memory_bytes)  # GPU jobs: within 90% of their GPUs
    assert line.startswith("memory per rank: ")
    if path in GPU_JOBS:
        assert job.slurm.gpu_memory and "of 80.0 GiB per GPU" in line


def test_gpu_jobs_are_all_checked() -> None:
    assert set(GPU_JOBS) <= {str(p) for p in JOBS}


def tiny(*overrides: str):
    return load_job(REPO / "jobs" / "tiny-cpu.yaml", list(overrides))


@pytest.mark.parametrize(
    ("world", "overrides", "message"),
    [
        (3, [], r"parallel.expert=2 does not divide tensor\*data = 3 \(world size 3\)"),
        (5, ["parallel.tensor=2"], r"world size 5 is not divisible by tensor\*pipeline = 2"),
        (3, ["parallel.tensor=3", "parallel.expert=1"], r"parallel.tensor=3 does not divide the vocabulary padding"),
        (8, ["parallel.tensor=8", "parallel.expert=1"], r"parallel.tensor=8 does not divide model.num_heads=4"),
        (
            4,
            ["parallel.tensor=4", "parallel.expert=1", "model.num_heads=8", "model.num_query_groups=2"],
            r"parallel.tensor=4 does not divide model.num_query_groups \(key/value heads\)=2",
        ),
        (
            4,
            ["parallel.tensor=4", "parallel.expert=1", "model.ffn_hidden_size=250"],
            r"parallel.tensor=4 does not divide model.ffn_hidden_size=250",
        ),
        (16, ["parallel.expert=16"], r"parallel.expert=16 does not divide the experts built \(8 = model.num_experts 4"),
        (
            4,
            ["parallel.pipeline=2", "parallel.expert=1", "model.flatten=2"],
            r"parallel.pipeline=2 must divide the core layers built \(1",
        ),
        (
            4,
            [
                "parallel.pipeline=4",
                "parallel.expert=1",
                "model.core_layers=4",
                "model.flatten=1",
                "train.global_batch_size=12",
                "train.micro_batch_size=4",
            ],
            r"parallel.pipeline=4 needs at least 4 micro-batches per step and replica, got 3",
        ),
        (
            4,
            ["train.global_batch_size=24"],
            r"train.global_batch_size=24 is not divisible by micro_batch_size\*data_parallel = 4\*4",
        ),
        (6, ["parallel.expert=1", "train.global_batch_size=20"], r"make it a multiple of 24"),
        (4, ["parallel.tensor=2", "parallel.sequence_parallel='off'"], r"sequence_parallel=off with parallel.tensor=2"),
        (2, ["parallel.sequence_parallel='on'"], r"sequence_parallel=on with parallel.tensor=1 splits nothing"),
        (
            4,
            ["parallel.tensor=4", "parallel.expert=1", "data.seq_len=130"],
            r"data.seq_len=130 is not divisible by parallel.tensor=4",
        ),
        (2, ["model.vocab_size=200"], r"model.vocab_size=200 is smaller than the tokenizer's vocabulary 257"),
    ],
)
def test_each_rule_is_one_line_naming_the_fix(world: int, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        check_layout(tiny(*overrides), world)
    assert "\n" not in str(err.value)


def test_a_good_layout_is_described() -> None:
    layout = check_layout(tiny("parallel.tensor=2"), 8)
    assert (layout.tensor, layout.data, layout.expert, layout.expert_data) == (2, 4, 2, 4)
    assert layout.sequence_parallel and layout.micro_batches == 1 and layout.padded_vocab == 384


def test_config_command_checks_the_world_size() -> None:
    """`elastic-pretrain config JOB --world-size N`: a loadable YAML with the layout as comments, or exit 2."""
    cli = [sys.executable, "-m", "elastic_pretrain.cli", "config"]
    ok = subprocess.run([*cli, "jobs/gpu-16node.yaml", "--world-size", "128"], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "# layout: world 128 = TP 1 x PP 1 x DP 128; EP 8" in ok.stdout
    assert "# parameters: 5.16 B total, 1.01 B active" in ok.stdout
    bad = subprocess.run(
        [*cli, "jobs/gpu-16node.yaml", "--world-size", "100"], cwd=REPO, capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "parallel.expert=8 does not divide" in bad.stderr


@pytest.mark.parametrize(
    ("gpu_memory", "fix"),
    [
        ("30GiB", "set train.micro_batch_size=1"),
        ("24GiB", "set train.recompute=pass"),
        ("12GiB", "shard more (raise parallel.tensor or parallel.expert)"),
    ],
)
def test_memory_over_the_gpu_names_a_setting_that_fits(gpu_memory: str, fix: str) -> None:
    job = load_job(REPO / "jobs" / "gpu-16node.yaml", [f"slurm.gpu_memory={gpu_memory}"])
    with pytest.raises(ConfigError, match=r"memory estimate 42.6 GiB per rank at ℓ = L_max = 4, micro-batch 2") as err:
        check_memory(job, 128, job.slurm.gpu_memory_bytes)
    assert str(err.value).endswith(fix) or fix in str(err.value)
    if "micro_batch_size=1" in fix:  # the advice works
        smaller = load_job(
            REPO / "jobs" / "gpu-16node.yaml", [f"slurm.gpu_memory={gpu_memory}", "train.micro_batch_size=1"]
        )
        check_memory(smaller, 128, smaller.slurm.gpu_memory_bytes)
        assert estimate_memory(smaller, 128).peak("none") < 0.9 * smaller.slurm.gpu_memory_bytes


def test_bad_gpu_memory_is_refused_when_the_job_loads() -> None:
    with pytest.raises(ConfigError, match=r"slurm\.gpu_memory: cannot read 'lots'"):
        load_job(REPO / "jobs" / "gpu-16node.yaml", ["slurm.gpu_memory=lots"])


@pytest.mark.parametrize(
    ("preset", "job", "world"),
    [
        ("gpu-8", "gpu-1node", 8),
        ("gpu-node-tp2-ep4", "gpu-1node", 8),
        ("gpu-16", "gpu-2node", 16),
        ("gpu-128", "gpu-16node", 128),
    ],
)
def test_every_gpu_mesh_preset_takes_a_shipped_model(preset: str, job: str, world: int) -> None:
    cfg = load_job(REPO / "jobs" / f"{job}.yaml", [f"parallel={preset}"])
    check_layout(cfg, world)
    check_memory(cfg, world, cfg.slurm.gpu_memory_bytes)


def test_every_gpu_preset_is_covered() -> None:
    covered = {"gpu-8", "gpu-node-tp2-ep4", "gpu-16", "gpu-128"}
    assert {p.stem for p in (REPO / "parallel").glob("gpu-*.yaml")} == covered
