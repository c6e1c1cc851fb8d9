"""Bad data never passes silently: each case is a one-line UserError naming the file and the fix,
or — with ``on_bad_shard: skip`` — a shard left out with a counted warning."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from elastic_pretrain.config import build
from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.loader import TokenBatches
from elastic_pretrain.data.shards import SplitReader
from elastic_pretrain.data.tokenizer import load_tokenizer
from elastic_pretrain.errors import UserError
from tests.data.conftest import write_ranks


def _copy(cfg: DataConfig, dest: Path, **over: object) -> DataConfig:
    """A private copy of a prepared dataset (to damage) and a recipe reading it."""
    assert cfg.prepare is not None
    shutil.copytree(cfg.prepare.output, dest)
    raw = {"format": cfg.format, "seq_len": cfg.seq_len, "streams": [{"path": str(dest)}], **over}
    return build(DataConfig, raw)


def _read_all(cfg: DataConfig) -> int:
    reader = SplitReader(cfg, cfg.streams[0], load_tokenizer(cfg.tokenizer))
    for i in range(len(reader)):
        reader.get(i)
    return len(reader)


def _shard(cfg: DataConfig, k: int) -> Path:
    return sorted(p for p in (Path(cfg.streams[0].path) / "train").iterdir() if p.name.startswith("shard"))[k]


def _one_line(err: pytest.ExceptionInfo[UserError]) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("fmt", ["mds", "wds"])
def test_truncated_shard(request: pytest.FixtureRequest, tmp_path: Path, fmt: str) -> None:
    cfg = _copy(request.getfixturevalue(f"prepared_{fmt}"), tmp_path / "ds")
    victim = _shard(cfg, 1)
    victim.write_bytes(victim.read_bytes()[:-700])
    with pytest.raises(UserError) as err:
        _read_all(cfg)
    msg = _one_line(err)
    assert f"shard {victim.name} has" in msg and "truncated" in msg and "on_bad_shard=skip" in msg


def test_corrupt_shard_fails_checksum(prepared_mds: DataConfig, tmp_path: Path) -> None:
    cfg = _copy(prepared_mds, tmp_path / "ds")
    victim = _shard(cfg, 2)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    victim.write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        _read_all(cfg)
    assert f"shard {victim.name} fails its sha256 checksum" in _one_line(err)
    # verify: size cannot see a same-size corruption (documented trade-off); sha256 is the default
    assert _read_all(dataclasses.replace(cfg, verify="size")) > 0


def test_unreadable_tar_with_size_only_verification(prepared_wds: DataConfig, tmp_path: Path) -> None:
    cfg = _copy(prepared_wds, tmp_path / "ds", verify="size", wds_window=2)
    victim = _shard(cfg, 0)
    data = victim.read_bytes()
    victim.write_bytes(data[:512] + b"\0" * (len(data) - 512))  # header kept, members zeroed
    with pytest.raises(UserError) as err:
        _read_all(cfg)
    assert f"shard {victim.name}" in _one_line(err) and "prepare-data" in str(err.value)


def test_skip_leaves_bad_shards_out_with_a_counted_warning(
    prepared_mds: DataConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _copy(prepared_mds, tmp_path / "ds", on_bad_shard="skip")
    full = _read_all(dataclasses.replace(cfg, on_bad_shard="error"))
    for k in (0, 2):  # two full shards of 32 sequences each
        victim = _shard(cfg, k)
        victim.write_bytes(victim.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="elastic_pretrain.data.shards"):
        loader = TokenBatches(cfg, micro_batch_size=2, num_micro_batches=1, dp_rank=0, dp_size=1, seed=0)
    assert len(loader.readers[0]) == full - 2 * 32 and loader.readers[0].skipped == [
        "shard.00000.mds",
        "shard.00002.mds",
    ]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "(2 skipped in this split)" in warnings[1] and "shard.00002.mds" in warnings[1]
    assert loader.next_step()[0].shape == (2, 17)


def test_tokenizer_fingerprint_mismatch(prepared_mds: DataConfig, tmp_path: Path) -> None:
    assert prepared_mds.prepare is not None
    ranks = write_ranks(tmp_path / "tiny.tiktoken")
    cfg = build(
        DataConfig,
        {
            "seq_len": 16,
            "streams": [{"path": prepared_mds.prepare.output}],
            "tokenizer": {"kind": "tiktoken", "path": str(ranks)},
        },
    )
    with pytest.raises(UserError) as err:
        TokenBatches(cfg, micro_batch_size=1, num_micro_batches=1, dp_rank=0, dp_size=1, seed=0)
    msg = _one_line(err)
    assert "different tokenizer (byte" in msg and "re-run prepare-data" in msg


def test_seq_len_and_format_mismatch(prepared_mds: DataConfig) -> None:
    assert prepared_mds.prepare is not None
    out = prepared_mds.prepare.output
    for over, expected in (
        ({"seq_len": 32}, "shards hold seq_len 16, the job asks for 32; set data.seq_len=16"),
        ({"format": "wds"}, "shards are mds, the recipe says format: wds"),
    ):
        cfg = build(DataConfig, {"seq_len": 16, "streams": [{"path": out}], **over})
        with pytest.raises(UserError) as err:
            TokenBatches(cfg, micro_batch_size=1, num_micro_batches=1, dp_rank=0, dp_size=1, seed=0)
        assert expected in _one_line(err)


def test_missing_or_malformed_manifest(prepared_mds: DataConfig, tmp_path: Path) -> None:
    cfg = build(DataConfig, {"seq_len": 16, "streams": [{"path": str(tmp_path / "nothing")}]})
    with pytest.raises(UserError, match="no manifest; run `elastic-pretrain prepare-data"):
        TokenBatches(cfg, micro_batch_size=1, num_micro_batches=1, dp_rank=0, dp_size=1, seed=0)
    broken = _copy(prepared_mds, tmp_path / "ds")
    (tmp_path / "ds" / "manifest.json").write_text('{"format": "mds"')
    with pytest.raises(UserError, match="malformed manifest"):
        _read_all(broken)


def test_mixed_rows_are_int64_and_in_vocab(prepared_mds: DataConfig) -> None:
    rows = np.concatenate(
        [
            m.numpy()
            for m in TokenBatches(
                prepared_mds, micro_batch_size=4, num_micro_batches=2, dp_rank=0, dp_size=1, seed=0
            ).next_step()
        ]
    )
    assert rows.dtype == np.int64 and rows.min() >= 0 and rows.max() <= 256
