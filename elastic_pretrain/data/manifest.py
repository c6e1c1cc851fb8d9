"""``manifest.json``: what a prepared dataset holds and how to check it before training on it.

Layout written by ``prepare-data`` (the manifest is written last, atomically: it is the commit
marker, so a directory without one is an unfinished preparation)::

    <output>/manifest.json
    <output>/train/index.json, shard.00000.mds, ...     (format mds; index.json is streaming's)
    <output>/train/shard-000000.tar, ...                (format wds)
    <output>/val/...                                    (held-out documents, same layout)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from elastic_pretrain.data.config import is_data_name
from elastic_pretrain.data.tokenizer import Tokenizer
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import write_atomic
from elastic_pretrain.jsonsafe import loads as json_loads

MANIFEST = "manifest.json"
VERSION = 1
FORMATS = ("mds", "wds")
DTYPES = ("uint16", "uint32")  # token_dtype(): the only arrays prepare-data writes


def _is_count(v: object) -> bool:
    # below 2**63: counts become numpy int64 offsets (a 5000-digit "count" was an OverflowError)
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63


def _is_sha256(v: object) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


@dataclasses.dataclass(kw_only=True)
class ShardInfo:
    """One shard file of a split."""

    name: str
    samples: int
    bytes: int
    sha256: str


@dataclasses.dataclass(kw_only=True)
class SplitInfo:
    """One split (train / val): its shards in order and what they hold."""

    sequences: int
    tokens: int
    documents: int
    shards: list[ShardInfo]
    # sha256 of the split's MDS index.json (None for wds, and in manifests written before it was hashed)
    index_sha256: str | None = None
    # per-token difficulty files beside the shards, row for row (a synthetic source; data/difficulty.py)
    difficulty: list[ShardInfo] | None = None

    def shard_offsets(self) -> list[int]:
        """Global index of the first sample of each shard, plus the total at the end."""
        out = [0]
        for s in self.shards:
            out.append(out[-1] + s.samples)
        return out


@dataclasses.dataclass(kw_only=True)
class Manifest:
    """A prepared dataset: format, sequence length, tokenizer identity, splits with shard checksums."""

    format: str
    seq_len: int
    dtype: str
    tokenizer: dict[str, Any]  # kind, fingerprint, vocab_size, eos_id
    splits: dict[str, SplitInfo]
    recipe: dict[str, Any]  # the prepare settings that produced it (idempotence check)
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)  # informational: skipped files, time
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Manifest:
        def shards(infos: list[dict[str, Any]]) -> list[ShardInfo]:
            return [ShardInfo(**sh) for sh in infos]

        splits = {
            name: SplitInfo(**{**s, "shards": shards(s["shards"]),
                               "difficulty": None if s.get("difficulty") is None else shards(s["difficulty"])})
            for name, s in obj["splits"].items()
        }  # fmt: skip
        manifest = cls(**{**obj, "splits": splits})
        manifest.check_shape()
        return manifest

    def check_shape(self) -> None:
        """Every name a file path is built from is a plain file name, every count an integer that the
        shard's bytes can hold.

        Shard and split names come from a file that may be someone else's (docs/security.md):
        ``../x``, ``/abs`` or ``.ssh`` would make a refetch delete and rewrite a file outside the cache.
        Sample counts size the WebDataset order table (8 bytes per row): a shard of B bytes holds at most
        B / row-bytes rows, so a claim of 2**31 rows needs 2**31 rows' worth of (claimed) shard bytes."""
        if self.format not in FORMATS:
            raise TypeError(f"format {self.format!r} is not one of {', '.join(FORMATS)}")
        if not (_is_count(self.seq_len) and self.seq_len < 1 << 31) or self.dtype not in DTYPES:
            raise TypeError(f"seq_len {self.seq_len!r} / dtype {self.dtype!r} are not a length and {DTYPES}")
        for key in ("tokenizer", "recipe", "stats", "splits"):
            if not isinstance(getattr(self, key), dict):
                raise TypeError(f"{key} is {type(getattr(self, key)).__name__}, not a mapping")
        row = (self.seq_len + 1) * np.dtype(self.dtype).itemsize
        for split, info in self.splits.items():
            files = info.shards + (info.difficulty or [])  # difficulty files: one uint8 label per token
            names = [split] + [s.name for s in files]
            bad = next((n for n in names if not is_data_name(n)), None)
            if bad is not None:
                raise TypeError(f"{bad!r} is not a plain file name (letters, digits, '_', '-', inner '.')")
            if info.index_sha256 is not None and not _is_sha256(info.index_sha256):
                raise TypeError(f"splits.{split}.index_sha256 is not a sha256 hex digest")
            sized = [(s, row) for s in info.shards] + [(s, self.seq_len + 1) for s in info.difficulty or []]
            for s, width in sized:
                if not (_is_count(s.samples) and _is_count(s.bytes) and _is_sha256(s.sha256)):
                    raise TypeError(f"shard {s.name}: samples/bytes/sha256 are not counts and a hex digest")
                if s.samples * width > s.bytes:
                    raise TypeError(
                        f"shard {s.name} claims {s.samples} rows of {width} bytes in {s.bytes} bytes, "
                        "more than it can hold"
                    )

    def split(self, name: str, where: str) -> SplitInfo:
        if name not in self.splits:
            raise UserError(
                f"{where}: no split {name!r} (has {', '.join(sorted(self.splits))}); fix the stream's split"
            )
        return self.splits[name]


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read ``<dir>/manifest.json`` (or the file itself); a one-line UserError when absent or malformed."""
    p = Path(path)
    if p.is_dir() or p.name != MANIFEST:
        p = p / MANIFEST
    if not p.is_file():
        raise UserError(f"{p}: no manifest; run `elastic-pretrain prepare-data <recipe>` to build the shards")
    try:
        obj = json_loads(
            p.read_bytes(), f"{p}: malformed manifest", fix="delete the directory and run prepare-data again"
        )
        manifest = Manifest.from_json(obj)
    except UserError:  # jsonsafe: deep nesting, 5,000-digit integers, not JSON
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise UserError(f"{p}: malformed manifest ({err}); delete the directory and run prepare-data again") from None
    if manifest.version != VERSION:
        raise UserError(f"{p}: manifest version {manifest.version}, expected {VERSION}; run prepare-data again")
    return manifest


def write_manifest(manifest: Manifest, directory: Path) -> Path:
    """Write atomically (tmp + rename), so readers see either no manifest or a complete one."""
    write_atomic(directory / MANIFEST, json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n", root=directory)
    return directory / MANIFEST


def check_compatible(
    manifest: Manifest, *, seq_len: int, tokenizer: Tokenizer, where: str = "stream", fmt: str | None = None
) -> None:
    """Refuse shards made for another sequence length, tokenizer or format (one line, naming the fix)."""
    if manifest.seq_len != seq_len:
        raise UserError(
            f"{where}: shards hold seq_len {manifest.seq_len}, the job asks for {seq_len}; set "
            f"data.seq_len={manifest.seq_len} or re-run prepare-data with seq_len={seq_len} "
            "into a new output directory"
        )
    if manifest.tokenizer.get("fingerprint") != tokenizer.fingerprint:
        raise UserError(
            f"{where}: shards were tokenised by a different tokenizer ({manifest.tokenizer.get('kind')} "
            f"{str(manifest.tokenizer.get('fingerprint'))[:12]}, this one is {tokenizer.fingerprint[:12]}); "
            "use the manifest's tokenizer or re-run prepare-data with this one"
        )
    if fmt is not None and manifest.format != fmt:
        raise UserError(
            f"{where}: shards are {manifest.format}, the recipe says format: {fmt}; set "
            f"format: {manifest.format} or prepare {fmt} shards"
        )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_shard(path: Path, info: ShardInfo, mode: str) -> str | None:
    """None when the file matches the manifest; otherwise what is wrong (for the error / skip warning)."""
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != info.bytes:
        return f"has {size} bytes, the manifest says {info.bytes} (truncated or replaced)"
    if mode == "sha256" and sha256_file(path) != info.sha256:
        return "fails its sha256 checksum (corrupt or replaced)"
    return None
