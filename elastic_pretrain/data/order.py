"""The global sample order: a pure function from a global position to (stream, sample index).

Nothing here has hidden state: the mixture (blocks of 4096 positions, each stream owning its weight's share of
slots) and each stream's epoch permutation derive from the position and the seeds, so the "RNG state" is just
``(seed, block, epoch)`` and a resumed loader, at any DP size, produces exactly the samples an uninterrupted one
would. Permutations are keyed Feistel networks with cycle-walking: O(1) memory for a billion samples.
docs/data.md, "Reading: `TokenBatches`" (Global order) and "Resuming".
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence

import numpy as np

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)
_ROUNDS = 6


def derive_key(*parts: object) -> int:
    """A 64-bit key from any labels (seed, stream, epoch, ...): stable across processes and runs."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    # splitmix64 finaliser of (x ^ key): a strong 64-bit mixer, used as the Feistel round function
    with np.errstate(over="ignore"):
        z = (x ^ key) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """``π(index)`` for a seeded bijection π of ``range(n)`` (vectorised; any ``index`` values in range)."""
    if n <= 1:
        return np.zeros_like(index, dtype=np.int64)
    half = max(1, math.ceil(math.log2(n) / 2))
    lo_mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(derive_key(key, r)) for r in range(_ROUNDS)]
    x = index.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    # cycle-walking: the Feistel domain is 4**half >= n; re-apply until the value falls inside range(n)
    while todo.any():
        v = x[todo]
        left, right = v >> np.uint64(half), v & lo_mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & lo_mask)
        v = (left << np.uint64(half)) | right
        x[todo] = v
        todo[todo] = v >= np.uint64(n)
    return x.astype(np.int64)


def mixture_counts(weights: Sequence[float], block: int) -> list[int]:
    """Slots per stream in one mixture block (largest-remainder rounding of ``block·w``, each >= 1)."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    exact = w * block
    counts = np.maximum(np.floor(exact).astype(np.int64), 1)
    spare = block - int(counts.sum())
    for i in np.argsort(-(exact - np.floor(exact)), kind="stable")[: max(0, spare)]:
        counts[i] += 1
    if int(counts.sum()) != block:
        raise ValueError(f"{len(weights)} streams do not fit a mixture block of {block}")
    return [int(c) for c in counts]


class StreamOrder:
    """Stream-local position -> sequence index for one stream (see module docstring, step 2)."""

    def __init__(
        self, size: int, key: int, shard_offsets: Sequence[int] | np.ndarray | None = None, window: int = 1
    ) -> None:
        self.size, self.key = size, key
        self.offsets = None if shard_offsets is None else np.asarray(shard_offsets, dtype=np.int64)
        self.window = window

    def __call__(self, pos: np.ndarray) -> np.ndarray:
        epoch, r = np.divmod(pos, self.size)
        out = np.empty_like(pos)
        for e in np.unique(epoch):
            sel = epoch == e
            if self.offsets is None:
                out[sel] = permute(r[sel], self.size, derive_key(self.key, int(e)))
            else:
                out[sel] = self._windowed(int(e))[r[sel]]
        return out

    @functools.lru_cache(maxsize=2)  # noqa: B019 — two epochs live at once across an epoch boundary
    def _windowed(self, epoch: int) -> np.ndarray:
        """WDS epoch order: shards permuted, samples permuted within each window of shards.

        The table has one entry per sample of the stream (a WDS stream is read whole each epoch anyway).
        """
        assert self.offsets is not None
        n_shards = len(self.offsets) - 1
        shard_perm = permute(np.arange(n_shards), n_shards, derive_key(self.key, epoch, "shards"))
        parts = []
        for w0 in range(0, n_shards, self.window):
            members = np.concatenate(
                [np.arange(self.offsets[k], self.offsets[k + 1]) for k in shard_perm[w0 : w0 + self.window]]
            )
            inner = permute(np.arange(len(members)), len(members), derive_key(self.key, epoch, "window", w0))
            parts.append(members[inner])
        return np.concatenate(parts)


class MixtureOrder:
    """Global position -> (stream index, sequence index within the stream's split).

    Positions come in blocks of ``block``; stream i owns ``c_i`` slots of every block, placed by a
    seeded permutation of the block. The k-th slot of stream i (in position order) is stream-local
    position ``blk·c_i + k``, so each stream is consumed in its own order without gaps or repeats,
    and locality inside a stream (WebDataset windows) survives the mixing.
    """

    def __init__(self, streams: Sequence[StreamOrder], weights: Sequence[float], key: int, block: int = 4096) -> None:
        self.streams = list(streams)
        self.block = block
        self.counts = mixture_counts(weights, self.block)
        self.bounds = np.cumsum([0, *self.counts])
        self.key = key

    @functools.lru_cache(maxsize=4)  # noqa: B019 — a step touches one or two blocks
    def _layout(self, blk: int) -> tuple[np.ndarray, np.ndarray]:
        """(stream, rank among that stream's slots) for every offset of block ``blk``."""
        slot = permute(np.arange(self.block), self.block, derive_key(self.key, "mix", blk))
        stream = np.searchsorted(self.bounds, slot, side="right") - 1
        rank = np.empty(self.block, dtype=np.int64)
        for i in range(len(self.streams)):
            sel = stream == i
            rank[sel] = np.arange(int(sel.sum()))
        return stream, rank

    def stream_positions(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stream, stream-local position) for global positions."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(self.streams) == 1:  # nothing to mix: the stream-local position is the global one
            return np.zeros_like(positions), positions
        blk, offset = np.divmod(positions, self.block)
        stream = np.empty_like(positions)
        local = np.empty_like(positions)
        for b in np.unique(blk):
            sel = blk == b
            s, r = self._layout(int(b))
            stream[sel] = s[offset[sel]]
            local[sel] = int(b) * np.asarray(self.counts)[stream[sel]] + r[offset[sel]]
        return stream, local

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        stream, local = self.stream_positions(positions)
        index = np.empty_like(local)
        for i, order in enumerate(self.streams):
            sel = stream == i
            if sel.any():
                index[sel] = order(local[sel])
        return stream, index

    def epochs(self, position: int) -> list[int]:
        """Each stream's epoch at a global position (how often it has been read through)."""
        blk = position // self.block
        return [blk * c // s.size for c, s in zip(self.counts, self.streams)]
