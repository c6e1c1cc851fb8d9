"""FLOPs per token against torch's FLOP counter and a hand count (``model/flops.py``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.model.flops import flops_per_token, relative_compute
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig

PAR = ParallelConfig()


def tiny(**kw) -> ModelConfig:
    base = dict(
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        core_layers=2,
        num_experts=4,
        loops=2,
        flatten=2,
        moe_top_k=2,
        moe_ffn_hidden_size=32,
        prelude_layers=1,
        coda_layers=1,
        moe_z_loss_coeff=0.0,
    )
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [{}, {"edge_mlp": "moe", "flatten": 1, "prelude_layers": 2, "coda_layers": 0}])
def test_flops_formula_equals_torch_flop_counter(mesh1, kw):
    """megatron's local attention multiplies the full T×T scores: the 'full' context variant must match the
    matmul FLOPs torch counts in a real forward exactly, at every ℓ."""
    cfg = tiny(**kw)
    model = build_model(cfg, PAR).eval()
    b, t = 2, 12
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))
    for ell in range(1, cfg.max_loops + 1):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(ids, loops=ell)
        counted = counter.get_total_flops() / (b * t)
        assert (
            flops_per_token(cfg, ell, seq_len=t, padded_vocab=model.padded_vocab, attention_context="full") == counted
        )


def test_flops_hand_count_and_relative_compute():
    cfg = tiny()  # D=32, 1 prelude + 1 coda dense (F=64), 1 built core layer (8 experts, top-2, W=32), V_pad=384
    t = 15  # causal mean context (15+1)/2 = 8
    attn = 2 * 32 * 96 + 2 * 32 * 32 + 4 * 8 * 32
    dense = 2 * 3 * 32 * 64
    moe = 2 * 32 * 8 + 2 * 2 * 3 * 32 * 32
    for ell in (1, 4):
        assert flops_per_token(cfg, ell, seq_len=t) == 2 * (attn + dense) + ell * (attn + moe) + 2 * 32 * 384
    assert relative_compute(cfg, 4, seq_len=t) == 1.0
    rel = [relative_compute(cfg, ell, seq_len=t) for ell in (1, 2, 3, 4)]
    assert rel == sorted(rel) and rel[0] < 1
    with pytest.raises(ValueError, match="outside"):
        flops_per_token(cfg, 5, seq_len=t)
