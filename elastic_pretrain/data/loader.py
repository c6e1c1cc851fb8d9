"""Training-side reader: per-step token batches for one data-parallel rank, exactly resumable.

The trainer calls only :class:`TokenBatches` (``next_step``, ``state_dict``, ``load_state_dict``) and
:func:`load_validation`. Step ``k`` consumes global positions ``[k·G, (k+1)·G)`` of ``order.py``'s order, each
DP rank a contiguous slice; the state is the next global position, so a checkpoint resumes bit-identically at
another DP size with the same ``G``. Only the data-parallel rank matters: TP/PP/EP ranks of a replica read alike.
docs/data.md, "Reading: `TokenBatches`" (the contract and the global order) and "Resuming".
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from elastic_pretrain.config import show
from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.manifest import Manifest, check_compatible, read_manifest
from elastic_pretrain.data.order import MixtureOrder, StreamOrder, derive_key
from elastic_pretrain.data.shards import SplitReader
from elastic_pretrain.data.tokenizer import load_tokenizer
from elastic_pretrain.errors import UserError
from elastic_pretrain.jsonsafe import count, mapping

__all__ = ["Manifest", "TokenBatches", "check_compatible", "load_validation", "read_manifest"]
log = logging.getLogger(__name__)
STATE_VERSION = 1


class TokenBatches:
    """This DP rank's micro-batches, step by step, from the weighted mixture of ``cfg.streams``."""

    def __init__(
        self, cfg: DataConfig, *, micro_batch_size: int, num_micro_batches: int, dp_rank: int, dp_size: int, seed: int
    ) -> None:
        if micro_batch_size < 1 or num_micro_batches < 1:
            raise UserError("micro_batch_size and num_micro_batches must be >= 1; fix the train config")
        if not 0 <= dp_rank < dp_size:
            raise UserError(f"dp_rank {dp_rank} is outside [0, {dp_size}); pass the data-parallel rank")
        self.cfg, self.seed = cfg, seed
        self.micro_batch_size, self.num_micro_batches = micro_batch_size, num_micro_batches
        self.dp_rank, self.dp_size = dp_rank, dp_size
        tokenizer = load_tokenizer(cfg.tokenizer)
        self.readers = [SplitReader(cfg, s, tokenizer) for s in cfg.streams]
        key = derive_key("elastic-pretrain", cfg.shuffle_seed, seed)
        streams = [
            StreamOrder(
                len(r),
                derive_key(key, i),
                shard_offsets=r.shard_offsets if cfg.format == "wds" else None,
                window=cfg.wds_window,
            )
            for i, r in enumerate(self.readers)
        ]
        self.order = MixtureOrder(streams, [s.weight for s in cfg.streams], key)
        self.position = 0  # the next global sample position

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.dp_size

    @property
    def local_batch_size(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    def samples(self, positions: np.ndarray) -> np.ndarray:
        """Rows ``[len(positions), seq_len+1]`` for global positions (any rank may ask for any)."""
        stream, index = self.order(positions)
        out = np.empty((len(positions), self.cfg.seq_len + 1), dtype=np.int64)
        for row, (s, i) in enumerate(zip(stream.tolist(), index.tolist())):
            out[row] = self.readers[s].get(i)
        return out

    def next_step(self) -> list[torch.Tensor]:
        """This rank's ``num_micro_batches`` tensors of the next optimizer step; advances the position."""
        start = self.position + self.dp_rank * self.local_batch_size
        rows = torch.from_numpy(self.samples(np.arange(start, start + self.local_batch_size, dtype=np.int64)))
        self.position += self.global_batch_size
        return list(rows.split(self.micro_batch_size))

    def next_step_slots(self, slots: list[int]) -> list[torch.Tensor]:
        """Micro-batches ``slots`` (indices into the next step's global batch, in micro-batch units, as
        ``next_step`` cuts it: rank r's are ``r·m .. r·m+m-1``) of the next optimizer step; advances the
        position by the global batch as ``next_step`` does. Compute-balanced mixed depth
        (``schedule.balance: compute``) deals replicas different numbers of the step's micro-batches;
        the global batch, the position and so resume are unchanged."""
        b, n_slots = self.micro_batch_size, self.num_micro_batches * self.dp_size
        bad = [s for s in slots if not 0 <= s < n_slots]
        if bad or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots}: each must be distinct and in [0, {n_slots})")
        positions = (self.position + np.asarray(slots, dtype=np.int64)[:, None] * b + np.arange(b)).reshape(-1)
        rows = torch.from_numpy(self.samples(positions))
        self.position += self.global_batch_size
        return list(rows.split(b))

    def _fingerprint(self) -> dict[str, Any]:
        """What the position means: changing any of it makes the saved position point elsewhere."""
        return {
            "shuffle_seed": self.cfg.shuffle_seed,
            "seed": self.seed,
            "format": self.cfg.format,
            "streams": [[s.path, s.split, s.weight, len(r)] for s, r in zip(self.cfg.streams, self.readers)],
        }

    def state_dict(self) -> dict[str, Any]:
        """The global position plus what it is relative to (JSON-serialisable; same on every DP rank).

        The mixture/shuffle RNG state is a function of (seeds, block, epoch), all of which follow from
        the position, so nothing else needs saving; ``epochs`` (per stream) and ``step`` are for humans.
        """
        return {
            "version": STATE_VERSION,
            "position": self.position,
            "global_batch_size": self.global_batch_size,
            "step": self.position // self.global_batch_size,
            "epochs": self.order.epochs(self.position),
            "order": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Continue from a saved position. ``strict`` refuses a state recorded for another data order."""
        position, batch = self.check_state(state)
        if strict and state.get("order") != self._fingerprint():
            raise UserError(
                "data state was saved for a different data order (streams, weights, seeds or shard "
                "contents changed); restore the recipe, or resume with a non-strict data state load "
                "to continue from the same position in the new order"
            )
        if batch != self.global_batch_size:
            log.warning(
                "global batch size changed %d -> %d: continuing from sample position %d",
                batch,
                self.global_batch_size,
                position,
            )
        self.position = position

    @staticmethod
    def check_state(state: Any) -> tuple[int, int]:
        """(position, global batch size) of a saved state; a position of 10**30 (an int64 overflow at the
        first batch) or a negative one (samples from the end of the order, silently) is a StateError."""
        state = mapping(state, "data")
        if state.get("version") != STATE_VERSION:
            raise UserError(
                f"data state version {show(state.get('version'))} is not {STATE_VERSION}; it was saved by "
                "another elastic-pretrain version"
            )
        return count(state, "position", "data"), count(state, "global_batch_size", "data", low=1)


def load_validation(cfg: DataConfig, *, num_sequences: int) -> torch.Tensor:
    """The first ``num_sequences`` held-out sequences in stored order: fixed, identical on every rank."""
    if cfg.validation is None:
        raise UserError("data.validation: not set; add validation: {path: <prepared dir>, split: val} to the recipe")
    reader = SplitReader(cfg, cfg.validation, load_tokenizer(cfg.tokenizer))
    if num_sequences > len(reader):
        raise UserError(
            f"{cfg.validation.path} [{cfg.validation.split}]: asks for {num_sequences} validation "
            f"sequences, {len(reader)} exist; lower the eval size or raise prepare.val_fraction"
        )
    rows = np.stack([reader.get(i) for i in range(num_sequences)]).astype(np.int64)
    return torch.from_numpy(rows)
