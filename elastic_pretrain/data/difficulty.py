"""Per-token difficulty stored beside the tokens: sidecar arrays that evaluation reads, training never.

A synthetic source (``prepare.source: synthetic``, data/synthetic.py) knows how many sequential steps each
token needs. prepare-data packs those labels exactly as it packs the tokens and writes them per shard::

    <output>/<split>/difficulty.00000.npy     uint8 [rows, seq_len+1], row i labels token row i

one file per ``samples_per_shard`` rows whatever the shard format, listed in the manifest
(``splits.<split>.difficulty``: name, rows, bytes, sha256), so they go through the same checks as the
token shards (docs/security.md): a plain file name inside the split directory, its size and sha256, and
``np.load(allow_pickle=False)`` of exactly a ``uint8`` array of the token rows' shape. Row counts must
equal the token shards' one for one: labels that do not line up with the tokens are refused, not read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.manifest import ShardInfo, SplitInfo, check_compatible, sha256_file, verify_shard
from elastic_pretrain.data.shards import StreamFiles
from elastic_pretrain.data.tokenizer import load_tokenizer
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import atomic_file, ensure_dir

PATTERN = "difficulty.%05d.npy"
DTYPE = np.dtype(np.uint8)


class DifficultySink:
    """Label rows into ``difficulty.NNNNN.npy`` files of ``samples_per_shard`` rows (the last may be short)."""

    def __init__(self, directory: Path, *, sample_tokens: int, samples_per_shard: int) -> None:
        self.directory, self.n, self.sps = directory, sample_tokens, samples_per_shard
        self._pending: list[np.ndarray] = []
        self._shards: list[ShardInfo] = []

    def write(self, rows: np.ndarray) -> None:
        self._pending.append(rows.astype(DTYPE, copy=False))
        if sum(len(r) for r in self._pending) >= self.sps:
            self._drain(final=False)

    def _drain(self, *, final: bool) -> None:
        rows = np.concatenate(self._pending) if self._pending else np.empty((0, self.n), DTYPE)
        start = 0
        while len(rows) - start >= self.sps or (final and start < len(rows)):
            self._save(rows[start : start + self.sps])
            start += self.sps
        self._pending = [rows[start:]] if start < len(rows) else []

    def _save(self, block: np.ndarray) -> None:
        path = self.directory / (PATTERN % len(self._shards))
        root = self.directory.parent  # the dataset's output folder; the token sink made the split's (MDS: lazily)
        ensure_dir(self.directory, root=root)
        with atomic_file(path, root=root) as f:  # a planted name is replaced, never written through
            np.save(f, np.ascontiguousarray(block), allow_pickle=False)
        self._shards.append(ShardInfo(name=path.name, samples=len(block), bytes=path.stat().st_size,
                                      sha256=sha256_file(path)))  # fmt: skip

    def finish(self) -> list[ShardInfo]:
        self._drain(final=True)
        return self._shards


def load_difficulty(cfg: DataConfig, *, num_sequences: int) -> torch.Tensor | None:
    """The difficulty of the first ``num_sequences`` held-out rows (``load_validation``'s rows), uint8
    ``[n, seq_len+1]`` as int64; None when the validation stream's manifest has no difficulty."""
    if cfg.validation is None:
        raise UserError("data.validation: not set; add validation: {path: <prepared dir>, split: val} to the recipe")
    stream = cfg.validation
    files = StreamFiles(stream)
    manifest = files.manifest()
    split = manifest.split(stream.split, stream.path)
    if split.difficulty is None:
        return None
    where = f"{stream.path} [{stream.split}]"
    check_compatible(manifest, seq_len=cfg.seq_len, tokenizer=load_tokenizer(cfg.tokenizer), where=stream.path,
                     fmt=cfg.format)  # fmt: skip
    check_alignment(split, where)
    rows: list[np.ndarray] = []
    shape = (manifest.seq_len + 1,)
    for info in split.difficulty:
        if len(rows) >= num_sequences:
            break
        rows.extend(read_block(files.file(stream.split, info.name), info, shape, where, cfg.verify))
    if len(rows) < num_sequences:
        raise UserError(
            f"{where}: asks for {num_sequences} validation sequences, {len(rows)} have a difficulty; lower the eval "
            "size or raise prepare.val_fraction"
        )
    return torch.from_numpy(np.stack(rows[:num_sequences]).astype(np.int64))


def check_alignment(split: SplitInfo, where: str) -> None:
    """The difficulty files hold as many rows as the token shards, shard for shard (one line otherwise)."""
    assert split.difficulty is not None
    tokens = [s.samples for s in split.shards]
    labels = [s.samples for s in split.difficulty]
    if tokens != labels:
        raise UserError(
            f"{where}: the difficulty files hold {sum(labels)} rows in {len(labels)} file(s), the token shards "
            f"{sum(tokens)} in {len(tokens)}: they do not label these tokens; re-run prepare-data"
        )


def read_block(path: Path, info: ShardInfo, shape: tuple[int, ...], where: str, verify: str) -> list[np.ndarray]:
    """One difficulty file's rows, after its size/sha256 matched the manifest: a uint8 array
    ``[info.samples, *shape]``, never unpickled."""

    def refuse(why: str) -> UserError:
        return UserError(f"{where}: difficulty file {info.name} {why}; delete it and re-run prepare-data")

    problem = verify_shard(path, info, verify)
    if problem is not None:
        raise refuse(problem)
    try:
        block = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:  # a bad header, an object (pickled) array
        raise refuse(f"cannot be read ({type(err).__name__}: {err})") from None
    if not isinstance(block, np.ndarray) or block.dtype != DTYPE or block.shape != (info.samples, *shape):
        got = f"{block.dtype} {block.shape}" if isinstance(block, np.ndarray) else type(block).__name__
        raise refuse(f"holds {got}, not {DTYPE} rows of shape ({info.samples}, {', '.join(map(str, shape))})")
    return list(block)
