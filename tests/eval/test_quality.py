"""FLOPs per token against torch's FLOP counter, AUC against hand-computed values, loss per loop count."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from elastic_pretrain.eval.quality import (
    CurvePoint,
    QualityCurve,
    auc,
    compare,
    evaluate_loops,
    flops_per_token,
    markdown_table,
    quality_curve,
    relative_compute,
    token_ce,
)
from elastic_pretrain.model.config import ModelConfig
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


def test_auc_hand_computed():
    assert auc([0.5, 1.0], [2.0, 1.0]) == pytest.approx(1.5, abs=1e-12)
    # non-uniform spacing: (0.25·2.5 + 0.5·1.75) / 0.75
    assert auc([0.25, 0.5, 1.0], [3.0, 2.0, 1.5]) == pytest.approx(2.0, abs=1e-12)
    # order of the points does not matter
    assert auc([1.0, 0.25, 0.5], [1.5, 3.0, 2.0]) == pytest.approx(2.0, abs=1e-12)
    # one point, and all points at one compute: the (mean) loss there
    assert auc([0.7], [2.5]) == 2.5
    assert auc([0.5, 0.5], [1.0, 3.0]) == 2.0
    # equal-compute points are averaged before integrating: (0,1),(0,3)->(0,2); (2,0)
    assert auc([0.0, 0.0, 2.0], [1.0, 3.0, 0.0]) == pytest.approx(1.0, abs=1e-12)
    # a sub-range interpolates at its ends: line (0,0)-(1,2) over [0.5, 1] averages 1.5
    assert auc([0.0, 1.0], [0.0, 2.0], lo=0.5, hi=1.0) == pytest.approx(1.5, abs=1e-12)
    assert auc([0.0, 1.0], [0.0, 2.0], lo=0.25, hi=0.25) == pytest.approx(0.5, abs=1e-12)
    for bad in (([], []), ([0.5], [1.0, 2.0]), ([0.5, math.nan], [1.0, 2.0])):
        with pytest.raises(ValueError):
            auc(*bad)
    with pytest.raises(ValueError, match="not inside"):
        auc([0.5, 1.0], [1.0, 1.0], lo=0.1)


def _curve(name: str, pts: list[tuple[float, float]]) -> QualityCurve:
    return QualityCurve(
        name=name, points=tuple(CurvePoint(loops=i + 1, relative_compute=c, loss=v) for i, (c, v) in enumerate(pts))
    )


def test_compare_uses_the_common_range_and_plots(tmp_path):
    a = _curve("a", [(0.25, 3.0), (0.5, 2.0), (1.0, 1.0)])
    b = _curve("b", [(0.5, 1.8), (1.0, 1.2)])
    png = tmp_path / "cmp.png"
    result = compare([a, b], png)
    assert (result.lo, result.hi) == (0.5, 1.0)
    assert result.aucs == pytest.approx((1.5, 1.5), abs=1e-12)  # a over [0.5, 1]: (2+1)/2
    assert result.relative == pytest.approx((0.0, 0.0), abs=1e-12)
    c = _curve("c", [(0.5, 1.2), (1.0, 0.6)])
    assert compare([a, c]).relative[1] == pytest.approx(0.9 / 1.5 - 1, abs=1e-12)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| b | 1.5000 | +0.00% |" in result.markdown()
    with pytest.raises(ValueError, match="share no compute range"):
        compare([_curve("x", [(0.1, 1.0), (0.2, 1.0)]), _curve("y", [(0.5, 1.0), (1.0, 1.0)])])


def test_markdown_table():
    text = markdown_table(
        QualityCurve(
            name="m",
            flops_max=1000.0,
            points=(
                CurvePoint(loops=2, relative_compute=1.0, loss=1.0),
                CurvePoint(loops=1, relative_compute=0.5, loss=2.0),
            ),
        )
    )
    lines = text.splitlines()
    assert lines[4] == f"| 1 | 500 | 0.500 | 2.0000 | {math.exp(2):.3f} |"  # sorted by compute
    assert lines[5].startswith("| 2 | 1,000 | 1.000 | 1.0000 |")
    assert "AUC (compute-averaged loss over [0.500, 1.000]): 1.5000" in text


def test_evaluate_loops_matches_the_model_and_separates_conditioned_runs(mesh1, tmp_path):
    cfg = tiny()
    model = build_model(cfg, PAR)
    tokens = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.eval()(tokens[:, :-1], loops=4, exits=[1, 2, 3])
        padded = model(tokens[:, :-1], labels=tokens[:, 1:], loops=4)[4].double().mean()
    got = evaluate_loops(model, tokens, batch_size=2)  # two batches: 2 + 1 sequences
    assert sorted(got) == [1, 2, 3, 4]
    for ell, e in got.items():
        assert e.tokens == 30
        ref = F.cross_entropy(logits[ell].flatten(0, 1).double(), tokens[:, 1:].flatten())
        assert e.loss == pytest.approx(float(ref), abs=1e-6)
        assert e.perplexity == pytest.approx(math.exp(e.loss))
    # the model's own loss: the padded vocabulary entries get -inf logits (no probability mass), so it
    # equals the loss over the real vocabulary up to float32 rounding
    assert float(padded) == pytest.approx(got[4].loss, abs=1e-6)
    # with active conditioning each ℓ is conditioned on itself: ℓ=1 must be its own run, not the L_max exit
    model.conditioning_active = True
    with torch.no_grad():
        model.loop_conditioning.out.weight.normal_(0, 0.5)
        own = token_ce(model(tokens[:, :-1], loops=1)[1], tokens[:, 1:]).double().mean()
        exit_of_4 = token_ce(model(tokens[:, :-1], loops=4, exits=[1])[1], tokens[:, 1:]).double().mean()
    cond = evaluate_loops(model, tokens, loops=[1])
    assert cond[1].loss == pytest.approx(float(own), abs=1e-6)
    assert abs(float(own) - float(exit_of_4)) > 1e-4
    model.conditioning_active = False
    curve = quality_curve(model, tokens)
    assert [p.loops for p in curve.points] == [1, 2, 3, 4]
    assert curve.points[-1].relative_compute == 1.0
    assert curve.points[0].loss == pytest.approx(got[1].loss, abs=1e-9)
    assert math.isfinite(curve.auc)
