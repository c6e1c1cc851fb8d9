"""Hostile outputs and tokenizer files for ``prepare-data`` (issue #13, cases 4 and 9): it deletes only
what it wrote, and a bad ranks file or a dying worker is a one-line error, never a hang."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic_pretrain import cli
from elastic_pretrain.errors import UserError
from tests.data.conftest import write_corpus

REPO = Path(__file__).resolve().parents[2]
HANG_LIMIT_S = 180  # today's code never returns; a working one answers in seconds (spawned workers import numpy)


def write_recipe(tmp_path: Path, out: Path, **prepare: object) -> Path:
    corpus = write_corpus(tmp_path / "corpus", n_files=6)
    recipe = tmp_path / "recipe.yaml"
    tokenizer = prepare.pop("tokenizer", None)
    raw: dict[str, object] = {
        "seq_len": 16,
        "streams": [{"path": str(out)}],
        "prepare": {"source": "files", "inputs": [str(corpus)], "output": str(out), "val_fraction": 0.3, **prepare},
    }
    if tokenizer:
        raw["tokenizer"] = tokenizer
    recipe.write_text(yaml.safe_dump(raw))
    return recipe


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip()


# -------------------------------------------------------------------------------------- case 4
def test_output_with_data_of_its_own_is_not_deleted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "project"
    (out / "train").mkdir(parents=True)
    (out / "train" / "notes.txt").write_text("my experiment notes\n")
    (out / "val").mkdir()
    (out / "val" / "labels.csv").write_text("id,label\n")
    code, err = run_cli(["prepare-data", str(write_recipe(tmp_path, out)), "--quiet"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "train/notes.txt was not written by prepare-data" in err and "new or empty folder" in err
    assert (out / "train" / "notes.txt").read_text() == "my experiment notes\n"
    assert (out / "val" / "labels.csv").read_text() == "id,label\n"


def test_split_symlink_to_other_data_is_not_followed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "shard.00000.mds").write_bytes(b"somebody's file")
    out = tmp_path / "ds"
    out.mkdir()
    (out / "train").symlink_to(elsewhere)
    code, err = run_cli(["prepare-data", str(write_recipe(tmp_path, out)), "--quiet"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "train was not written by prepare-data" in err, err
    assert (elsewhere / "shard.00000.mds").read_bytes() == b"somebody's file"


def test_own_leftovers_and_empty_folders_are_still_redone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ds"
    recipe = str(write_recipe(tmp_path, out))
    assert run_cli(["prepare-data", recipe, "--quiet"], capsys)[0] == 0
    (out / "manifest.json").unlink()  # interrupted before the manifest: shards and index are leftovers
    assert run_cli(["prepare-data", recipe, "--quiet"], capsys)[0] == 0
    assert (out / "manifest.json").is_file()
    empty = tmp_path / "fresh"
    (empty / "train").mkdir(parents=True)
    assert run_cli(["prepare-data", str(write_recipe(tmp_path, empty)), "--quiet"], capsys)[0] == 0


# -------------------------------------------------------------------------------------- case 9
def write_ranks(path: Path, ranks: dict[bytes, int] | None = None, extra: str = "") -> Path:
    ranks = {bytes([b]): b for b in range(256)} | {b"al": 256, b"ph": 257} if ranks is None else ranks
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()) + extra)
    return path


def test_ranks_file_without_every_byte_fails_instead_of_hanging(tmp_path: Path) -> None:
    # no rank for 'z': tiktoken's Rust code panics on "zeta" in a worker; multiprocessing.Pool then waits forever
    ranks = {bytes([b]): b for b in range(256) if b != ord("z")}
    tokenizer = {"kind": "tiktoken", "path": str(write_ranks(tmp_path / "bad.tiktoken", ranks))}
    recipe = write_recipe(tmp_path, tmp_path / "ds", num_workers=2, tokenizer=tokenizer)
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_pretrain.cli", "prepare-data", str(recipe), "--quiet"],
        capture_output=True, text=True, timeout=HANG_LIMIT_S, cwd=REPO,
    )  # fmt: skip
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
    assert "has no rank for 1 of the 256 single bytes (e.g. 0x7a)" in err and "fix the ranks file" in err


@pytest.mark.parametrize(
    ("ranks", "extra", "needle"),
    [
        (None, "YWw= 300\n", "token b'al' already has rank 256"),
        (None, "YWJj 257\n", "rank 257 is also on line 258"),
        (None, "YWJj -5\n", "rank -5 is outside 0..16,777,214"),
        (None, "YWJj 4294967296\n", "rank 4294967296 is outside 0..16,777,214"),
    ],
    ids=["duplicate-token", "duplicate-rank", "negative", "huge"],
)
def test_bad_ranks_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ranks: dict[bytes, int] | None, extra: str, needle: str
) -> None:
    tokenizer = {"kind": "tiktoken", "path": str(write_ranks(tmp_path / "r.tiktoken", ranks, extra))}
    code, err = run_cli(["prepare-data", str(write_recipe(tmp_path, tmp_path / "ds", tokenizer=tokenizer))], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert needle in err


def test_bad_tokenizer_pattern_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = {"kind": "tiktoken", "path": str(write_ranks(tmp_path / "r.tiktoken")), "pattern": r"(\S+"}
    code, err = run_cli(["prepare-data", str(write_recipe(tmp_path, tmp_path / "ds", tokenizer=tokenizer))], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "tokenizer.pattern: '(\\\\S+' is not a valid regular expression" in err


def test_a_dying_worker_is_an_error_not_a_hang() -> None:
    from elastic_pretrain.data.prepare import ordered_map

    with pytest.raises(UserError, match="a tokenizer worker process died"):
        list(ordered_map(os._exit, [3, 4, 5], 2, None, ()))


def test_ordered_map_keeps_the_order() -> None:
    from elastic_pretrain.data.prepare import ordered_map

    assert list(ordered_map(abs, range(-40, 0), 2, None, ())) == list(range(40, 0, -1))


def test_good_ranks_file_prepares_with_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = {"kind": "tiktoken", "path": str(write_ranks(tmp_path / "ok.tiktoken"))}
    recipe = write_recipe(tmp_path, tmp_path / "ds", num_workers=2, tokenizer=tokenizer)
    assert run_cli(["prepare-data", str(recipe), "--quiet"], capsys)[0] == 0
    assert (tmp_path / "ds" / "manifest.json").is_file()
