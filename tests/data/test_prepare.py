"""prepare-data on real files: tokenizer, packing, split, MDS shards + manifest, idempotence."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest

from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.manifest import read_manifest, sha256_file
from elastic_pretrain.data.prepare import LineProgress, is_val, prepare_data
from elastic_pretrain.data.shards import SplitReader
from elastic_pretrain.data.sources import list_files
from elastic_pretrain.data.tokenizer import ByteTokenizer
from elastic_pretrain.errors import UserError
from tests.data.conftest import recipe, write_corpus


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'größe café 東京 λόγος' * x\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.decode([*tok.encode("a"), tok.eos_id, *tok.encode("b")]) == "a\nb"
    assert ByteTokenizer().fingerprint == tok.fingerprint and len(tok.fingerprint) == 64


def _expected_stream(cfg: DataConfig, split: int) -> np.ndarray:
    """What packing must produce: the split's documents in prepare order, each + EOS, concatenated."""
    assert cfg.prepare is not None
    parts = []
    for path, name in list_files(cfg.prepare):
        if is_val(name, cfg.prepare.val_fraction) == bool(split):
            parts += [*path.read_bytes(), 256]
    return np.asarray(parts)


def _rows(cfg: DataConfig, split: str) -> np.ndarray:
    reader = SplitReader(cfg, cfg.streams[0] if split == "train" else cfg.validation, ByteTokenizer())  # type: ignore[arg-type]
    return np.stack([reader.get(i) for i in range(len(reader))])


def test_prepare_writes_packed_mds_shards_and_manifest(prepared_mds: DataConfig) -> None:
    assert prepared_mds.prepare is not None
    out = Path(prepared_mds.prepare.output)
    m = read_manifest(out)
    assert (m.format, m.seq_len, m.dtype) == ("mds", 16, "uint16")
    assert m.tokenizer["fingerprint"] == ByteTokenizer.fingerprint
    for name, split in m.splits.items():
        assert split.tokens == split.sequences * 17 and split.sequences == sum(s.samples for s in split.shards)
        assert all(s.samples == 32 for s in split.shards[:-1])
        for shard in split.shards:
            assert sha256_file(out / name / shard.name) == shard.sha256
        assert (out / name / "index.json").is_file()
    assert len(m.splits["train"].shards) >= 3 and m.splits["val"].sequences > 0
    # the rows are the documents (+EOS) packed back to back, only the last partial row dropped
    for i, split in enumerate(("train", "val")):
        rows = _rows(prepared_mds, split)
        expected = _expected_stream(prepared_mds, i)
        assert len(expected) - rows.size < 17
        np.testing.assert_array_equal(rows.reshape(-1), expected[: rows.size])


def test_prepare_is_idempotent_and_refuses_another_recipe(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", n_files=8)
    cfg = recipe(tmp_path / "ds", [str(corpus)])
    first = prepare_data(cfg, progress=False)
    shard = tmp_path / "ds" / "train" / first.splits["train"].shards[0].name
    stamp = shard.stat().st_mtime_ns
    again = prepare_data(cfg, progress=False)
    assert again.splits == first.splits and shard.stat().st_mtime_ns == stamp
    with pytest.raises(UserError, match="different recipe"):
        prepare_data(recipe(tmp_path / "ds", [str(corpus)], seq_len=8), progress=False)
    # an interrupted preparation (no manifest) is redone from scratch
    os.remove(tmp_path / "ds" / "manifest.json")
    redone = prepare_data(cfg, progress=False)
    assert redone.splits == first.splits


def test_prepare_caps_tokens_and_keeps_validation(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c", n_files=30)
    cfg = recipe(tmp_path / "ds", [str(corpus)], prepare={"max_tokens": 340})
    m = prepare_data(cfg, progress=False)
    assert m.splits["train"].tokens == 340 and m.splits["val"].sequences >= 1


def test_stdlib_source_lists_python_sources_deterministically() -> None:
    from elastic_pretrain.data.config import PrepareConfig

    files = list_files(PrepareConfig(source="stdlib", output="unused"))
    names = [n for _, n in files]
    assert len(names) > 500 and all(n.endswith(".py") for n in names)
    assert not any("site-packages" in n for n in names) and "os.py" in names
    assert names == [n for _, n in list_files(PrepareConfig(source="stdlib", output="unused"))]


def test_progress_without_a_terminal_is_one_line_per_tenth(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In a log or CI (stderr not a terminal) each progress report is its own line, no carriage return:
    one per tenth of the tokens (or per interval), the last one at the end."""
    out = io.StringIO()
    with LineProgress(1000, "prepare x", interval_s=1e9, file=out) as bar:
        for _ in range(25):
            bar.update(40)
    lines = out.getvalue().splitlines()
    shown = [int(line.split()[2].split("/")[0].replace(",", "")) for line in lines]
    assert shown == [*range(120, 1000, 120), 1000], lines  # each >= 100 tokens after the last; the end
    assert lines[-1].startswith("prepare x: 1,000/1,000 tokens (100%)") and "\r" not in out.getvalue()
    corpus = write_corpus(tmp_path / "c", n_files=30)
    prepare_data(recipe(tmp_path / "ds", [str(corpus)], prepare={"max_tokens": 340}), progress=True)
    err = capsys.readouterr().err  # pytest's capture is not a terminal: the line form
    assert "\r" not in err and "prepare ds: 340/340 tokens (100%)" in err, err
    prepare_data(recipe(tmp_path / "quiet", [str(corpus)], prepare={"max_tokens": 340}), progress=False)
    assert "prepare quiet" not in capsys.readouterr().err
