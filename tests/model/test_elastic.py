"""ELR pieces on one process: the zero-init switch, route replay, ghost passes, routing health."""

from __future__ import annotations

import torch

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
    )
    return ModelConfig(**{**base, **kw})


def batch(cfg: ModelConfig, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))


def test_switching_on_zero_init_conditioning_leaves_the_loss_unchanged(mesh1):
    cfg = tiny()
    model = build_model(cfg, PAR)
    tokens = batch(cfg)
    assert torch.count_nonzero(model.loop_conditioning.out.weight) == 0
    before = {ell: model(tokens[:, :-1], labels=tokens[:, 1:], loops=ell)[ell].mean() for ell in (1, 3, 4)}
    model.set_modes(conditioning=True)
    after = {ell: model(tokens[:, :-1], labels=tokens[:, 1:], loops=ell)[ell] for ell in (1, 3, 4)}
    for ell in before:
        assert abs(float(after[ell].mean()) - float(before[ell])) <= 1e-6
    # ... and the heads learn from that step on: the zero-init output projection gets a gradient
    after[4].mean().backward()
    assert model.loop_conditioning.out.weight.grad.abs().sum() > 0


def test_late_switch_from_one_loop_leaves_the_one_loop_loss_unchanged(mesh1):
    """ELR's switch from ``fixed_loops: 1``: conditioning heads on (zero-init) and pass 0's attention copied
    into the never-run passes (``init_unused_passes: copy_pass0``) — the loss at ℓ = 1, the only depth
    trained so far, is unchanged; deeper runs now start from pass 0's attention."""
    cfg = tiny()
    model = build_model(cfg, PAR)
    tokens = batch(cfg)
    one = model(tokens[:, :-1], labels=tokens[:, 1:], loops=1)[1].mean()
    deep = model(tokens[:, :-1], labels=tokens[:, 1:], loops=4)[4].mean()
    written = model.init_unused_passes(range(1, 4))
    model.set_modes(conditioning=True)
    core = model.core_layers()[0]
    assert len(written) == len(model.core_layers()) * 3 * len(list(core.passes[1].parameters())) > 0
    pass0 = dict(core.full_layer.named_parameters())
    for j in (1, 2, 3):
        for name, p in core.passes[j].named_parameters():
            assert torch.equal(p, pass0[name]) and p.data_ptr() != pass0[name].data_ptr()  # copied, not tied
    after = model(tokens[:, :-1], labels=tokens[:, 1:], loops=1)[1].mean()
    assert abs(float(after) - float(one)) <= 1e-6
    assert float(model(tokens[:, :-1], labels=tokens[:, 1:], loops=4)[4].mean()) != float(deep)


def test_conditioning_depends_on_target_loops_once_trained(mesh1):
    cfg = tiny()
    model = build_model(cfg, PAR)
    model.set_modes(conditioning=True)
    with torch.no_grad():
        model.loop_conditioning.out.weight.normal_(0, 0.5)
    v3, v4 = model.loop_conditioning(3, 0), model.loop_conditioning(4, 0)
    assert not torch.allclose(v3, v4)


def _record_routing(model):
    """Naive reference: capture each router call's logits, probs and routing map."""
    calls = []
    router = model.core[0].shared_mlp.router

    def hook(mod, args, out):
        x = args[0].reshape(-1, args[0].shape[-1])
        calls.append((torch.nn.functional.linear(x, mod.weight).detach(), out[0].detach(), out[1].detach()))

    return calls, router.register_forward_hook(hook)


def test_route_replay_reuses_pass0_experts_with_live_gates(mesh1):
    torch.manual_seed(0)  # the weights, hence whether a later pass routes differently, must not depend on test order
    cfg = tiny(route_replay=True, core_layers=1, flatten=1, loops=3)
    model = build_model(cfg, PAR)
    calls, handle = _record_routing(model)
    tokens = batch(cfg, 1)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:], loops=3)[3].mean()
    handle.remove()
    assert len(calls) == 3
    logits0, _, map0 = calls[0]
    for logits, probs, routing_map in calls[1:]:
        assert torch.equal(routing_map, map0), "later passes must reuse pass-0 experts"
        # gates: softmax over the live logits of the replayed experts (megatron's top-k softmax)
        idx = map0.nonzero()[:, 1].view(-1, cfg.moe_top_k)
        expected = torch.softmax(logits.gather(1, idx), dim=-1)
        torch.testing.assert_close(probs.gather(1, idx), expected, rtol=1e-5, atol=1e-6)
        assert not torch.equal(logits, logits0)  # live logits differ from pass 0's
    loss.backward()
    assert model.core[0].shared_mlp.router.weight.grad.abs().sum() > 0
    # without replay later passes choose their own experts
    plain = build_model(tiny(route_replay=False, core_layers=1, flatten=1, loops=3), PAR)
    plain.load_state_dict(model.state_dict())
    calls2, handle = _record_routing(plain)
    plain(tokens[:, :-1], labels=tokens[:, 1:], loops=3)
    handle.remove()
    assert any(not torch.equal(c[2], calls2[0][2]) for c in calls2[1:])


def test_ghost_passes_change_nothing(mesh1):
    """Joining extra MoE calls (EP sync) leaves loss and every gradient bit-identical."""
    cfg = tiny(moe_aux_loss_coeff=1e-2)
    model = build_model(cfg, PAR)
    tokens = batch(cfg, 2)
    results = []
    for sync in (None, 4):
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:], loops=2, sync_loops=sync)[2].mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_routing_probe_matches_a_naive_computation(mesh1):
    cfg = tiny()
    model = build_model(cfg, PAR)
    calls, handle = _record_routing(model)
    probe = model.start_routing_probe()
    tokens = batch(cfg, 3)
    with torch.no_grad():
        model(tokens[:, :-1], labels=tokens[:, 1:], loops=3)
    model.stop_routing_probe()
    handle.remove()
    stats = probe.means()
    assert sorted(stats) == [(0, 0), (0, 1), (0, 2)]
    logits0 = calls[0][0]
    for p, (logits, _, _) in enumerate(calls):
        probs = torch.softmax(logits.double(), -1)
        top = probs.topk(3, -1)
        load = torch.bincount(top.indices[:, :2].reshape(-1), minlength=cfg.experts_built).double()
        overlap = top.indices[:, :2, None] == torch.softmax(logits0.double(), -1).topk(2, -1).indices[:, None, :]
        want = {
            "confidence": probs.max(-1).values.mean(),
            "margin": (top.values[:, 1] - top.values[:, 2]).mean(),
            "entropy": -(probs * probs.log()).sum(-1).mean(),
            "load_cv": load.std(unbiased=False) / load.mean(),
            "maxvio": load.max() / load.mean() - 1,
            "overlap": overlap.any(-1).double().mean(),
        }
        for key, value in want.items():
            assert abs(stats[(0, p)][key] - float(value)) < 1e-5, (p, key)
    assert stats[(0, 0)]["overlap"] == 1.0
