"""Hostile data II (issue 35, items 3, 4, 7 and 8): data locations chosen by a checkpoint, caches that
were never ours, size claims that allocate what no file holds, corpora that never end, and numbers no
reader expects. Each test builds the exact input from real prepare-data output, tampered as someone
who controls the checkpoint, the dataset or the corpus would; nothing outside the cache or run may
change, memory stays bounded, and the user gets one line naming the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from elastic_pretrain.config import ConfigError, build
from elastic_pretrain.data.config import DataConfig, PrepareConfig
from elastic_pretrain.data.manifest import read_manifest
from elastic_pretrain.data.prepare import prepare_data
from elastic_pretrain.data.shards import CACHE_MARKER, SplitReader
from elastic_pretrain.data.sources import iter_documents
from elastic_pretrain.data.tokenizer import load_tokenizer
from elastic_pretrain.errors import UserError
from tests.conftest import REPO, VENV_BIN
from tests.data.conftest import recipe, write_corpus
from tests.security.test_checkpoint_inputs import QUICK, one_line_error, recommit

CLI = str(VENV_BIN / "elastic-pretrain")
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB user@laptop\n"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DataConfig]:
    """A small corpus prepared as MDS and as WebDataset (seq_len 16, 32-row shards)."""
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    out = {}
    for fmt in ("mds", "wds"):
        cfg = recipe(tmp_path_factory.mktemp(fmt) / "ds", [str(corpus)], format=fmt)
        prepare_data(cfg, progress=False)
        out[fmt] = cfg
    return out


def output(cfg: DataConfig) -> Path:
    assert cfg.prepare is not None
    return Path(cfg.prepare.output)


def stream(path: Path, fmt: str = "mds", **kw: Any) -> DataConfig:
    return build(DataConfig, {"format": fmt, "seq_len": 16, "streams": [{"path": str(path), **kw}]})


def read_all(cfg: DataConfig) -> int:
    reader = SplitReader(cfg, cfg.streams[0], load_tokenizer(cfg.tokenizer))
    for i in range(len(reader)):
        reader.get(i)
    return len(reader)


HUGE = "<5000 digits>"  # json.dumps refuses to write such an int (Python's 4300-digit limit): spliced in


def edit_manifest(root: Path, edit: Any) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    text = json.dumps(manifest).replace(json.dumps(HUGE), "9" * 5000)
    (root / "manifest.json").write_text(text)


def one_line(err: pytest.ExceptionInfo[Exception]) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


def hostile_remote(src: Path, dest: Path, split: str, name: str, source: str = "train") -> None:
    """Split ``source`` of ``src`` (MDS) as the only split ``split``, its first shard named ``name``,
    manifest and index.json re-recorded: a dataset whose author aims a cache's refetch at
    ``<cache>/split/name``."""
    dest.mkdir()
    shutil.copy(src / "manifest.json", dest)
    shutil.copytree(src / source, dest / split)
    (dest / split / "shard.00000.mds").rename(dest / split / name)
    index = json.loads((dest / split / "index.json").read_text())
    index["shards"][0]["raw_data"]["basename"] = name
    (dest / split / "index.json").write_text(json.dumps(index))

    def edit(m: dict[str, Any]) -> None:
        info = m["splits"].pop(source)
        m["splits"].clear()
        info["shards"][0]["name"] = name
        info["index_sha256"] = hashlib.sha256((dest / split / "index.json").read_bytes()).hexdigest()
        m["splits"][split] = info

    edit_manifest(dest, edit)


# -------------------------------------------------- item 3: where data is fetched to and deleted
def test_split_with_a_leading_dot_is_refused(prepared: dict[str, DataConfig], tmp_path: Path) -> None:
    """The exact input: cache ``local: ~`` (a fake home), ``split: .ssh``, a shard named authorized_keys
    whose cached copy (the user's key file) fails its checksum, so the refetch would replace it."""
    home, remote = tmp_path / "home", tmp_path / "remote"
    victim = home / ".ssh" / "authorized_keys"
    victim.parent.mkdir(parents=True)
    victim.write_text(KEY)
    hostile_remote(output(prepared["mds"]), remote, ".ssh", "authorized_keys")
    with pytest.raises(ConfigError) as err:
        read_all(stream(remote, local=str(home), split=".ssh"))
    assert "split: '.ssh' must be a plain directory name" in one_line(err)
    with pytest.raises(UserError) as err:  # the manifest's names follow the same rule
        read_manifest(remote)
    assert "'.ssh' is not a plain file name" in one_line(err)
    assert victim.read_text() == KEY and not (home / "manifest.json").exists()


def test_refetch_deletes_nothing_in_a_folder_it_did_not_create(prepared: dict[str, DataConfig], tmp_path: Path) -> None:
    """Names that pass every check (``local: ~``, split ``ssh``): the refetch still deletes nothing,
    because the cache root has no marker (elastic-pretrain did not create it)."""
    home, remote = tmp_path / "home", tmp_path / "remote"
    victim = home / "ssh" / "authorized_keys"
    victim.parent.mkdir(parents=True)
    victim.write_text(KEY)
    hostile_remote(output(prepared["mds"]), remote, "ssh", "authorized_keys")
    with pytest.raises(UserError) as err:
        read_all(stream(remote, local=str(home), split="ssh"))
    assert f"has no {CACHE_MARKER}" in one_line(err) and "deletes nothing there" in str(err.value)
    assert victim.read_text() == KEY
    assert not (home / CACHE_MARKER).exists()  # a folder with files in it is never claimed


def test_a_cache_it_created_is_marked_and_still_repaired(prepared: dict[str, DataConfig], tmp_path: Path) -> None:
    """Good input: a new cache root (and an existing empty one) gets the marker; a damaged cached shard
    is deleted and fetched again."""
    for cache in (tmp_path / "new" / "cache", tmp_path / "empty"):
        if cache.name == "empty":
            cache.mkdir()
        cfg = stream(output(prepared["mds"]), local=str(cache))
        rows = read_all(cfg)
        assert (cache / CACHE_MARKER).is_file()
        damaged = cache / "train" / "shard.00001.mds"
        damaged.write_bytes(b"x" * damaged.stat().st_size)  # same size: only the checksum sees it
        assert read_all(cfg) == rows
        assert damaged.read_bytes() == (output(prepared["mds"]) / "train" / "shard.00001.mds").read_bytes()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real committed checkpoint of the tiny job (two steps, one process), trained on stdlib-code."""
    run = tmp_path_factory.mktemp("run") / "tiny"
    train = ["train", "jobs/tiny-cpu.yaml", "--run-dir", str(run), *QUICK[:1], "train.steps=2", *QUICK[2:]]
    for args in (["prepare-data", "stdlib-code", "--quiet"], train):
        proc = subprocess.run([CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run / "checkpoints" / "step_2"


@pytest.mark.slow
@pytest.mark.parametrize("split", [".ssh", "ssh"])
def test_eval_reads_the_users_recipe_never_the_checkpoints_locations(
    checkpoint: Path, tmp_path: Path, split: str
) -> None:
    """The checkpoint's trainer.json says ``data.validation: {path: <their remote>, local: ~, split}``
    (re-recorded in COMMITTED, as its author would). With HOME a fake home holding the key file,
    ``eval --data stdlib-code`` either reads the user's recipe or stops in one line; ~ is untouched."""
    home, remote = tmp_path / "home", tmp_path / "remote"
    victim = home / split / "authorized_keys"
    victim.parent.mkdir(parents=True)
    victim.write_text(KEY)
    hostile_remote(REPO / "cache" / "stdlib-code", remote, split, "authorized_keys", source="val")
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(checkpoint, ckpt)
    state = json.loads((ckpt / "trainer.json").read_text())
    state["config"]["data"]["validation"] = {"path": str(remote), "local": "~", "split": split, "weight": 1.0}
    (ckpt / "trainer.json").write_text(json.dumps(state))
    recommit(ckpt)
    env = {**os.environ, "HOME": str(home)}
    out = tmp_path / "eval"
    args = [CLI, "eval", str(ckpt), "--data", "stdlib-code", "--sequences", "2", "--no-track", "--out", str(out)]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert victim.read_text() == KEY, "the checkpoint's data location replaced a file in the home directory"
    assert not (home / "manifest.json").exists()
    if split == ".ssh":  # the checkpoint's own config is invalid: refused before anything is read
        one_line_error(proc, "split: '.ssh' must be a plain directory name")
    else:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "| 4 |" in (out / "eval.md").read_text()


def test_eval_recipe_must_fit_the_checkpoint() -> None:
    """``eval --data``: the user's recipe chooses the locations; the checkpoint's data section only says
    which tokenizer and context the model has (each mismatch is one line, before any data is read)."""
    import dataclasses

    from elastic_pretrain.data.recipes import check_eval_recipe, load_recipe

    trained = load_recipe("stdlib-code")
    check_eval_recipe(dataclasses.replace(trained, seq_len=64), trained, 257)  # shorter rows are fine
    other = dataclasses.replace(trained.tokenizer, kind="tiktoken", name="gpt2")
    for recipe_, vocab, needle in [
        (dataclasses.replace(trained, tokenizer=other), 257, "is not the one the checkpoint was trained with"),
        (trained, 200, "more ids than the model's 200"),
        (dataclasses.replace(trained, seq_len=256), 257, "seq_len 256 is longer than the 128"),
    ]:
        with pytest.raises(ConfigError) as err:
            check_eval_recipe(recipe_, trained, vocab)
        assert needle in one_line(err) and one_line(err).startswith("--data: ")


# --------------------------------------------------- item 4: cached streams in a fresh process
def test_cached_stream_reads_in_a_fresh_process(prepared: dict[str, DataConfig], tmp_path: Path) -> None:
    """``local:`` set (any recipe with a cache or an s3/gs/hf path): the downloader's import was circular
    in a fresh interpreter (``cannot import name 'bytes_to_int'``). Both formats, real shards, fetched
    from a local "remote" folder, the same rows as reading the folder in place."""
    script = textwrap.dedent("""
        import hashlib, sys
        from elastic_pretrain.config import build
        from elastic_pretrain.data.config import DataConfig
        from elastic_pretrain.data.shards import SplitReader
        from elastic_pretrain.data.tokenizer import load_tokenizer
        for fmt, path, cache in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
            digests = []
            for local in (cache, None):  # the cache first: nothing of streaming is imported yet
                cfg = build(DataConfig, {"format": fmt, "seq_len": 16, "streams": [{"path": path, "local": local}]})
                reader = SplitReader(cfg, cfg.streams[0], load_tokenizer(cfg.tokenizer))
                rows = b"".join(reader.get(i).tobytes() for i in range(len(reader)))
                digests.append(hashlib.sha256(rows).hexdigest())
            print(len(reader), digests[0] == digests[1])
    """)
    args = [a for fmt in ("mds", "wds") for a in (fmt, str(output(prepared[fmt])), str(tmp_path / fmt))]
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for fmt, line in zip(("mds", "wds"), proc.stdout.splitlines(), strict=True):
        rows, same = line.split()
        assert int(rows) > 0 and same == "True"
        cached = sorted(p.name for p in (tmp_path / fmt / "train").glob("shard*"))
        assert cached == sorted(p.name for p in (output(prepared[fmt]) / "train").glob("shard*"))


# ------------------------------------------------------------- item 7: sizes read from files
def sparse_member(name: str, real_size: int, data: bytes) -> bytes:
    """A GNU sparse tar member (type 'S') storing ``data`` and declaring ``real_size`` bytes: tarfile's
    ``extractfile().read()`` fills the rest with zeros. tarfile cannot write one, so the header is patched."""
    info = tarfile.TarInfo(name)
    info.type, info.size = tarfile.GNUTYPE_SPARSE, len(data)
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))

    def octal(v: int) -> bytes:
        return b"%011o\0" % v

    header[386:410] = octal(0) + octal(len(data))  # one stored chunk at offset 0
    header[482], header[483:495] = 0, octal(real_size)  # not extended; the size it expands to
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header[:512])
    return bytes(header) + data + b"\0" * (-len(data) % 512)


def test_sparse_tar_member_declaring_2_gib_allocates_nothing(prepared: dict[str, DataConfig], tmp_path: Path) -> None:
    """A 2 KB shard whose one member is sparse and declares 2 GiB (2.1 GB resident before): the declared
    size is checked against the file and the rows the manifest expects before a byte is read."""
    root = tmp_path / "ds"
    shutil.copytree(output(prepared["wds"]), root)
    shard = root / "train" / "shard-000000.tar"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<u2", "fortran_order": False, "shape": (1 << 26, 17)})
    shard.write_bytes(sparse_member("0000000000.tokens.npy", 1 << 31, header.getvalue()) + b"\0" * 512)
    assert shard.stat().st_size < 2048

    def edit(m: dict[str, Any]) -> None:
        first = m["splits"]["train"]["shards"][0]
        first["bytes"], first["sha256"] = shard.stat().st_size, hashlib.sha256(shard.read_bytes()).hexdigest()
        first["samples"] = first["bytes"] // 34  # as many rows as the file could hold

    edit_manifest(root, edit)
    with pytest.raises(UserError) as err:
        read_all(stream(root, "wds"))
    assert "holds member '0000000000.tokens.npy'" in one_line(err)  # sparse: prepare-data never writes one


def test_npy_header_claiming_more_rows_than_its_member_is_refused(
    prepared: dict[str, DataConfig], tmp_path: Path
) -> None:
    """A regular member whose .npy header claims 2**26 rows in 34 bytes of data: np.load would size its
    buffer from the header; the header is checked against the bytes that follow."""
    root = tmp_path / "ds"
    shutil.copytree(output(prepared["wds"]), root)
    shard = root / "train" / "shard-000000.tar"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<u2", "fortran_order": False, "shape": (1 << 26, 17)})
    data = header.getvalue() + b"\0" * 34
    with tarfile.open(shard, "w") as tar:
        info = tarfile.TarInfo("0000000000.tokens.npy")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    def edit(m: dict[str, Any]) -> None:
        first = m["splits"]["train"]["shards"][0]
        first["bytes"], first["sha256"] = shard.stat().st_size, hashlib.sha256(shard.read_bytes()).hexdigest()
        first["samples"] = 1

    edit_manifest(root, edit)
    with pytest.raises(UserError) as err:
        read_all(stream(root, "wds"))
    assert "member 0000000000.tokens.npy declares shape (67108864, 17) in 34 bytes of data" in one_line(err)


@pytest.mark.parametrize("bytes_too", [False, True])
def test_manifest_sample_count_cannot_size_the_order(
    prepared: dict[str, DataConfig], tmp_path: Path, bytes_too: bool
) -> None:
    """A WebDataset manifest claiming 2**31 rows for its first shard: the epoch order table (one int64
    per row) asked for 14.9 GiB before any shard was read. A claim must fit the shard's bytes, and the
    bytes (``bytes_too``: also claimed) must be the file's before the order is built."""
    from elastic_pretrain.data.loader import TokenBatches

    root = tmp_path / "ds"
    shutil.copytree(output(prepared["wds"]), root)

    def edit(m: dict[str, Any]) -> None:
        first = m["splits"]["train"]["shards"][0]
        first["samples"] = 1 << 31
        if bytes_too:
            first["bytes"] = (1 << 31) * 34

    edit_manifest(root, edit)
    with pytest.raises(UserError) as err:
        TokenBatches(stream(root, "wds"), micro_batch_size=2, num_micro_batches=1, dp_rank=0, dp_size=1, seed=0)
    if bytes_too:
        assert f"has {(root / 'train' / 'shard-000000.tar').stat().st_size} bytes, the manifest says" in one_line(err)
    else:
        assert "claims 2147483648 rows of 34 bytes" in one_line(err) and "more than it can hold" in str(err.value)


def parquet_bomb(path: Path) -> None:
    """620 bytes: one 4 MiB string in a dictionary page, named by 1024 rows' indices (4 GiB as text)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.DictionaryArray.from_arrays(pa.array([0] * 1024, pa.int32()), pa.array(["a" * (4 << 20)]))
    pq.write_table(pa.table({"text": column}), path, compression="zstd")


def test_parquet_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A 620-byte Parquet file whose text column expands to 4 GiB: prepare-data stops at 100x the file
    (at least 64 MiB of text), and the process never holds more than a few rows."""
    parquet_bomb(tmp_path / "bomb.parquet")
    assert (tmp_path / "bomb.parquet").stat().st_size < 2048
    script = textwrap.dedent("""
        import sys
        from elastic_pretrain.data.config import PrepareConfig
        from elastic_pretrain.data.sources import iter_documents
        from elastic_pretrain.errors import UserError
        cfg = PrepareConfig(source="files", inputs=[sys.argv[1]], output=sys.argv[2])
        try:
            print(sum(len(text) for _, text in iter_documents(cfg, {})))
        except UserError as err:
            print(err)
        # this process's own peak (VmHWM): ru_maxrss would also count the forked parent's pages (pytest's)
        print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) // 1024)
    """)
    args = [sys.executable, "-c", script, str(tmp_path / "bomb.parquet"), str(tmp_path / "out")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    message, peak_mib = proc.stdout.strip().splitlines()
    assert "expands to more than 67,108,864 characters" in message and "compression bomb" in message
    assert int(peak_mib) < 512, f"{peak_mib} MiB resident for a 620-byte file"


def test_good_parquet_still_reads(tmp_path: Path) -> None:
    """Plain, dictionary-encoded and null rows: every string row, in order, as before."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i} " * (i % 7 + 1) for i in range(3000)] + ["same text"] * 500 + [None]
    pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), tmp_path / "a.parquet", row_group_size=700)
    cfg = PrepareConfig(source="files", inputs=[str(tmp_path / "a.parquet")], output=str(tmp_path / "out"))
    docs = list(iter_documents(cfg, {}))
    assert docs == [(f"a.parquet:{i}", t) for i, t in enumerate(texts) if t is not None]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link", "dev-zero-input"])
def test_fifo_or_device_in_a_corpus_is_refused_not_read(tmp_path: Path, kind: str) -> None:
    """A FIFO (prepare-data blocked forever on it) or /dev/zero (endless) among the inputs: one line."""
    corpus = write_corpus(tmp_path / "corpus", n_files=3)
    odd = corpus / "part0" / "odd.txt"
    inputs = [str(corpus)]
    if kind == "fifo":
        os.mkfifo(odd)
        # the old code blocked in open(); a writer arriving later lets it go on (and fail the test)
        threading.Thread(target=_unblock, args=(odd,), daemon=True).start()
    elif kind == "dev-zero-link":
        odd.symlink_to("/dev/zero")
    else:
        odd, inputs = Path("/dev/zero"), [str(corpus), "/dev/zero"]
    cfg = recipe(tmp_path / "out", inputs)
    with pytest.raises(UserError) as err:
        prepare_data(cfg, progress=False)
    assert f"{odd} is not a regular file" in one_line(err) and "remove it from the corpus" in str(err.value)
    assert not (tmp_path / "out" / "manifest.json").exists()


def _unblock(fifo: Path) -> None:
    time.sleep(10)
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


# ---------------------------------------------------------- item 8: numbers nobody expects
@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: m["splits"]["train"]["shards"][0].update(samples=HUGE), "more than 4,300 digits"),
        (lambda m: m["splits"]["train"]["shards"][0].update(samples=10**30), "are not counts"),
        (lambda m: m.update(tokenizer=["byte"]), "tokenizer is list, not a mapping"),
        (lambda m: m.update(splits=[]), "'list' object has no attribute 'items'"),
    ],
    ids=["5000-digits", "beyond-int64", "tokenizer-list", "splits-list"],
)
def test_manifest_values_of_the_wrong_kind_are_one_line(
    prepared: dict[str, DataConfig], tmp_path: Path, edit: Any, needle: str
) -> None:
    root = tmp_path / "ds"
    shutil.copytree(output(prepared["mds"]), root)
    edit_manifest(root, edit)
    with pytest.raises(UserError) as err:
        read_all(stream(root))
    assert "malformed manifest" in one_line(err) and needle in str(err.value)


def test_mds_rows_past_the_end_of_a_shard_are_one_line(prepared: dict[str, DataConfig], tmp_path: Path) -> None:
    """The manifest and index.json claim 5 more rows for shard.00000.mds than the file holds (within what
    its bytes could hold, re-recorded everywhere): streaming read past the end of the file."""
    root = tmp_path / "ds"
    shutil.copytree(output(prepared["mds"]), root)
    index_path = root / "train" / "index.json"
    index = json.loads(index_path.read_text())
    index["shards"][0]["samples"] += 5
    index_path.write_text(json.dumps(index))

    def edit(m: dict[str, Any]) -> None:
        m["splits"]["train"]["shards"][0]["samples"] += 5
        m["splits"]["train"]["index_sha256"] = hashlib.sha256(index_path.read_bytes()).hexdigest()

    edit_manifest(root, edit)
    with pytest.raises(UserError) as err:
        read_all(stream(root))
    n = index["shards"][0]["samples"]
    assert f"shard shard.00000.mds has a header for {n - 5} rows, the manifest says {n}" in one_line(err)


def test_eval_without_data_uses_only_a_recipe_of_the_users_identical_to_the_checkpoints() -> None:
    """``eval`` without ``--data``: the user's own recipe is used only when it resolves to exactly the
    checkpoint's data section (then every location read is one the user's file states); a checkpoint whose
    data section differs in any location (``local: ~``, ``split``) matches nothing and eval asks for --data."""
    import dataclasses as dc

    from elastic_pretrain.data.recipes import load_recipe, matching_recipe

    mine = load_recipe("stdlib-code")
    found = matching_recipe(mine)
    assert found is not None and found[0].endswith("stdlib-code.yaml") and found[1] == mine
    assert mine.validation is not None
    for change in ({"local": "~"}, {"split": "ssh"}, {"path": "/elsewhere"}):
        theirs = dc.replace(mine, validation=dc.replace(mine.validation, **change))
        assert matching_recipe(theirs) is None, change
