"""``elastic-pretrain submit | status | cancel`` without a cluster: flags, dry runs, errors, run-dir files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from slurm_helpers import tiny_data

from elastic_pretrain import cli
from elastic_pretrain.checkpoint.store import CheckpointStore
from elastic_pretrain.errors import UserError
from elastic_pretrain.launch.layout import last_committed_step
from elastic_pretrain.launch.slurm import check_can_submit, explain_sbatch_error
from elastic_pretrain.rundir import RunFiles

REPO = Path(__file__).resolve().parents[2]
# The default job without its name, on a small prepared corpus (submit validates the whole job and checks its
# data before calling sbatch).
BASE = "".join(
    line
    for line in (REPO / "jobs" / "tiny-cpu.yaml")
    .read_text()
    .replace("data: stdlib-code", "data: tiny")
    .splitlines(True)
    if not line.startswith("name:")
)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for preset in ("parallel", "data"):
        shutil.copytree(REPO / preset, tmp_path / preset)
    tiny_data(tmp_path)
    path = tmp_path / "jobs" / "tiny job.yaml"
    path.parent.mkdir()
    path.write_text(BASE + "name: tiny\nslurm:\n  nodes: 2\n  retries: 5\n  partition: cpu\n")
    return path


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_prints_the_script_and_writes_nothing(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["submit", str(job), "train.steps=70", "--nodes", "4", "--time", "30", "--dry-run"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    run_dir = Path.cwd() / "runs" / "tiny"  # default: runs/<name> under the working directory
    assert "#SBATCH --nodes=4" in out and "#SBATCH --partition=cpu" in out and "#SBATCH --time=30" in out
    assert "RETRIES=5" in out  # from the YAML's slurm: section; flags override it key by key
    # the job as submitted (overrides applied), snapshotted into the run: what every (re)start trains
    assert f"TRAINER=(-m elastic_pretrain.cli train {run_dir}/slurm/job.yaml --run-dir {run_dir})" in out
    assert "dry run" in err and not run_dir.exists()


def test_run_dir_from_flag_or_yaml(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["submit", str(job), "--run-dir", "elsewhere/r 1", "--dry-run"], capsys)
    assert code == 0 and f"RUN_DIR='{Path.cwd() / 'elsewhere' / 'r 1'}'" in out
    job.write_text(BASE + "run_dir: /scratch/x\n")  # no slurm section: --nodes 2 for the EP=2 mesh
    code, out, _ = run_cli(["submit", str(job), "--dry-run", "--nodes", "2"], capsys)
    assert code == 0 and "RUN_DIR=/scratch/x" in out and '#SBATCH --job-name="tiny job"' in out


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--nodes", "0"], "slurm.nodes must be >= 1 (got 0): pass --nodes N"),
        (["--time", "1:2:3:4"], "slurm.time (--time): '1:2:3:4' is not a Slurm time limit"),
        (["--signal", "HUP"], "slurm.signal: 'HUP' is not supported"),
        (["--time", "5", "--signal-lead", "600"], "lower --signal-lead or raise --time"),
        (["slurm.nodez=2"], "unknown key 'slurm.nodez': did you mean 'slurm.nodes'?"),
    ],
)
def test_bad_options_are_one_line_errors(
    job: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    code, _, err = run_cli(["submit", str(job), *flags, "--dry-run"], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_missing_job_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["submit", str(tmp_path / "nope.yaml"), "--dry-run"], capsys)
    assert code == 2 and "no such file" in err


def test_submit_without_slurm_says_where_to_run(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, _, err = run_cli(["submit", str(job)], capsys)
    assert code == 2 and "sbatch not found: run this where Slurm's commands are installed" in err
    assert len(err.strip().splitlines()) == 1


def commit(files: RunFiles, step: int) -> None:
    """A committed checkpoint as the trainer leaves it (marker, rename, ``latest``)."""
    store = CheckpointStore(files.checkpoints)
    tmp = store.prepare(step)
    (tmp / "trainer.json").write_text("{}")
    store.commit(step, {})


def test_status_of_a_run_dir_without_slurm_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = RunFiles(tmp_path)
    commit(files, 40)
    files.mlflow_run_id.write_text("0123456789abcdef0123456789abcdef\n")
    code, out, _ = run_cli(["status", str(tmp_path)], capsys)
    assert code == 0
    assert "no job submitted from here" in out and "last step:  40" in out and "0123456789abcdef0123456789abcdef" in out
    code, _, err = run_cli(["status", str(tmp_path / "missing")], capsys)
    assert code == 2 and "no such run directory" in err
    code, _, err = run_cli(["cancel", str(tmp_path)], capsys)
    assert code == 2 and "no Slurm job recorded" in err


def test_last_step_is_the_newest_committed_even_when_latest_is_stale(tmp_path: Path) -> None:
    """``status`` reports what a resumed run continues from: a stale ``latest`` (naming a missing or an
    uncommitted step, or an older one after a crash before its update) is not trusted."""
    files = RunFiles(tmp_path)
    assert last_committed_step(files) is None
    commit(files, 12)
    commit(files, 9)  # latest now names step_9, but step_12 is the newest commit
    assert last_committed_step(files) == 12
    files.latest.write_text("step_40\n")  # missing
    assert last_committed_step(files) == 12
    (files.checkpoints / "step_50").mkdir()  # a save that never committed
    files.latest.write_text("step_50\n")
    assert last_committed_step(files) == 12
    files.latest.unlink()
    assert last_committed_step(files) == 12
    shutil.rmtree(files.checkpoints / "step_12")
    assert last_committed_step(files) == 9


def test_status_warns_about_a_stale_latest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = RunFiles(tmp_path)
    commit(files, 12)
    code, out, _ = run_cli(["status", str(tmp_path)], capsys)
    assert code == 0 and "warning" not in out
    files.latest.write_text("step_40\n")  # names a checkpoint that does not exist
    code, out, _ = run_cli(["status", str(tmp_path)], capsys)
    assert code == 0 and "last step:  12" in out
    assert "warning:    latest names step_40, which does not exist; the newest committed checkpoint is step_12" in out
    code, out, _ = run_cli(["status", "--json", str(tmp_path)], capsys)
    assert "step_40" in json.loads(out)["latest_problem"]


def test_finished_run_is_not_resubmitted(tmp_path: Path) -> None:
    RunFiles(tmp_path).finished.write_text("{}")
    with pytest.raises(UserError, match="has finished training"):
        check_can_submit(RunFiles(tmp_path))


@pytest.mark.parametrize(
    ("stderr", "needle"),
    [
        ("sbatch: error: invalid partition specified: gpu\nsbatch: error: Batch job submission failed: "
         "Invalid partition name specified", "Invalid partition name specified: check --partition"),
        ("sbatch: error: Batch job submission failed: Node count specification invalid", "lower --nodes"),
        ("sbatch: error: Invalid --time specification", "check --time"),
        ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
         "check --account"),
        ("sbatch: error: fetch_config: DNS SRV lookup failed\nsbatch: error: _establish_config_source: failed to "
         "fetch config\nsbatch: fatal: Could not establish a configuration source", "cannot reach a Slurm cluster"),
        ("sbatch: error: Something new", "Something new: fix the Slurm option it names"),
        ("sbatch: unrecognized option '--jobid=4321'\nTry \"sbatch --help\" for more information",
         "sbatch: unrecognized option '--jobid=4321': fix or remove that option (slurm.sbatch_args)"),
    ],
)  # fmt: skip
def test_sbatch_errors_name_the_fix(stderr: str, needle: str) -> None:
    message = explain_sbatch_error(stderr)
    assert needle in message and "\n" not in message


def test_submit_shows_sbatchs_own_error_line(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An sbatch that rejects an option (injected: a stand-in sbatch printing what sbatch 23 prints)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        "#!/bin/sh\necho \"sbatch: unrecognized option '--jobid=4321'\" >&2\n"
        "echo 'Try \"sbatch --help\" for more information' >&2\nexit 1\n"
    )
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    code, _, err = run_cli(["submit", str(job), "slurm.sbatch_args=[--jobid=4321]"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "sbatch: unrecognized option '--jobid=4321'" in err and "--help" not in err
