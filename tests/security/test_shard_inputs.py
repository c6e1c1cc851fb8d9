"""Hostile datasets (issue 13, cases 2 and 3): a WebDataset tar with pickled members, an MDS
``index.json`` declaring a pickled column, an ``index.json`` swapped behind the manifest, and manifest
shard names that leave the cache. Each is built from real shards that prepare-data wrote, tampered
as an attacker who controls the dataset (or only one file of it) would; reading must run nothing,
touch nothing outside the cache, and fail with one line naming the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest

from elastic_pretrain.config import build
from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.prepare import prepare_data
from elastic_pretrain.data.shards import SplitReader
from elastic_pretrain.data.tokenizer import load_tokenizer
from elastic_pretrain.errors import UserError
from tests.data.conftest import recipe, write_corpus


class _RunsCommand:
    """Pickles to ``os.system(command)``: what a pickled shard member or column runs when loaded."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DataConfig]:
    """The same small corpus prepared as MDS and as WebDataset shards (real prepare-data output)."""
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"))
    out = {}
    for fmt in ("mds", "wds"):
        cfg = recipe(tmp_path_factory.mktemp(fmt) / "ds", [str(corpus)], format=fmt)
        prepare_data(cfg, progress=False)
        out[fmt] = cfg
    return out


def copy_of(cfg: DataConfig, dest: Path, **stream: str) -> DataConfig:
    assert cfg.prepare is not None
    shutil.copytree(cfg.prepare.output, dest)
    return build(DataConfig, {"format": cfg.format, "seq_len": cfg.seq_len, "streams": [{"path": str(dest), **stream}]})


def read_all(cfg: DataConfig) -> int:
    reader = SplitReader(cfg, cfg.streams[0], load_tokenizer(cfg.tokenizer))
    for i in range(len(reader)):
        reader.get(i)
    return len(reader)


def rewrite_manifest(root: Path, edit: Any) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def rerecord(root: Path, split: str, name: str) -> None:
    """Record a replaced shard's size and sha256 in the manifest (the attacker owns the manifest too)."""
    data = (root / split / name).read_bytes()

    def edit(m: dict[str, Any]) -> None:
        for shard in m["splits"][split]["shards"]:
            if shard["name"] == name:
                shard["bytes"], shard["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        if m["splits"][split].get("index_sha256"):  # MDS manifests that hash index.json
            index = (root / split / "index.json").read_bytes()
            m["splits"][split]["index_sha256"] = hashlib.sha256(index).hexdigest()

    rewrite_manifest(root, edit)


def one_line(err: pytest.ExceptionInfo[UserError]) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


def read_error(cfg: DataConfig, marker: Path) -> str:
    """Reading ``cfg`` ran no command (checked first: the old code ran it, then often read on) and
    failed with one line, which is returned."""
    error: Exception | None = None
    try:
        read_all(cfg)
    except Exception as err:  # the old code failed with whatever the unpickled object broke
        error = err
    assert not marker.exists(), "the data ran a shell command"
    assert isinstance(error, UserError) and "\n" not in str(error), repr(error)
    return str(error)


# ------------------------------------------------------------- case 2: WebDataset members
@pytest.mark.parametrize("suffix", ["pyd", "pkl", "pth"])
def test_wds_member_that_unpickles_runs_nothing(prepared: dict[str, DataConfig], tmp_path: Path, suffix: str) -> None:
    """shard-000000.tar gains ``0000000000.<suffix>`` beside the tokens: webdataset's default decoders
    would ``pickle.loads`` a .pyd/.pkl and ``torch.load(weights_only=False)`` a .pth member."""
    import torch

    cfg = copy_of(prepared["wds"], tmp_path / "ds")
    root, marker = tmp_path / "ds", tmp_path / "PWNED"
    shard = root / "train" / "shard-000000.tar"
    with tarfile.open(shard) as tar:
        first = tar.getnames()[0]
    payload = io.BytesIO()
    if suffix == "pth":
        torch.save(_RunsCommand(f"touch {marker}"), payload)
    else:
        pickle.dump(_RunsCommand(f"touch {marker}"), payload)
    with tarfile.open(shard, "a") as tar:
        info = tarfile.TarInfo(first.replace("tokens.npy", suffix))
        info.size = len(payload.getvalue())
        tar.addfile(info, io.BytesIO(payload.getvalue()))
    rerecord(root, "train", shard.name)
    msg = read_error(cfg, marker)
    assert f"shard {shard.name} holds member '{first.replace('tokens.npy', suffix)}'" in msg and "re-run" in msg


# --------------------------------------------------------------------- case 2: MDS columns
def _pickled_mds_shard(directory: Path, marker: Path, samples: int) -> dict[str, Any]:
    """An MDS shard of ``samples`` rows whose one column ``tokens`` is encoded ``pkl``; its index entry."""
    from elastic_pretrain.data.streaming_compat import import_streaming

    import_streaming()
    from streaming.base.format.mds.writer import MDSWriter

    with MDSWriter(out=str(directory), columns={"tokens": "pkl"}, compression=None, progress_bar=False) as w:
        for _ in range(samples):
            w.write({"tokens": _RunsCommand(f"touch {marker}")})
    return json.loads((directory / "index.json").read_text())["shards"][0]


def test_mds_index_declaring_pkl_runs_nothing(prepared: dict[str, DataConfig], tmp_path: Path) -> None:
    """The attacker swaps shard.00000.mds for one with a ``pkl`` column, declares it in index.json and
    re-records everything in the manifest (index.json's hash included)."""
    cfg = copy_of(prepared["mds"], tmp_path / "ds")
    root, marker = tmp_path / "ds", tmp_path / "PWNED"
    index = json.loads((root / "train" / "index.json").read_text())
    entry = _pickled_mds_shard(tmp_path / "evil", marker, index["shards"][0]["samples"])
    shutil.copy(tmp_path / "evil" / entry["raw_data"]["basename"], root / "train" / "shard.00000.mds")
    index["shards"][0] = {**entry, "raw_data": {**entry["raw_data"], "basename": "shard.00000.mds"}}
    (root / "train" / "index.json").write_text(json.dumps(index))
    rerecord(root, "train", "shard.00000.mds")
    msg = read_error(cfg, marker)
    assert "index.json declares shard.00000.mds with column_encodings=['pkl']" in msg and "re-run prepare-data" in msg


def test_mds_index_swapped_behind_the_manifest_is_refused(prepared: dict[str, DataConfig], tmp_path: Path) -> None:
    """Only index.json changes (a mirror serving another one): the manifest's checksum catches it."""
    cfg = copy_of(prepared["mds"], tmp_path / "ds")
    path = tmp_path / "ds" / "train" / "index.json"
    index = json.loads(path.read_text())
    index["shards"][0]["column_encodings"] = ["pkl"]
    path.write_text(json.dumps(index))
    with pytest.raises(UserError) as err:
        read_all(cfg)
    assert "index.json fails its sha256 checksum" in one_line(err)


def test_manifest_without_index_hash_names_the_fix_and_prepare_data_adds_it(
    prepared: dict[str, DataConfig], tmp_path: Path
) -> None:
    """A manifest written before index.json was hashed: reading names the fix; the fix re-tokenises
    nothing (the shards stay byte-identical) and afterwards the data reads again."""
    cfg = copy_of(prepared["mds"], tmp_path / "ds")
    root = tmp_path / "ds"
    rewrite_manifest(root, lambda m: [s.pop("index_sha256") for s in m["splits"].values()])
    with pytest.raises(UserError) as err:
        read_all(cfg)
    assert "no checksum of index.json" in one_line(err) and "prepare-data" in str(err.value)
    before = {p.name: p.stat().st_mtime_ns for p in (root / "train").iterdir()}
    prep = prepared["mds"].prepare
    assert prep is not None
    again = dataclasses.replace(prepared["mds"], prepare=dataclasses.replace(prep, output=str(root)))
    prepare_data(again, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in (root / "train").iterdir()} == before
    assert read_all(cfg) > 0


# ------------------------------------------------------------------ case 3: manifest names
@pytest.mark.parametrize("form", ["dotdot", "absolute"])
def test_manifest_shard_name_outside_the_cache_deletes_nothing(
    prepared: dict[str, DataConfig], tmp_path: Path, form: str
) -> None:
    """A remote stream (cached under ``local``) whose manifest names ``../../victim`` or ``/abs/victim``
    with a wrong checksum: the refetch of a "damaged" cached copy would delete and overwrite it."""
    src, cache = tmp_path / "remote", tmp_path / "cache"
    assert prepared["mds"].prepare is not None
    shutil.copytree(prepared["mds"].prepare.output, src)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    name = "../../victim" if form == "dotdot" else str(victim)

    def edit(m: dict[str, Any]) -> None:
        m["splits"]["train"]["shards"][0]["name"] = name

    rewrite_manifest(src, edit)
    cfg = build(DataConfig, {"seq_len": 16, "streams": [{"path": str(src), "local": str(cache)}]})
    with pytest.raises(UserError) as err:
        read_all(cfg)
    assert victim.read_text() == "precious\n", "a manifest name deleted or replaced a file outside the cache"
    assert repr(name) in one_line(err) and "not a plain file name" in str(err.value)


def test_good_shards_still_read(prepared: dict[str, DataConfig], tmp_path: Path) -> None:
    """Both formats, local and through the cache: the checks above refuse nothing prepare-data writes."""
    for fmt, cfg in prepared.items():
        assert read_all(cfg) > 0 and cfg.prepare is not None
        stream = {"path": cfg.prepare.output, "local": str(tmp_path / fmt)}
        cached = build(DataConfig, {"format": fmt, "seq_len": 16, "streams": [stream]})
        assert read_all(cached) == read_all(cfg)
