"""The one evaluator, ``loss_by_loops``: the model's own loss per loop count (one process here; the
distributed and pipeline paths run in the trainer's validation, tests/train and tests/parallel)."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

from elastic_pretrain.config import ConfigError
from elastic_pretrain.eval.loss import loss_by_loops, quality_curve
from elastic_pretrain.model.losses import token_ce
from elastic_pretrain.parallel.megatron import build_model
from tests.eval.conftest import PAR, tiny


def test_loss_by_loops_is_the_real_vocabulary_ce_and_separates_conditioned_runs(mesh1):
    cfg = tiny()
    model = build_model(cfg, PAR)
    tokens = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.eval()(tokens[:, :-1], loops=4, exits=[1, 2, 3])  # full-vocabulary logits, real ids only
    got = loss_by_loops(model, tokens, batch_size=2)  # two batches: 2 + 1 sequences
    assert sorted(got) == [1, 2, 3, 4]
    for ell, loss in got.items():
        # the model's own loss (vocab-parallel CE over the padded vocabulary): the padding logits are -inf
        # (no probability mass), so it is the cross-entropy over the real vocabulary up to float32 rounding
        ref = token_ce(logits[ell].double(), tokens[:, 1:]).mean()
        assert loss == pytest.approx(float(ref), abs=1e-6)
    # with active conditioning each ℓ is conditioned on itself: ℓ=1 must be its own run, not the L_max exit
    model.set_modes(conditioning=True)
    with torch.no_grad():
        model.loop_conditioning.out.weight.normal_(0, 0.5)
        own = token_ce(model(tokens[:, :-1], loops=1)[1], tokens[:, 1:]).double().mean()
        exit_of_4 = token_ce(model(tokens[:, :-1], loops=4, exits=[1])[1], tokens[:, 1:]).double().mean()
    cond = loss_by_loops(model, tokens, [1])
    assert cond[1] == pytest.approx(float(own), abs=1e-6)
    assert abs(float(own) - float(exit_of_4)) > 1e-4
    model.set_modes(conditioning=False)
    curve = quality_curve(model, tokens, batch_size=2)
    assert [p.loops for p in curve.points] == [1, 2, 3, 4]
    assert curve.points[-1].relative_compute == 1.0
    assert curve.points[0].loss == pytest.approx(got[1], abs=1e-9)
    assert math.isfinite(curve.auc)
    with pytest.raises(ConfigError, match=r"loops=5 is outside \[1, 4\]"):
        loss_by_loops(model, tokens, [5])


def test_loss_by_loops_leaves_the_model_as_it_found_it(mesh1):
    """Training validation calls it between steps: the train mode comes back, gradients stay untouched and
    the MoE aux-loss tracker holds nothing of the evaluation (it would be logged as the next step's)."""
    torch.manual_seed(0)
    model = build_model(tiny(moe_z_loss_coeff=1e-3), PAR).train()
    tokens = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(2))
    got = loss_by_loops(model, tokens)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(not bool(entry["values"].any()) for entry in get_moe_layer_wise_logging_tracker().values())
    model.eval()
    assert loss_by_loops(model, tokens) == got and not model.training  # train/eval mode changes nothing here
