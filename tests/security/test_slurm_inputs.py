"""Hostile run directories and Slurm options (issue #13, cases 11, 12 and 13), without a cluster:
``status``/``cancel`` never hand a crafted job id to Slurm, ``submit`` refuses what would only fail on
the nodes, and the trainer a batch script starts writes where the script looks."""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest

from elastic_pretrain import cli
from elastic_pretrain.rundir import RunFiles
from tests.slurm.slurm_helpers import tiny_data

REPO = Path(__file__).resolve().parents[2]
BASE = "".join(
    line for line in (REPO / "jobs" / "tiny-cpu.yaml").read_text().splitlines(True) if not line.startswith("name:")
)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for preset in ("parallel", "data"):
        shutil.copytree(REPO / preset, tmp_path / preset)
    path = tmp_path / "jobs" / "tiny.yaml"
    path.parent.mkdir()
    data = tiny_data(tmp_path)  # submit's pre-flight checks that the job's shards exist
    path.write_text(BASE.replace("data: stdlib-code", f"data: {data}") + "name: tiny\nslurm:\n  nodes: 2\n")
    return path


@pytest.fixture
def slurm_spy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """squeue/sacct/scancel on PATH that only record their arguments: proof that none was called."""
    bin_dir, log = tmp_path / "spy-bin", tmp_path / "slurm-calls.log"
    bin_dir.mkdir()
    for name in ("squeue", "sacct", "scancel", "sbatch"):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {shlex.quote(str(log))}\nexit 1\n')
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err.strip()


# ------------------------------------------------------------------------------------- case 12
@pytest.mark.parametrize("command", ["status", "cancel"])
@pytest.mark.parametrize("crafted", ["--user=root", "1 --signal=KILL", "-h"])
def test_crafted_job_id_never_reaches_slurm(
    tmp_path: Path, slurm_spy: Path, capsys: pytest.CaptureFixture[str], command: str, crafted: str
) -> None:
    files = RunFiles(tmp_path / "shared-run")
    files.slurm_dir.mkdir(parents=True)
    files.job_id.write_text(crafted + "\n")
    code, _, err = run_cli([command, str(files.run_dir)], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{files.job_id}: holds {crafted!r}, not a Slurm job id" in err and "delete the file" in err
    assert not slurm_spy.exists(), slurm_spy.read_text()  # no Slurm command saw it
    assert not files.cancelled.exists()


def test_a_numeric_job_id_is_still_queried(tmp_path: Path, slurm_spy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = RunFiles(tmp_path / "run")
    files.slurm_dir.mkdir(parents=True)
    files.job_id.write_text("4242\n")
    code, out, _ = run_cli(["status", str(files.run_dir)], capsys)
    assert code == 0 and "job 4242" in out
    assert "squeue -h -j 4242" in slurm_spy.read_text()


# ------------------------------------------------------------------------------------- case 13
@pytest.mark.parametrize(
    ("arg", "managed"), [("--outp=/tmp/elsewhere.log", "--output"), ("--no-requeu", "--no-requeue"),
                         ("--open=truncate", "--open-mode"), ("--sig=B:KILL@1", "--signal")],
)  # fmt: skip
def test_abbreviated_managed_sbatch_options_are_refused(
    job: Path, capsys: pytest.CaptureFixture[str], arg: str, managed: str
) -> None:
    job.write_text(BASE + f"name: tiny\nslurm:\n  nodes: 2\n  sbatch_args: [{arg!r}]\n")
    code, _, err = run_cli(["submit", str(job), "--dry-run"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"(sbatch reads it as {managed}) is managed by elastic-pretrain" in err


def test_unmanaged_sbatch_options_still_pass(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sbatch_args = "[--qos=high, --mem=0, --time-min=5, --exclusive]"
    job.write_text(job.read_text() + f"  sbatch_args: {sbatch_args}\n")  # under the fixture's slurm: section
    code, out, err = run_cli(["submit", str(job), "--dry-run"], capsys)
    assert code == 0, err
    assert "#SBATCH --qos=high" in out and "#SBATCH --time-min=5" in out


def test_global_batch_not_divisible_at_the_submitted_world_size(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 24 is a multiple of micro_batch_size 4, but 2 nodes x 2 processes = 4 data-parallel ranks need 16
    argv = ["submit", str(job), "train.global_batch_size=24", "--nodes", "2", "--nproc-per-node", "2", "--dry-run"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "train.global_batch_size=24 is not divisible by micro_batch_size*data_parallel = 4*4" in err
    assert "make it a multiple of 16" in err and "world size 4 = --nodes 2 x 2 process(es) per node" in err
    code, _, err = run_cli([*argv[:3], "--nodes", "1", "--nproc-per-node", "2", "--dry-run"], capsys)
    assert code == 0, err  # 24 / (4 * 2) = 3 micro-batches


def test_global_batch_not_divisible_at_nproc_per_node(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["train", str(job), "train.global_batch_size=24", "--nproc-per-node", "4"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "train.global_batch_size=24 is not divisible" in err and "make it a multiple of 16" in err


# ------------------------------------------------------------------------------------- case 11
@pytest.mark.parametrize("name", ["run #1", "a: b"], ids=["comment", "mapping"])
def test_the_trainer_writes_where_the_batch_script_watches(
    job: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    from elastic_pretrain.train.commands import job_from_args

    code, script, err = run_cli(["submit", str(job), "--run-dir", name, "--dry-run"], capsys)
    assert code == 0, err
    lines = {ln.split("=", 1)[0]: ln.split("=", 1)[1] for ln in script.splitlines() if ln[:1].isupper() and "=" in ln}
    (watched,) = shlex.split(lines["RUN_DIR"])
    trainer = shlex.split(lines["TRAINER"].removeprefix("(").removesuffix(")"))
    assert trainer[:2] == ["-m", "elastic_pretrain.cli"]
    args, extra = cli.build_parser().parse_known_args(trainer[2:])  # what each node's torchrun runs
    assert not extra
    snapshot = Path(args.job)  # the real submit snapshots the job into the run (slurm/job.yaml); a dry run does not
    assert snapshot == Path(watched) / "slurm" / "job.yaml", snapshot
    snapshot.parent.mkdir(parents=True)
    shutil.copy(job, snapshot)
    assert job_from_args(args).run_path == Path(watched) == Path.cwd() / name
