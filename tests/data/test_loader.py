"""TokenBatches: per-rank slices, epoch coverage, exact resume across DP sizes, fixed validation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.loader import TokenBatches, check_compatible, load_validation, read_manifest
from elastic_pretrain.data.shards import SplitReader
from elastic_pretrain.data.tokenizer import ByteTokenizer
from elastic_pretrain.errors import UserError

G = 8  # global batch size used throughout: (mbs, micro-batches, dp) = (4, 2, 1) | (2, 2, 2) | (1, 2, 4)


def make(cfg: DataConfig, dp_size: int, dp_rank: int = 0, seed: int = 7) -> TokenBatches:
    return TokenBatches(
        cfg, micro_batch_size=G // (2 * dp_size), num_micro_batches=2, dp_rank=dp_rank, dp_size=dp_size, seed=seed
    )


def global_step(loaders: list[TokenBatches]) -> torch.Tensor:
    """Concatenate the ranks' micro-batches of one step in rank order."""
    return torch.cat([torch.cat(ld.next_step()) for ld in loaders])


def test_step_shapes_and_rank_slices_union_to_global_batch(prepared_mds: DataConfig) -> None:
    single = make(prepared_mds, 1)
    ranks = [make(prepared_mds, 2, r) for r in range(2)]
    for _ in range(3):
        micro = ranks[0].next_step()
        assert len(micro) == 2 and all(m.shape == (2, 17) and m.dtype == torch.int64 for m in micro)
        both = torch.cat([torch.cat(micro), torch.cat(ranks[1].next_step())])
        torch.testing.assert_close(both, torch.cat(single.next_step()), rtol=0, atol=0)
    assert single.state_dict()["position"] == 3 * G == ranks[1].state_dict()["position"]


def test_one_epoch_visits_every_sequence_once(prepared_mds: DataConfig) -> None:
    loader = make(prepared_mds, 1)
    n = len(loader.readers[0])
    stream, index = loader.order(np.arange(n))
    assert (stream == 0).all() and sorted(index.tolist()) == list(range(n))
    assert index.tolist() != list(range(n))  # shuffled
    _, next_epoch = loader.order(np.arange(n, 2 * n))
    assert sorted(next_epoch.tolist()) == list(range(n)) and next_epoch.tolist() != index.tolist()
    other_seed = make(prepared_mds, 1, seed=8)
    assert other_seed.order(np.arange(n))[1].tolist() != index.tolist()


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (4, 2)])
def test_resume_is_exact_at_another_dp_size(prepared_mds: DataConfig, before: int, after: int) -> None:
    reference = make(prepared_mds, 1)
    expected = [torch.cat(reference.next_step()) for _ in range(5)]
    first = [make(prepared_mds, before, r) for r in range(before)]
    seen = [global_step(first) for _ in range(3)]
    state = json.loads(json.dumps(first[0].state_dict()))  # what a checkpoint stores
    assert all(ld.state_dict() == state for ld in first)
    resumed = [make(prepared_mds, after, r) for r in range(after)]
    for ld in resumed:
        ld.load_state_dict(state)
    seen += [global_step(resumed) for _ in range(2)]
    for got, want in zip(seen, expected):
        assert torch.equal(got, want)


def test_state_for_another_order_is_refused(prepared_mds: DataConfig) -> None:
    state = make(prepared_mds, 1, seed=1).state_dict()
    other = make(prepared_mds, 1, seed=2)
    with pytest.raises(UserError, match="different data order"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)
    assert other.position == state["position"]


def test_validation_is_fixed_stored_order(prepared_mds: DataConfig) -> None:
    val = load_validation(prepared_mds, num_sequences=3)
    assert val.shape == (3, 17) and val.dtype == torch.int64
    assert torch.equal(val, load_validation(prepared_mds, num_sequences=3))
    assert prepared_mds.validation is not None
    reader = SplitReader(prepared_mds, prepared_mds.validation, ByteTokenizer())
    assert torch.equal(val, torch.from_numpy(np.stack([reader.get(i) for i in range(3)]).astype(np.int64)))
    # (that the val split holds exactly the held-out documents is checked in test_prepare)
    with pytest.raises(UserError, match="validation sequences"):
        load_validation(prepared_mds, num_sequences=10_000)


def test_manifest_compatibility_checks(prepared_mds: DataConfig) -> None:
    assert prepared_mds.prepare is not None
    manifest = read_manifest(prepared_mds.prepare.output)
    check_compatible(manifest, seq_len=16, tokenizer=ByteTokenizer())
    with pytest.raises(UserError, match=r"seq_len 16.*data\.seq_len=16"):
        check_compatible(manifest, seq_len=32, tokenizer=ByteTokenizer())
