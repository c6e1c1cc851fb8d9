"""prepare-data as a user re-runs it (issue #21, item 7): what it reads, what it says, how it repairs.

A forced ``input_format: text`` reads every file whatever its name; a file that is not UTF-8 is
counted in the printed summary; a re-run says "up to date" or which inputs changed (and rebuilds);
the advice of a bad-shard error ("delete it and re-run prepare-data") works in one round."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from elastic_pretrain.data.prepare import prepare_data
from elastic_pretrain.data.shards import SplitReader
from elastic_pretrain.data.sources import list_files
from elastic_pretrain.data.tokenizer import ByteTokenizer
from elastic_pretrain.errors import UserError
from tests.conftest import REPO, VENV_BIN
from tests.data.conftest import recipe, write_corpus


def _read_all(cfg) -> int:
    reader = SplitReader(cfg, cfg.streams[0], ByteTokenizer())
    for i in range(len(reader)):
        reader.get(i)
    return len(reader)


def test_text_format_reads_every_file_whatever_its_suffix(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", n_files=3)
    (corpus / "README").write_text("no suffix at all\n")
    (corpus / "notes.log").write_text("a log file\n")
    (corpus / ".hidden").write_text("an editor's swap file\n")
    names = lambda cfg: sorted(n for _, n in list_files(cfg.prepare))  # noqa: E731
    auto = names(recipe(tmp_path / "a", [str(corpus)]))
    text = names(recipe(tmp_path / "t", [str(corpus)], prepare={"input_format": "text"}))
    assert "c/README" not in auto and "c/notes.log" not in auto
    assert set(text) == {*auto, "c/README", "c/notes.log"}  # hidden files stay out
    only = names(recipe(tmp_path / "s", [str(corpus)], prepare={"input_format": "text", "suffixes": [".log"]}))
    assert only == ["c/notes.log"]


def test_rerun_says_up_to_date_or_what_changed_and_counts_non_utf8(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", n_files=8)
    (corpus / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1"))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "format": "mds", "seq_len": 16, "streams": [{"path": str(tmp_path / "ds")}],
        "validation": {"path": str(tmp_path / "ds"), "split": "val"},
        "prepare": {"source": "files", "inputs": [str(corpus)], "output": str(tmp_path / "ds"), "val_fraction": 0.2,
                    "samples_per_shard": 32},
    }))  # fmt: skip

    def cli() -> str:
        proc = subprocess.run([str(VENV_BIN / "elastic-pretrain"), "prepare-data", str(path), "--quiet"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    first = cli()
    assert "skipped: 1 input files that are not UTF-8 text" in first and "up to date" not in first
    again = cli()
    assert "up to date (9 input files unchanged)" in again and "skipped: 1 input files" in again
    write_corpus(tmp_path / "more", n_files=1, seed=5).joinpath("part0", "doc000.txt").rename(corpus / "new.txt")
    changed = cli()
    assert "inputs changed since the shards were built (9 -> 10 files, " in changed and "rebuilding" in changed
    assert "up to date (10 input files unchanged)" in cli()


def test_bad_shard_advice_works_in_one_round(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", n_files=12)
    cfg = recipe(tmp_path / "ds", [str(corpus)])
    prepare_data(cfg, progress=False)
    rows = _read_all(cfg)
    victim = sorted((tmp_path / "ds" / "train").glob("shard*"))[1]
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(UserError, match="delete it and re-run prepare-data"):
        _read_all(cfg)
    victim.unlink()  # the advice, followed
    said: list[str] = []
    prepare_data(cfg, progress=False, say=said.append)
    assert said == [f"{tmp_path / 'ds'}: shard train/{victim.name} is missing: rebuilding the shards"]
    assert _read_all(cfg) == rows
    # a damaged shard left in place is rebuilt too (not refused with another instruction)
    victim.write_bytes(b"\0" * victim.stat().st_size)
    said.clear()
    prepare_data(cfg, progress=False, say=said.append)
    assert "fails its sha256 checksum" in said[0] and _read_all(cfg) == rows
