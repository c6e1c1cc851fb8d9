"""Fixtures for the data tests: a private TMPDIR (streaming leaves file locks there) and small corpora."""

from __future__ import annotations

import base64
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_pretrain.config import build
from elastic_pretrain.data.config import DataConfig

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu",
         "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega", "größe",
         "naïve", "café", "東京", "λόγος"]  # fmt: skip


@pytest.fixture(autouse=True, scope="session")
def private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A TMPDIR private to this test session, so concurrent runs never share lock or temp files.

    Session-scoped (and so set up before the module-scoped corpus fixtures that already write shards).
    """
    tmp = tmp_path_factory.mktemp("tmpdir")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None
    yield
    if old is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None


def write_corpus(root: Path, n_files: int = 24, seed: int = 0) -> Path:
    """Text files of seeded random words (multi-byte UTF-8 included), varied lengths, in nested dirs."""
    rng = random.Random(seed)
    for i in range(n_files):
        path = root / f"part{i % 3}" / f"doc{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300))) + "\n", encoding="utf-8")
    return root


def recipe(out: Path, inputs: list[str], **over: Any) -> DataConfig:
    """A small recipe: seq_len 16, 32-row shards, 20% of the documents held out."""
    prepare = {
        "source": "files",
        "inputs": inputs,
        "output": str(out),
        "val_fraction": 0.2,
        "samples_per_shard": 32,
        **over.pop("prepare", {}),
    }
    raw: dict[str, Any] = {
        "format": "mds",
        "seq_len": 16,
        "streams": [{"path": str(out)}],
        "validation": {"path": str(out), "split": "val"},
        "prepare": prepare,
        **over,
    }
    return build(DataConfig, raw)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def prepared_mds(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> DataConfig:
    """One prepared MDS dataset shared by the read-only tests of a module."""
    from elastic_pretrain.data.prepare import prepare_data

    cfg = recipe(tmp_path_factory.mktemp("mds") / "ds", [str(corpus)])
    prepare_data(cfg, progress=False)
    return cfg


@pytest.fixture(scope="module")
def prepared_wds(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> DataConfig:
    """The same corpus as WebDataset tar shards, shuffled in windows of 2 shards."""
    from elastic_pretrain.data.prepare import prepare_data

    cfg = recipe(tmp_path_factory.mktemp("wds") / "ds", [str(corpus)], format="wds", wds_window=2)
    prepare_data(cfg, progress=False)
    return cfg


def write_ranks(path: Path) -> Path:
    """A tiny tiktoken ranks file: the 256 bytes plus merges al, ph, alph."""
    ranks = {bytes([b]): b for b in range(256)} | {b"al": 256, b"ph": 257, b"alph": 258}
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path
