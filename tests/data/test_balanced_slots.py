"""TokenBatches.next_step_slots: compute-balanced mixed depth deals the step's global batch by slots."""

from __future__ import annotations

import pytest
import torch

from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.loader import TokenBatches


def make(cfg: DataConfig, dp_rank: int) -> TokenBatches:
    return TokenBatches(cfg, micro_batch_size=2, num_micro_batches=2, dp_rank=dp_rank, dp_size=2, seed=7)


def test_slots_are_the_global_batch_dealt_and_the_position_is_unchanged(prepared_mds: DataConfig) -> None:
    plain, dealt = [make(prepared_mds, r) for r in range(2)], [make(prepared_mds, r) for r in range(2)]
    for hands in ([[0, 1, 2], [3]], [[3, 1], [0, 2]]):
        whole = torch.cat([torch.cat(ld.next_step()) for ld in plain]).split(2)  # slot s = rows 2s, 2s+1
        for ld, hand in zip(dealt, hands):
            got = ld.next_step_slots(hand)
            assert len(got) == len(hand)
            for slot, rows in zip(hand, got):
                torch.testing.assert_close(rows, whole[slot], rtol=0, atol=0)
        assert [ld.state_dict() for ld in dealt] == [ld.state_dict() for ld in plain]


def test_bad_slots_are_refused(prepared_mds: DataConfig) -> None:
    ld = make(prepared_mds, 0)
    for bad in ([4], [-1], [1, 1]):
        with pytest.raises(ValueError, match="distinct and in"):
            ld.next_step_slots(bad)
    assert ld.state_dict()["position"] == 0  # nothing consumed
