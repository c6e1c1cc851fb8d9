"""Hostile run roots for ``elastic-pretrain experiment --runs ROOT`` (issue 35 items 7, 8 and 9): a shared
root holds folders made by others. Each test builds the exact input — an alias bomb in a run's
``config.yaml``, a finished run copied in from another folder, a run directory that is a link, a file,
a folder the runner did not write, a FIFO, a ``--runs`` that is a file — and checks that nothing hangs,
nothing is deleted or reused that the runner did not write for this job, and the user gets one line
naming the folder (exit code 2). Nothing here trains: every case is decided before training starts.
The reuse that experiments rely on (kv-cache's late-switch arm is the late-switch set's run) still works."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elastic_pretrain.experiments.runner import QUICK_OVERRIDES, find_reusable, load_jobs
from elastic_pretrain.job import JobConfig, write_resolved
from tests.conftest import REPO

JOBS = REPO / "jobs/experiments"
SEED = 1234


def bomb(levels: int = 9) -> str:
    """'Billion laughs': 10**levels strings once the aliases are expanded, from ~600 bytes."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def job(experiment: str, arm: str, root: Path) -> JobConfig:
    [found] = [j for p, _, j in load_jobs(experiment, root, [*QUICK_OVERRIDES], jobs_dir=JOBS, seeds="1")
               if p.stem == arm]  # fmt: skip
    assert found is not None
    return found


def finished_run(run_dir: Path, config_of: JobConfig | None = None, config: str | None = None) -> Path:
    """A finished run directory as the runner leaves one, its config.yaml that of ``config_of`` (or ``config``)."""
    if config_of is not None:
        write_resolved(config_of, run_dir)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config or "")
    (run_dir / "FINISHED").write_text('{"step": 2, "tokens": 4096}\n')
    (run_dir / "summary.json").write_text(json.dumps({"steps": 2, "tokens": 4096, "elapsed_s": 1.0}))
    return run_dir


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(REPO)  # jobs/experiments and the data presets, as the command runs
    return tmp_path / "shared-runs"


def experiment(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``elastic-pretrain experiment kv-cache --quick --seeds 1 --runs ROOT`` in this process."""
    from elastic_pretrain.cli import main

    code = main(["experiment", "kv-cache", "--quick", "--seeds", "1", "--runs", str(root)])
    return code, capsys.readouterr().err


def one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2 and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), err[-3000:]


@pytest.mark.timeout(120)  # before: expanding the aliases never finished
def test_an_alias_bomb_in_a_run_root_is_not_expanded(root: Path, capsys) -> None:
    late = job("kv-cache", "late-switch", root)
    finished_run(root / "someone" / "run", config=bomb())
    finished_run(root / "late-switch" / f"switch-0.75-seed{SEED}", config=bomb())  # where a shared run would be
    assert find_reusable(late, root) is None
    # in the job's own run directory: refused in one line (it is not the runner's, so it is not deleted either)
    own = finished_run(root / "kv-cache" / f"fixed-depth-seed{SEED}", config=bomb())
    one_line(*experiment(root, capsys), f"{own / 'config.yaml'}: holds more than 100,000 values", "move it out")
    assert (own / "config.yaml").read_text() == bomb()


def test_a_finished_run_of_another_folder_is_not_reused(root: Path) -> None:
    """Same config, but not trained for this experiment and job: a copy elsewhere under the root, or a copy
    planted where another job set's run goes (its config.yaml names kv-cache's run, not that one)."""
    late = job("kv-cache", "late-switch", root)
    finished_run(root / "someone-else" / "copy", config_of=late)  # before: reused (any */*/config.yaml matched)
    assert find_reusable(late, root) is None
    finished_run(root / "late-switch" / f"switch-0.75-seed{SEED}", config_of=late)
    assert find_reusable(late, root) is None


def test_the_late_switch_run_is_shared_by_the_job_sets_that_run_it(root: Path) -> None:
    """Good input: the late-switch set's switch-0.75 run, trained for it, serves kv-cache's late-switch arm
    (same config); kv-cache's own finished run comes first."""
    late = job("kv-cache", "late-switch", root)
    shared = finished_run(
        root / "late-switch" / f"switch-0.75-seed{SEED}", config_of=job("late-switch", "switch-0.75", root)
    )
    assert find_reusable(late, root) == shared
    finished_run(late.run_path, config_of=late)
    assert find_reusable(late, root) == late.run_path
    other_seed = job("kv-cache", "fixed-depth", root)  # another job: its config differs
    assert find_reusable(other_seed, root) is None


def own(root: Path) -> Path:
    return root / "kv-cache" / f"fixed-depth-seed{SEED}"  # the first job the command looks at


def precious(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("not a run\n")
    return folder / "notes.txt"


def test_a_folder_the_runner_did_not_write_is_refused_not_deleted(root: Path, capsys) -> None:
    kept = precious(own(root))  # before: deleted (rmtree) and trained into
    one_line(*experiment(root, capsys), f"{own(root)}: holds no config.yaml", "move it out of --runs")
    assert kept.read_text() == "not a run\n"


def test_another_runs_directory_in_the_place_of_this_one_is_refused_not_deleted(root: Path, capsys) -> None:
    late = job("kv-cache", "late-switch", root)
    kept = precious(finished_run(own(root), config_of=late))  # a copy of late-switch's run under fixed-depth's name
    one_line(*experiment(root, capsys), f"{own(root)}: its config.yaml says it is run 'kv-cache-late-switch-seed1234'")
    assert kept.exists() and (own(root) / "FINISHED").exists()


def test_a_link_or_a_file_as_the_run_directory_is_refused(root: Path, tmp_path: Path, capsys) -> None:
    elsewhere = precious(tmp_path / "elsewhere")
    own(root).parent.mkdir(parents=True)
    own(root).symlink_to(elsewhere.parent)  # before: rmtree raised OSError (a traceback), or training followed it
    one_line(*experiment(root, capsys), f"{own(root)}: a symbolic link where")
    own(root).unlink()
    own(root).write_text("x")
    one_line(*experiment(root, capsys), f"{own(root)}: a file where")
    assert elsewhere.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case, needle",
    [
        ("deep", "config.yaml: line 1 nests lists/mappings more than 64 levels deep"),  # config.load_yaml's bound
        ("fifo", "config.yaml: not a regular file"),
        ("list", "config.yaml: expected a mapping of keys at the top level, got list"),
        ("yaml", "config.yaml: line 2 is not valid YAML"),
        ("huge", "config.yaml: 2,000,000 bytes, more than the 1,048,576 expected"),
        ("summary", "summary.json: not valid JSON"),
        ("summary-list", "summary.json: a JSON list, not an object"),
        ("summary-steps", "summary.json: steps='2' is not a non-negative number"),
    ],
)
def test_a_malformed_run_directory_is_one_line(root: Path, case: str, needle: str, capsys) -> None:
    fixed = job("kv-cache", "fixed-depth", root)
    run = finished_run(own(root), config_of=fixed)
    config, summary = run / "config.yaml", run / "summary.json"
    if case in ("deep", "fifo", "list", "yaml", "huge"):
        config.unlink()
    if case == "deep":
        config.write_text("a: " + "[" * 50_000 + "]" * 50_000 + "\n")
    elif case == "fifo":
        os.mkfifo(config)  # before: reading it waited for a writer forever
    elif case == "list":
        config.write_text("- 1\n- 2\n")
    elif case == "yaml":
        config.write_text("a: [\n")
    elif case == "huge":
        config.write_text("#" * 2_000_000)
    elif case == "summary":
        summary.write_text("{")
    elif case == "summary-list":
        summary.write_text("[]")
    else:
        summary.write_text(json.dumps({"steps": "2", "tokens": 4096, "elapsed_s": 1.0}))
    one_line(*experiment(root, capsys), needle)


def test_runs_that_is_not_a_folder_is_one_line(root: Path, tmp_path: Path, capsys) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("x")
    one_line(*experiment(afile, capsys), f"--runs {afile}: a file, not a folder")
    one_line(*experiment(afile / "below", capsys), f"--runs {afile / 'below'}: Not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes every folder")
def test_runs_that_cannot_be_written_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(REPO)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    one_line(*experiment(locked, capsys), f"--runs {locked}: not writable by you")
