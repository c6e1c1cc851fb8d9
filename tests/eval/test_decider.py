"""The TaH2 iteration decider: lookahead labels vs a naive sorting loop, loss, adaptive-depth inference."""

from __future__ import annotations

import pytest
import torch

from elastic_pretrain.config import ConfigError
from elastic_pretrain.eval.adaptive import adaptive_eval, threshold_sweep
from elastic_pretrain.eval.loss import loss_by_loops, quality_curve
from elastic_pretrain.eval.report import plot_comparison
from elastic_pretrain.model.decider import DeciderConfig, IterationDecider, decider_loss, lookahead_labels
from elastic_pretrain.model.flops import relative_compute
from elastic_pretrain.model.inference import LoopedDecoder, generate, teacher_forced_loss
from tests.eval.conftest import TOL


def make_decider(model, *, spread: float = 0.0, **kw) -> IterationDecider:
    torch.manual_seed(1)
    dec = IterationDecider(DeciderConfig(**kw), hidden_size=model.cfg.hidden_size, max_loops=model.cfg.max_loops)
    if spread:  # a random decider whose probabilities spread over (0, 1): mixed depths
        with torch.no_grad():
            dec.fc2.weight.normal_(0.0, spread)
    return dec


def ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 257, (b, t), generator=torch.Generator().manual_seed(seed))


def naive_labels(ce: list[list[float]], coverage: float) -> list[list[bool]]:
    out = []
    for j in range(len(ce) - 1):
        gain = [a - b for a, b in zip(ce[j], ce[j + 1])]
        order = sorted(range(len(gain)), key=lambda i: -gain[i])  # stable: ties in token order
        total = 0.0
        for i in order:
            if gain[i] > 0:
                total += gain[i]
        row, acc = [False] * len(gain), 0.0
        for i in order:
            if gain[i] <= 0 or acc >= coverage * total:
                break
            row[i] = True
            acc += gain[i]
        out.append(row)
    return out


def test_default_labels_are_one_more_pass_lowers_the_loss():
    """TaH2's labels, the default (coverage 1): 'continue' exactly where the gain is positive — also a gain too small
    to move a running sum of much larger ones (the coverage cut's cumulative sum would drop it)."""
    ce = torch.tensor([[[5e16, 2.0, 1.0, 3.0]], [[1.0, 1.0, 2.0, 3.0 - 1e-6]]], dtype=torch.float64)  # [L=2, 1, 4]
    assert DeciderConfig().coverage == 1.0
    assert lookahead_labels(ce, DeciderConfig().coverage).tolist() == [[[True, True, False, True]]]
    assert lookahead_labels(ce, 0.9).tolist() == [[[True, False, False, False]]]  # the ablation: largest gains only


@pytest.mark.parametrize("coverage", [0.05, 0.5, 0.9, 1.0])
def test_lookahead_labels_match_a_naive_sorting_loop(coverage):
    g = torch.Generator().manual_seed(2)
    ce = torch.rand(4, 3, 7, generator=g, dtype=torch.float64) * 3
    ce[2] = ce[1]  # a pass without any gain: no "continue" label
    ce[3, 0, :4] = ce[2, 0, :4] - 0.25  # ties in gain
    got = lookahead_labels(ce, coverage)
    assert got.shape == (3, 3, 7) and got.dtype == torch.bool
    assert got.flatten(1).tolist() == naive_labels(ce.flatten(1).tolist(), coverage)
    assert not got[1].any()


def test_lookahead_labels_hand_example():
    ce = torch.tensor([[5.0, 5.0, 5.0, 5.0], [1.0, 4.0, 4.5, 6.0]])  # gains 4, 1, 0.5, -1 (total positive 5.5)
    assert lookahead_labels(ce, 0.7)[0].tolist() == [True, False, False, False]  # 4 >= 3.85
    assert lookahead_labels(ce, 0.8)[0].tolist() == [True, True, False, False]  # 4 < 4.4 <= 5
    assert lookahead_labels(ce, 1.0)[0].tolist() == [True, True, True, False]  # never a negative gain
    with pytest.raises(ValueError, match="two passes"):
        lookahead_labels(ce[:1], 0.5)


def test_decider_config_validation():
    for bad, msg in (({"coverage": 0.0}, "coverage"), ({"coverage": 1.5}, "coverage"), ({"pos_weight": 0}, "pos"),
                     ({"hidden_size": 0}, "hidden_size"), ({"threshold": -0.1}, "threshold"),
                     ({"loss_weight": -1}, "loss_weight"), ({"lm_loss": "every_exit"}, "backbone: joint"),
                     ({"lm_loss": "every_exit", "backbone": "per_token"}, "backbone: joint")):  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            DeciderConfig(**bad)


def test_decider_loss_reads_the_model_exits(model):
    """The LM losses the labels come from are the model's own exits (one L_max run), and the decider
    reads the hidden states of that run: a decider that never says "continue" has labels to learn."""
    x = ids(2, 9, 3)
    with torch.no_grad():
        own = model(x[:, :-1], labels=x[:, 1:], loops=4, exits=[1, 2, 3])
        out = decider_loss(model, make_decider(model, backbone="frozen"), x[:, :-1], x[:, 1:])
    assert out.ce_per_pass == pytest.approx([float(own[ell].mean()) for ell in (1, 2, 3, 4)], abs=1e-5)
    assert float(out.lm) == pytest.approx(float(own[4].mean()), abs=1e-5)


def test_every_exit_lm_loss_is_the_mean_over_the_exits(model):
    """``lm_loss: every_exit`` (the uniform-depth control): the LM term is the mean CE after passes 1..L_max,
    not the CE at L_max, so the backbone keeps training every fixed depth."""
    x = ids(2, 9, 3)
    with torch.no_grad():
        last = decider_loss(model, make_decider(model, backbone="joint"), x[:, :-1], x[:, 1:])
        every = decider_loss(model, make_decider(model, backbone="joint", lm_loss="every_exit"), x[:, :-1], x[:, 1:])
    assert float(last.lm) == pytest.approx(last.ce_per_pass[-1], abs=1e-5)
    assert float(every.lm) == pytest.approx(sum(every.ce_per_pass) / 4, abs=1e-5)
    assert abs(float(every.lm) - float(last.lm)) > 1e-3


@pytest.mark.parametrize("backbone", ["frozen", "joint"])
def test_decider_loss_gradients_and_learning(model, backbone):
    decider = make_decider(model, backbone=backbone, pos_weight=2.0)
    x = ids(2, 13, 4)
    out = decider_loss(model, decider, x[:, :-1], x[:, 1:])
    assert out.total.item() == pytest.approx(out.lm.item() + 0.1 * out.bce.item(), rel=1e-6)
    assert 0 < out.continue_fraction < 1 and len(out.ce_per_pass) == 4
    model.zero_grad(set_to_none=True)
    out.bce.backward()
    assert decider.fc1.weight.grad.abs().sum() > 0
    qkv = model.core[0].attention_for(0).self_attention.linear_qkv.weight
    assert (qkv.grad is None) == (backbone == "frozen")
    model.zero_grad(set_to_none=True)
    if backbone == "joint":
        return
    opt = torch.optim.Adam(decider.parameters(), lr=1e-2)
    first = None
    for _ in range(8):  # the head can fit its labels on a fixed batch
        opt.zero_grad()
        loss = decider_loss(model, decider, x[:, :-1], x[:, 1:]).bce
        first = float(loss.detach()) if first is None else first
        loss.backward()
        opt.step()
    assert float(loss.detach()) < first


def test_threshold_zero_runs_every_pass_and_above_one_runs_one(model):
    tokens = ids(2, 11, 5)
    fixed = loss_by_loops(model, tokens, [1, 4])
    decider = make_decider(model, spread=1.0)
    full = adaptive_eval(model, decider, tokens, 0.0)
    assert full.mean_passes == 4 and full.relative_compute == 1.0
    assert full.loss == pytest.approx(fixed[4], abs=1e-5)
    one = adaptive_eval(model, decider, tokens, 1.01)
    assert one.mean_passes == 1
    assert one.loss == pytest.approx(fixed[1], abs=1e-5)
    assert one.relative_compute == pytest.approx(relative_compute(model.cfg, 1, seq_len=10), abs=1e-12)
    # last-loop cache at threshold 0 is the fixed-depth last-loop decoder
    last = adaptive_eval(model, decider, tokens, 0.0, kv_cache="last-loop")
    assert last.loss == pytest.approx(teacher_forced_loss(model, tokens, kv_cache="last-loop").loss, abs=1e-6)


def test_adaptive_depth_incremental_equals_whole_sequence(model):
    """Per-token early exit decoded token by token (per-loop cache) equals the whole-sequence step: stopped
    tokens' frozen K/V serve the later passes of other tokens in both."""
    decider = make_decider(model, spread=1.0)
    x = ids(2, 10, 6)
    stop = decider.stopper(0.5)
    whole = LoopedDecoder(model, kv_cache="per-loop", stop=stop).step(x)
    assert 1.2 < whole.passes_BS.float().mean() < 3.8, "the test needs mixed depths"
    assert whole.passes_BS.min() >= 1 and whole.passes_BS.max() <= 4
    dec = LoopedDecoder(model, kv_cache="per-loop", stop=stop)
    steps = [dec.step(x[:, t : t + 1]) for t in range(x.shape[1])]
    torch.testing.assert_close(torch.cat([s.logits_BSV for s in steps], 1), whole.logits_BSV, **TOL)
    assert torch.equal(torch.cat([s.passes_BS for s in steps], 1), whole.passes_BS)


def test_threshold_sweep_curve_and_auto_generate(model, tmp_path):
    tokens = ids(2, 9, 7)
    decider = make_decider(model, spread=1.0)
    curve, results = threshold_sweep(model, decider, tokens, [0.0, 0.3, 0.5, 0.7, 1.01])
    assert [r.mean_passes for r in results] == sorted((r.mean_passes for r in results), reverse=True)
    assert curve.points[-1].relative_compute == 1.0 and len(curve.points) == 5
    cmp = plot_comparison([quality_curve(model, tokens), curve], tmp_path / "adaptive.png")
    assert (tmp_path / "adaptive.png").exists() and len(cmp.aucs) == 2
    auto = generate(model, [1, 2, 3], loops="auto", stop=decider.stopper(0.5), max_new_tokens=6)
    assert auto.passes_BN.shape == (1, 5) and auto.passes_BN.min() >= 1 and auto.passes_BN.max() <= 4
    deep = generate(model, [1, 2, 3], loops="auto", stop=decider.stopper(0.0), max_new_tokens=6)
    fixed = generate(model, [1, 2, 3], loops=4, max_new_tokens=6)
    assert torch.equal(deep.tokens_BT, fixed.tokens_BT) and bool((deep.passes_BN == 4).all())
