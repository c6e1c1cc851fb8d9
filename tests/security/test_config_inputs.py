"""Hostile job files, overrides and path flags (issue #13, cases 10, 11 and 13): one-line errors at
``config`` time, bounded memory, and paths that reach the trainer exactly as given."""

from __future__ import annotations

import itertools
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_pretrain import cli

REPO = Path(__file__).resolve().parents[2]
JOB = str(REPO / "jobs" / "tiny-cpu.yaml")
MEMORY_LIMIT = 2 << 30  # address space for the child: the bomb's repr alone is ~2.5 GB

# Billion laughs: 9 levels of 9 aliases = 9**9 (387 million) strings once expanded, in 347 bytes.
LEVELS = "abcdefghi"
BOMB = (
    'name: [&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"],\n'
    + ",\n".join(f"  &{cur} [" + ",".join([f"*{prev}"] * 9) + "]" for prev, cur in itertools.pairwise(LEVELS))
    + "]\n"
)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip()


def one_line(err: str) -> bool:
    return len(err.splitlines()) == 1 and "Traceback" not in err


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _config_in_child(*args: str) -> subprocess.CompletedProcess[str]:
    """``elastic-pretrain config`` in a child process with 2 GiB of address space and a time limit."""
    return subprocess.run(
        [sys.executable, "-m", "elastic_pretrain.cli", "config", *args],
        capture_output=True, text=True, timeout=120, preexec_fn=_limit_memory, cwd=REPO,
    )  # fmt: skip


# ------------------------------------------------------------------------------------- case 10
def test_yaml_alias_bomb_in_a_job_file_is_refused_without_expanding_it(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    proc = _config_in_child(str(bomb))
    err = proc.stderr.strip()
    assert proc.returncode == 2 and one_line(err), err[-2000:]
    assert "YAML aliases" in err and "write the values out" in err


def test_yaml_alias_bomb_in_an_override_is_refused(tmp_path: Path) -> None:
    value = BOMB.removeprefix("name: ").replace("\n", " ")
    proc = _config_in_child(JOB, f"name={value}")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and one_line(err), err[-2000:]
    assert "override 'name'" in err and "YAML aliases" in err


def test_values_quoted_in_errors_are_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(["config", JOB, f"name=[{','.join(['x' * 50] * 200)}]"], capsys)
    assert code == 2 and one_line(err) and len(err) < 300, err[:500]
    assert "name: expected a string" in err


# ------------------------------------------------------------------------------------- case 11
@pytest.mark.parametrize("tail", ["run #1", "a: b", "~"], ids=["comment", "mapping", "null"])
def test_path_flags_reach_the_job_as_strings(tmp_path: Path, tail: str) -> None:
    from elastic_pretrain.train.commands import job_from_args

    run_dir, ckpt = tmp_path / tail, tmp_path / "ckpt" / tail
    argv = ["train", JOB, "train.steps=70", "--run-dir", str(run_dir), "--resume-from", str(ckpt)]
    args, extra = cli.build_parser().parse_known_args(argv)
    assert not extra
    job = job_from_args(args)
    assert job.run_path == run_dir and job.checkpoint.resume_from == str(ckpt)
    assert job.train.steps == 70  # ordinary overrides still apply


def test_bare_tilde_run_dir_is_home(tmp_path: Path) -> None:
    from elastic_pretrain.train.commands import job_from_args

    args, _ = cli.build_parser().parse_known_args(["train", JOB, "--run-dir", "~"])
    assert job_from_args(args).run_path == Path.home()


# ------------------------------------------------------------------------------------- case 13
@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.lr=.nan", "train.lr: nan is not a finite number"),
        ("train.lr=.inf", "train.lr: inf is not a finite number"),
        ("train.min_lr=-.inf", "train.min_lr: -inf is not a finite number"),
        ("name=..", "name: '..' must be a plain name"),
        ("name=.", "name: '.' must be a plain name"),
        ("train.steps=1.0e+30", "train.steps: 1000000000000000019884624838656 is out of range"),
        ("train.steps=1e30", "train.steps: expected an integer, got '1e30'"),
        ("train.global_batch_size=18", "global_batch_size: 18 is not a multiple of micro_batch_size=4"),
        ("train.steps=" + "9" * 5000, "override 'train.steps': holds a number too long to read"),
    ],
)
def test_bad_values_are_one_line_errors_at_config_time(
    override: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(["config", JOB, override], capsys)
    assert code == 2 and one_line(err) and needle in err, err[:2000]
    assert len(err) < 400


def test_run_name_dotdot_would_have_been_the_repository_root(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(["config", JOB, "name=.."], capsys)
    assert code == 2 and "e.g. name=" in err


def test_non_utf8_job_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "latin1.yaml"
    job.write_bytes((REPO / "jobs" / "tiny-cpu.yaml").read_bytes().replace(b"name: tiny-cpu", b"name: caf\xe9"))
    code, err = run_cli(["config", str(job)], capsys)
    assert code == 2 and one_line(err), err[:2000]
    assert "(0xe9) is not UTF-8 text: save the file as UTF-8" in err


def test_5000_digit_integer_in_a_job_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "big.yaml"
    job.write_text((REPO / "jobs" / "tiny-cpu.yaml").read_text().replace("steps: 300", "steps: " + "9" * 5000))
    code, err = run_cli(["config", str(job)], capsys)
    assert code == 2 and one_line(err) and len(err) < 400, err[:2000]
    assert "holds a number too long to read" in err


def test_good_values_still_work(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["config", JOB, "train.lr=1e-3", "train.steps=40", "name=tiny-2", "train.global_batch_size=8"])
    out = capsys.readouterr().out
    assert code == 0 and "name: tiny-2" in out and "lr: 0.001" in out and "steps: 40" in out
