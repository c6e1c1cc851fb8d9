"""Full ghost passes (``RunModes(ghosts="full_passes")``, the DeepSpeed engine's ZeRO-3 mixed depth) on one
process: a micro-batch at ℓ run for a deeper ``sync_loops`` calls exactly the modules of the deeper run, in the
same order, forward and backward (what ZeRO-3's parameter gathers and gradient hooks see), while its loss, its
gradients and its MoE aux losses are bitwise those of ℓ passes alone (the ghosts' contributions are exactly zero).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig


def tiny(**kw: Any) -> ModelConfig:
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
        moe_z_loss_coeff=1e-3,
        moe_aux_loss_coeff=1e-2,
    )
    return ModelConfig(**{**base, **kw})


def run(
    cfg: ModelConfig, *, ghosts: str, loops: int, sync_loops: int | None, exits: tuple[int, ...] = ()
) -> dict[str, Any]:
    torch.manual_seed(0)
    net = build_model(cfg, ParallelConfig()).train()
    net.set_modes(ghosts=ghosts, conditioning=net.loop_conditioning is not None)
    if net.loop_conditioning is not None:
        with torch.no_grad():  # the conditioning head is zero-initialised: give it something to differentiate
            net.loop_conditioning.out.weight.normal_(0, 0.02)
    names = {m: n for n, m in net.named_modules()}
    calls: list[str] = []  # modules that own parameters, in call order (what ZeRO-3 gathers for)
    handles = [
        m.register_forward_pre_hook(lambda m, _: calls.append(names[m]))
        for m in net.modules()
        if any(True for _ in m.parameters(recurse=False))
    ]
    grad_order: list[str] = []  # parameters in the order their gradients are ready (ZeRO-3's reduce hooks)
    handles += [
        p.register_post_accumulate_grad_hook(lambda p, n=n: grad_order.append(n)) for n, p in net.named_parameters()
    ]
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    clear_aux_losses_tracker()
    out = net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops, exits=exits or (loops,), sync_loops=sync_loops)
    loss = sum(v.mean() for v in out.values())
    loss.backward()
    for h in handles:
        h.remove()
    aux = {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}
    clear_aux_losses_tracker()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return dict(loss=loss.detach(), grads=grads, calls=calls, grad_order=grad_order, aux=aux)


@pytest.mark.parametrize("replay", [False, True])
def test_full_ghost_passes_call_the_deeper_run_and_change_nothing(mesh1: Any, replay: bool) -> None:
    cfg = tiny(route_replay=replay)
    own = run(cfg, ghosts="moe_calls", loops=1, sync_loops=None)  # ℓ = 1 alone (no partner)
    ghosted = run(cfg, ghosts="full_passes", loops=1, sync_loops=4)  # ℓ = 1, a partner at 4
    deep = run(cfg, ghosts="full_passes", loops=4, sync_loops=4)  # the partner

    # the same module calls and gradient-ready order as the partner's: ZeRO-3's collectives pair up
    assert ghosted["calls"] == deep["calls"]
    assert ghosted["grad_order"] == deep["grad_order"]
    assert any(".passes.3." in c for c in ghosted["calls"])  # pass 3's own attention was called
    # ... and exactly the numbers of ℓ = 1: loss, every gradient, the MoE aux losses
    assert torch.equal(ghosted["loss"], own["loss"])
    for name, g in ghosted["grads"].items():
        if name in own["grads"]:
            assert torch.equal(g, own["grads"][name]), name
        else:  # only a ghost pass touched it: its gradient exists (the backward ran) and is zero
            assert not g.any(), name
    assert set(ghosted["grads"]) - set(own["grads"]) and set(own["grads"]) <= set(ghosted["grads"])
    assert ghosted["aux"].keys() == own["aux"].keys()
    for k, v in own["aux"].items():
        assert torch.equal(ghosted["aux"][k], v), k


def test_exits_at_different_passes_call_the_heads_at_the_same_point(mesh1: Any) -> None:
    """Telescopic training: ranks at one ℓ supervise different prefix exits; under ZeRO-3 the heads run after the
    last pass, so the module calls and gradient order do not depend on where the exits are."""
    cfg = tiny(loop_conditioning=False)
    a = run(cfg, ghosts="full_passes", loops=4, sync_loops=4, exits=(1, 4))
    b = run(cfg, ghosts="full_passes", loops=4, sync_loops=4, exits=(3, 4))
    assert a["calls"] == b["calls"] and a["grad_order"] == b["grad_order"]
    plain = run(cfg, ghosts="moe_calls", loops=4, sync_loops=None, exits=(1, 4))
    assert plain["calls"] == a["calls"]  # expert parallelism's path runs the heads last too (issue 30, item 4)
    torch.testing.assert_close(a["loss"], plain["loss"], rtol=0, atol=0)


def test_full_ghost_passes_count_as_whole_passes_of_hardware_flops() -> None:
    """HFU: a ZeRO-3 ghost pass computes a whole pass (expert parallelism's: one token per MoE call); MFU and
    depth efficiency count it as executed, not useful, either way."""
    from elastic_pretrain.train.mfu import DepthCounts, step_flops

    cfg, kw = tiny(), dict(seq_len=16, micro_batch_tokens=64)
    full = DepthCounts(loops=2.0, exits=1.0, ghost_passes=2.0, full_ghosts=True)
    one_token = DepthCounts(loops=2.0, exits=1.0, ghost_passes=2.0)
    deep = DepthCounts(loops=4.0, exits=1.0, ghost_passes=0.0)
    useful = DepthCounts(loops=2.0, exits=1.0, ghost_passes=0.0)
    assert step_flops(cfg, full, **kw).hardware == pytest.approx(step_flops(cfg, deep, **kw).model)
    assert (
        step_flops(cfg, useful, **kw).model
        < step_flops(cfg, one_token, **kw).hardware
        < step_flops(cfg, full, **kw).hardware
    )
    assert step_flops(cfg, full, **kw).model == step_flops(cfg, useful, **kw).model
    assert full.efficiency == one_token.efficiency == 0.5
