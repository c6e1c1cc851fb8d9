"""Route replay that saves work (model/replay_dispatch.py, ``route_replay_impl: dispatch``) on one process.

Against the naive reference — megatron's RouterReplay (``route_replay_impl: router``: the full router
runs, only top-k is replaced) — with the router's aux and z losses off (the new path adds them at pass 0
only, by design): the same loss at every exit and the same gradients, router weights included. The gate
formula against megatron's router for each score function. What is skipped: top-k routing and the
dispatcher's counting run once per layer (pass 0), not once per pass, with and without per-pass
recompute. Pipeline chunks: micro-batches interleaved pass by pass replay their own routes.
(EP=2 with ghost passes, with recompute, and PP=2 x EP=2: tests/train/test_mixed_depth.py and
tests/parallel/test_pipeline.py, which run the default impl.)

Tolerance: fp32, rtol 1e-5 / atol 1e-6: the same ops up to the order of a k-way softmax's reduction.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe import moe_utils, router, token_dispatcher
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from elastic_pretrain.config import ConfigError
from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.model.replay_dispatch import RouteRecord, replay_gates
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig

PAR = ParallelConfig()
TOL = dict(rtol=1e-5, atol=1e-6)


def tiny(**kw) -> ModelConfig:
    base = dict(
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        prelude_layers=1,
        coda_layers=1,
        core_layers=2,
        num_experts=4,
        loops=2,
        flatten=2,
        moe_top_k=2,
        moe_ffn_hidden_size=32,
        moe_z_loss_coeff=0.0,
        moe_aux_loss_coeff=0.0,
        route_replay=True,
        loop_conditioning=False,
    )
    return ModelConfig(**{**base, **kw})


def batch(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))


def step(cfg: ModelConfig, *, loops: int, exits=(), recompute: str = "none", state=None):
    torch.manual_seed(0)
    net = build_model(cfg, PAR, recompute=recompute).train()
    if state is not None:
        net.load_state_dict(state)
    tokens = batch(cfg)
    out = net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops, exits=exits)
    loss = sum(v.mean() for v in out.values())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return {e: v.detach() for e, v in out.items()}, grads, net


@pytest.mark.parametrize("recompute", ["none", "pass"])
def test_dispatch_replay_equals_router_replay(mesh1, recompute):
    ref_out, ref_grads, ref_net = step(tiny(route_replay_impl="router"), loops=3, exits=(1, 2))
    out, grads, net = step(
        tiny(route_replay_impl="dispatch"), loops=3, exits=(1, 2), recompute=recompute, state=ref_net.state_dict()
    )
    assert out.keys() == ref_out.keys()
    for e in out:
        torch.testing.assert_close(out[e], ref_out[e], **TOL)
    assert grads.keys() == ref_grads.keys()
    assert any("router" in n for n in grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for core, ref_core in zip(net.core_layers(), ref_net.core_layers(), strict=True):
        rec = core.pass0_routes[None]
        assert isinstance(rec, RouteRecord)
        torch.testing.assert_close(rec.topk_NK, ref_core.pass0_routes[None].sort(dim=1).values)


def test_replay_off_is_unchanged_by_the_impl(mesh1):
    a, _ga, net = step(tiny(route_replay=False, route_replay_impl="router"), loops=2)
    b, _gb, _ = step(tiny(route_replay=False), loops=2, state=net.state_dict())
    torch.testing.assert_close(b[2], a[2], rtol=0, atol=0)
    assert all(core.pass0_routes == {} for core in net.core_layers())


@pytest.mark.parametrize(("score", "pre"), [("softmax", False), ("softmax", True), ("sigmoid", False)])
def test_gates_equal_megatron_router_replay(score, pre):
    class Cfg:
        moe_router_score_function, moe_router_pre_softmax, moe_router_topk_scaling_factor = score, pre, 2.5

    g = torch.Generator().manual_seed(0)
    logits_NE = torch.randn(7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    topk_NK = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(7)])
    rr = RouterReplay()
    rr.target_topk_idx = topk_NK
    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs_NE, _ = moe_utils.topk_routing_with_score_function(
        logits_NE, 3, use_pre_softmax=pre, scaling_factor=2.5, score_function=score, router_replay=rr
    )
    ours_NK = replay_gates(logits_NE, topk_NK, Cfg)
    # Both sides compute the score in float32 (megatron: softmax(dtype=float32), sigmoid(x.float())), ours on
    # the k gathered logits, megatron's on all E: the vector kernels put the elements in different SIMD lanes
    # (and AVX-512, AVX2 and the scalar path round differently), so each gate may differ by a few float32 ulps,
    # then by up to k + 1 more through the normalisation. The bound is float32's, not the float64 inputs'.
    tol = {"rtol": 4 * (3 + 1) * torch.finfo(torch.float32).eps, "atol": 1e-12}
    torch.testing.assert_close(ours_NK, probs_NE.gather(1, topk_NK), **tol)
    w = torch.randn(7, 3, generator=g, dtype=torch.float64)
    (ga,) = torch.autograd.grad((ours_NK * w).sum(), logits_NE)
    (gb,) = torch.autograd.grad((probs_NE.gather(1, topk_NK) * w).sum(), logits_NE)
    # the gradient sums k float32-rounded terms of size ~|w| * gate: scale the absolute bound by its largest term
    scale = float(w.abs().max()) * 2.5
    torch.testing.assert_close(ga, gb, rtol=tol["rtol"], atol=tol["rtol"] * scale)


@pytest.mark.parametrize("recompute", ["none", "pass"])
def test_replayed_passes_skip_topk_and_dispatch_counting(mesh1, monkeypatch, recompute):
    """Per step, top-k routing and the dispatcher's counting run once per core layer (pass 0), not per pass."""
    calls = {"routing": 0, "preprocess": 0}

    def spy(name, original):
        def wrapped(self, *a, **kw):
            calls[name] += 1
            return original(self, *a, **kw)

        return wrapped

    monkeypatch.setattr(router.TopKRouter, "routing", spy("routing", router.TopKRouter.routing))
    disp = token_dispatcher.MoEAlltoAllTokenDispatcher
    monkeypatch.setattr(disp, "preprocess", spy("preprocess", disp.preprocess))
    _, _, net = step(tiny(moe_z_loss_coeff=1e-3, moe_aux_loss_coeff=1e-2), loops=4, recompute=recompute)
    n = len(net.core_layers())  # the only MoE layers (prelude and coda are dense)
    assert calls == {"routing": n, "preprocess": n}  # pass 0's forward only; later passes and re-runs replay
    calls.update(routing=0, preprocess=0)
    step(tiny(route_replay_impl="router"), loops=4)
    assert calls == {"routing": 4 * n, "preprocess": 4 * n}  # the old path: every pass


def test_aux_losses_come_from_pass_0_only_and_survive_recompute(mesh1):
    """With aux/z losses on: per-pass recompute gives the same gradients (pass 0's re-run adds them)."""
    cfg = tiny(moe_z_loss_coeff=1e-3, moe_aux_loss_coeff=1e-2)
    _ref_out, ref_grads, net = step(cfg, loops=3)
    _out, grads, _ = step(cfg, loops=3, recompute="pass", state=net.state_dict())
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # and they differ from the losses-off model's router gradients: the aux/z losses are really in
    _, off_grads, _ = step(tiny(), loops=3, state=net.state_dict())
    name = next(n for n in grads if n.endswith("router.weight"))
    assert not torch.allclose(grads[name], off_grads[name])


def test_pipeline_chunks_replay_per_micro_batch(mesh1):
    """Micro-batches interleaved pass by pass (the pipeline schedule's order) replay their own pass-0 routes."""
    cfg = tiny(loops=3)
    torch.manual_seed(0)
    net = build_model(cfg, PAR).train()
    a, b = batch(cfg)[:, :-1], torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(9))
    want = {k: net(x, loops=3)[3] for k, x in (("a", a), ("b", b))}
    h = {"a": None, "b": None}
    for j in range(3):
        for key, x in (("a", a), ("b", b)):
            h[key] = net.run_chunk(h[key], x, pass_idx=j, loops=3, sync_loops=3, key=key)
    for key, x in (("a", a), ("b", b)):
        got = net.logits(net.head_states(h[key], net.rotary_pos_emb(x.shape[1])))
        torch.testing.assert_close(got.transpose(0, 1)[..., : cfg.vocab_size], want[key], **TOL)


def test_dispatch_impl_refuses_other_dispatchers():
    with pytest.raises(ConfigError, match="moe_dispatcher: alltoall"):
        tiny(moe_dispatcher="allgather")
    tiny(moe_dispatcher="allgather", route_replay_impl="router")  # the old path takes any dispatcher
