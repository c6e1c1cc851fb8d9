"""A shard is hashed once per machine, not once per rank (issue 31; data/verified.py): the record of a good hash
vouches only for the same bytes (a write moves ctime, a replacement the inode), ranks of a machine wait for
the one that hashes, and a cache others can write into is not used."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from elastic_pretrain.config import build
from elastic_pretrain.data import manifest
from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.manifest import ShardInfo, sha256_file
from elastic_pretrain.data.verified import ENV, cache_dir, verify_shard_once


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every sha256 of a shard appends a line to the returned file (forked processes too); records go to a
    private folder of this test."""
    log = tmp_path / "hashed.log"
    real = manifest.sha256_file

    def counting(path: Path) -> str:
        with open(log, "a") as f:
            f.write(f"{path.name}\n")
        time.sleep(0.05)  # a window for the other ranks to arrive while one hashes
        return real(path)

    monkeypatch.setattr(manifest, "sha256_file", counting)
    cache = tmp_path / "verified"
    monkeypatch.setenv(ENV, str(cache))
    return log


def _count(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def _shard(tmp_path: Path, data: bytes = b"tokens" * 1000) -> tuple[Path, ShardInfo]:
    path = tmp_path / "shard.00000.mds"
    path.write_bytes(data)
    return path, ShardInfo(name=path.name, samples=1, bytes=len(data), sha256=sha256_file(path))


def test_a_good_shard_is_hashed_once_and_any_change_to_it_is_hashed_again(hashes: Path, tmp_path: Path) -> None:
    path, info = _shard(tmp_path)
    assert verify_shard_once(path, info, "sha256") is None
    assert verify_shard_once(path, info, "sha256") is None
    assert _count(hashes) == 1
    # a byte flipped in place, mtime put back: ctime moved, so the record no longer vouches for the file
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    with open(path, "r+b") as f:
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify_shard_once(path, info, "sha256") == "fails its sha256 checksum (corrupt or replaced)"
    assert _count(hashes) == 2
    # the good bytes back in a new file (another inode): hashed again, then trusted again
    path.unlink()
    path.write_bytes(b"tokens" * 1000)
    assert verify_shard_once(path, info, "sha256") is None
    assert verify_shard_once(path, info, "sha256") is None
    assert _count(hashes) == 3
    # verify: size never hashes; a missing shard says so
    assert verify_shard_once(path, info, "size") is None and _count(hashes) == 3
    assert verify_shard_once(tmp_path / "gone.mds", info, "sha256") == "is missing"


def _verify(path: Path, info: ShardInfo) -> None:
    assert verify_shard_once(path, info, "sha256") is None


def test_ranks_of_a_machine_wait_for_the_one_that_hashes(hashes: Path, tmp_path: Path) -> None:
    path, info = _shard(tmp_path)
    ctx = multiprocessing.get_context("fork")  # the counting hash is inherited by the children
    procs = [ctx.Process(target=_verify, args=(path, info)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert _count(hashes) == 1


def test_a_planted_or_unreadable_record_and_a_shared_cache_are_not_trusted(
    hashes: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, info = _shard(tmp_path)
    assert verify_shard_once(path, info, "sha256") is None
    root = cache_dir()
    assert root is not None and oct(root.stat().st_mode & 0o777) == "0o700"
    [record] = root.glob("*.json")
    for text in ('{"sha256": "' + "0" * 64 + '", "file": [1, 2, 3, 4, 5]}', "not json", "[" * 10_000):
        record.write_text(text)
        assert verify_shard_once(path, info, "sha256") is None  # hashed again, not trusted
    assert _count(hashes) == 4
    # a cache folder others can write into vouches for nothing: not used, every call hashes
    root.chmod(0o777)
    assert cache_dir() is None
    verify_shard_once(path, info, "sha256")
    verify_shard_once(path, info, "sha256")
    assert _count(hashes) == 6
    monkeypatch.setenv(ENV, str(path))  # a file where the folder should be: no cache, no error
    assert cache_dir() is None and verify_shard_once(path, info, "sha256") is None


def test_two_readers_of_a_prepared_split_hash_each_shard_once(hashes: Path, tmp_path: Path) -> None:
    """Two ranks' readers of the same split (as on one node): every shard hashed once, not once per reader."""
    from elastic_pretrain.data.prepare import prepare_data
    from elastic_pretrain.data.shards import SplitReader
    from elastic_pretrain.data.tokenizer import load_tokenizer

    out = tmp_path / "ds"
    cfg = build(DataConfig, {
        "seq_len": 32, "streams": [{"path": str(out)}],
        "prepare": {"source": "synthetic", "output": str(out), "seed": 1, "max_tokens": 40 * 33, "val_fraction": 0.1,
                    "samples_per_shard": 8, "synthetic": {"max_variables": 4, "max_depth": 4, "min_variables": 2}},
    })  # fmt: skip
    prepare_data(cfg, progress=False)
    hashes.unlink(missing_ok=True)  # prepare-data's own hashes are not the readers'
    tok = load_tokenizer(cfg.tokenizer)
    readers = [SplitReader(cfg, cfg.streams[0], tok) for _ in range(2)]
    rows = sum(s.samples for s in readers[0].shards)
    for reader in readers:
        for i in range(rows):
            assert reader.get(i).shape == (33,)
    assert sorted(hashes.read_text().splitlines()) == sorted(s.name for s in readers[0].shards)
