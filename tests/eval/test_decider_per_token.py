"""TaH2 joint post-training under per-token depth (``decider.backbone: per_token``, issue 18 item 1):
nested labels, frozen states of stopped tokens, LM loss at each token's exit, DP-pooled labels."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from elastic_pretrain.config import ConfigError
from elastic_pretrain.eval.adaptive import adaptive_eval
from elastic_pretrain.model.decider import decider_loss, lookahead_labels, run_per_token
from elastic_pretrain.model.inference import LoopedDecoder
from elastic_pretrain.model.losses import token_ce
from tests.conftest import REPO, torchrun
from tests.eval.test_decider import ids, make_decider


def _ce(model, labels_BT):
    return lambda h: token_ce(model.logits(h)[..., : model.cfg.vocab_size].transpose(0, 1), labels_BT)


def test_nested_labels_skip_stopped_tokens():
    """A token that did not run pass j gets no "continue" label at j, however large its gain, and adds
    nothing to the total gain the coverage cut is taken from."""
    ce = torch.tensor([[5.0, 5.0, 5.0], [4.0, 1.0, 4.5], [3.0, 0.0, 4.4]])  # [L=3, N=3]
    assert lookahead_labels(ce, 1.0).tolist() == [[True, True, True], [True, True, True]]
    active = torch.tensor([[True, True, True], [True, False, True]])  # token 1 stopped after pass 0
    got = lookahead_labels(ce, 0.9, active)
    assert got[1].tolist() == [True, False, False]  # token 1 unlabelled; 0.9 of (1.0 + 0.1) is token 0 alone
    assert got[0].tolist() == lookahead_labels(ce[:2], 0.9)[0].tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_stopped_tokens_frozen_and_loss_at_exit(model, seed):
    """A random decider stops tokens at mixed passes: after its stop pass a token's hidden state is
    unchanged, it is never active again (nested), and the LM loss is the CE of its exit state — the lookahead
    row of its last pass, and for position 0 (which attends only to itself) the fixed-depth model's own exit."""
    dec = make_decider(model, spread=2.0, backbone="per_token")
    torch.manual_seed(seed)
    with torch.no_grad():
        dec.fc2.bias.normal_(0.0, 1.0)
    x = ids(3, 12, 10 + seed)
    keep: list[torch.Tensor] = []
    with torch.no_grad():
        run = run_per_token(model, dec, x[:, :-1], _ce(model, x[:, 1:]), keep=keep)
        own = model(x[:, :-1], labels=x[:, 1:], loops=4, exits=[1, 2, 3])
    act = run.active_L_BT
    assert bool((act[1:] <= act[:-1]).all())  # nested: once stopped, never active again
    passes_BT = act.sum(0)
    assert len(passes_BT.unique()) > 1, "the test needs mixed depths"
    states = torch.stack(keep)  # [L, T, B, D]
    for j in range(1, 4):
        stopped_TB = ~act[j].t()
        assert torch.equal(states[j][stopped_TB], states[j - 1][stopped_TB])
        assert not torch.equal(states[j][~stopped_TB], states[j - 1][~stopped_TB])
    torch.testing.assert_close(run.ce_L_BT[-1], run.exit_ce_BT, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(run.ahead_L_BT[0], run.ce_L_BT[0], rtol=0, atol=0)  # pass 0: every token runs
    assert bool((run.gain_LBT()[~run.labelled_LBT()] == 0).all())  # nested: no gain, no label after a stop
    for b in range(3):  # position 0: the per-token run's exit equals the fixed-depth run at its depth
        p = int(passes_BT[b, 0])
        assert float(run.exit_ce_BT[b, 0]) == pytest.approx(float(own[p][b, 0]), abs=1e-5)
    stopped_early = passes_BT < 4
    assert not torch.allclose(run.exit_ce_BT[stopped_early], own[4][stopped_early])  # not L_max's loss


@pytest.mark.parametrize("seed", [0, 1])
def test_per_token_training_equals_adaptive_serving(model, seed):
    """For a fixed decider and threshold, each token's exit CE in per-token training equals teacher-forced
    adaptive decoding with the per-loop cache (the serving path of ``eval/adaptive.py``), token by token, and
    so do the passes each token runs: a later token reads a stopped token's K/V of the last pass it ran (not
    this pass's projection of its frozen state), and the coda sees the same exit states."""
    dec = make_decider(model, spread=2.0, backbone="per_token")
    torch.manual_seed(seed)
    with torch.no_grad():
        dec.fc2.bias.normal_(0.0, 1.0)
    x = ids(3, 16, 20 + seed)
    with torch.no_grad():
        run = run_per_token(model, dec, x[:, :-1], _ce(model, x[:, 1:]))
        served = LoopedDecoder(model, kv_cache="per-loop", stop=dec.stopper()).step(x[:, :-1])
    passes_BT = run.active_L_BT.sum(0)
    assert torch.equal(served.passes_BS, passes_BT)
    stopped_early = passes_BT < 4
    assert bool(stopped_early.any()) and bool((~stopped_early).any()), "the test needs mixed depths"
    assert bool(stopped_early[:, :-1].any()), "the test needs a stopped token with later tokens reading it"
    ce_BT = F.cross_entropy(served.logits_BSV.float().transpose(1, 2), x[:, 1:], reduction="none")
    torch.testing.assert_close(run.exit_ce_BT, ce_BT, rtol=0, atol=1e-5)
    mean = adaptive_eval(model, dec, x, dec.cfg.threshold)  # the experiment's evaluation, batch by batch
    assert mean.loss == pytest.approx(float(ce_BT.mean()), abs=1e-5)
    assert mean.mean_passes == pytest.approx(float(passes_BT.double().mean()), abs=1e-9)


def test_per_token_gradients_are_the_served_functions(model):
    """The LM gradient of per-token training is the gradient of the served computation: the per-loop decoder's
    step run with autograd on (its no-grad wrapper bypassed) gives the same parameter gradients of the summed CE,
    including the paths through a stopped token's K/V into the pass that made them."""
    dec = make_decider(model, spread=2.0, backbone="per_token")
    with torch.no_grad():
        dec.fc2.bias.fill_(0.3)
    x = ids(2, 12, 31)
    params = [p for p in model.parameters() if p.requires_grad]
    run = run_per_token(model, dec, x[:, :-1], _ce(model, x[:, 1:]))
    assert bool((run.active_L_BT.sum(0) < 4).any())
    grads = torch.autograd.grad(run.exit_ce_BT.sum(), params, allow_unused=True)
    served = LoopedDecoder(model, kv_cache="per-loop", stop=dec.stopper())._chunk(x[:, :-1])
    ce = F.cross_entropy(served.logits_BSV.float().transpose(1, 2), x[:, 1:], reduction="sum")
    want = torch.autograd.grad(ce, params, allow_unused=True)
    assert torch.equal(served.passes_BS, run.active_L_BT.sum(0))
    compared = 0
    for got, ref in zip(grads, want, strict=True):
        assert (got is None) == (ref is None)
        if got is not None:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
            compared += 1
    assert compared > 10


def test_per_token_refuses_per_pass_recompute(model, tmp_path):
    """``train.recompute: pass`` would recompute a pass without the K/V state carried into it: a clear one-line
    error, from the job before it starts and from the model."""
    from elastic_pretrain.config import to_dict
    from elastic_pretrain.job_loader import load_job

    base = tmp_path / "step_2"  # a stand-in base checkpoint: load_job reads only its trainer.json
    base.mkdir()
    meta = {"config": to_dict(load_job(REPO / "jobs" / "tiny-cpu.yaml")), "controller": {"phase": "fixed"}}
    (base / "trainer.json").write_text(json.dumps(meta))
    job = REPO / "jobs" / "tiny-decider.yaml"
    load_job(job, [f"decider.init_from={base}", "decider.backbone=per_token", "train.recompute=selective"])
    with pytest.raises(ConfigError, match=r"use train\.recompute=none or selective") as err:
        load_job(job, [f"decider.init_from={base}", "decider.backbone=per_token", "train.recompute=pass"])
    assert "\n" not in str(err.value)
    dec = make_decider(model, spread=2.0, backbone="per_token")
    x = ids(1, 6, 3)
    model.set_modes(recompute="pass")
    model.train()
    try:
        with pytest.raises(ConfigError, match=r"train\.recompute=none or selective"):
            run_per_token(model, dec, x[:, :-1], _ce(model, x[:, 1:]))
    finally:
        model.set_modes(recompute="none")
        model.eval()


def test_per_token_extremes_equal_fixed_depth(model):
    """Threshold 0 runs every token L_max passes (the ``joint`` model's loss); above 1 every token exits after one."""
    x = ids(2, 9, 5)
    with torch.no_grad():
        own = model(x[:, :-1], labels=x[:, 1:], loops=4, exits=[1])
        for thr, ell, mean_passes in ((0.0, 4, 4.0), (1.01, 1, 1.0)):
            dec = make_decider(model, spread=2.0, backbone="per_token", threshold=thr)
            run = run_per_token(model, dec, x[:, :-1], _ce(model, x[:, 1:]))
            torch.testing.assert_close(run.exit_ce_BT, own[ell], rtol=1e-5, atol=1e-5)
            assert float(run.active_L_BT.sum(0).double().mean()) == mean_passes
            out = decider_loss(model, dec, x[:, :-1], x[:, 1:])
            assert float(out.lm) == pytest.approx(float(own[ell].mean()), abs=1e-5)


def test_per_token_loss_trains_the_backbone_at_the_exit(model):
    """The LM gradient reaches the backbone through each token's exit; the BCE reaches the decider."""
    dec = make_decider(model, spread=2.0, backbone="per_token")
    x = ids(2, 11, 6)
    out = decider_loss(model, dec, x[:, :-1], x[:, 1:])
    assert out.total.item() == pytest.approx(out.lm.item() + 0.1 * out.bce.item(), rel=1e-6)
    model.zero_grad(set_to_none=True)
    out.total.backward()
    assert dec.fc1.weight.grad.abs().sum() > 0
    assert model.core[0].attention_for(3).self_attention.linear_qkv.weight.grad is not None
    model.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_labels_pooled_over_two_dp_ranks_equal_one_process():
    """2 gloo ranks (DP=2), strict device checks on: each rank's pooled labels equal its slice of the labels
    one process gives the concatenated batch, and differ from labelling each rank's batch alone."""
    proc = torchrun(REPO / "tests" / "dist" / "decider_pooling.py", nproc=2, timeout=300)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("POOLED "))
    ranks = json.loads(line[len("POOLED ") :])
    assert [r["equal_to_one_process"] for r in ranks] == [True, True]
    assert any(r["differs_from_local"] for r in ranks)


def test_accuracy_per_doubling_on_synthetic_points():
    """TaH2's slope: accuracy = a + s·log2(compute) gives s exactly; noise-free points from two slopes on one
    sweep give each; one compute, or a non-positive one, is no slope."""
    from elastic_pretrain.eval.adaptive import AdaptiveResult, AdaptiveSweep, FixedPoint, accuracy_per_doubling

    compute = [0.25, 0.5, 1.0]
    assert accuracy_per_doubling(compute, [0.30, 0.32, 0.34]) == pytest.approx(0.02)
    assert accuracy_per_doubling([1, 2, 4, 8], [0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.1)
    # least squares through scattered points: slope of (log2 c, acc) = ((-1,0.5),(0,0.5),(1,0.7)) is 0.1
    assert accuracy_per_doubling([0.5, 1.0, 2.0], [0.5, 0.5, 0.7]) == pytest.approx(0.1)
    assert accuracy_per_doubling([1.0, 1.0], [0.2, 0.3]) != accuracy_per_doubling([1.0, 1.0], [0.2, 0.3])  # NaN
    with pytest.raises(ValueError, match="compute must be > 0"):
        accuracy_per_doubling([0.0, 1.0], [0.1, 0.2])
    sweep = AdaptiveSweep(
        fixed=tuple(FixedPoint(loops=i + 1, relative_compute=c, loss=1.0, accuracy=0.3 + 0.0179 * i)
                    for i, c in enumerate(compute)),
        adaptive=tuple(AdaptiveResult(threshold=t, loss=1.0, mean_passes=1.0, relative_compute=c, policy="per-loop",
                                      accuracy=0.3 + 0.0274 * i)
                       for i, (t, c) in enumerate(zip((0.9, 0.5, 0.0), compute, strict=True))),
    )  # fmt: skip
    fixed, adaptive = sweep.slopes()
    assert fixed == pytest.approx(0.0179) and adaptive == pytest.approx(0.0274)
    assert "fixed depth 1.79, adaptive 2.74" in sweep.markdown()
