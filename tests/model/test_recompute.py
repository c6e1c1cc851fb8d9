"""train.recompute on one process: same loss and gradients with recompute none / selective / pass (route
replay, extra exits, loop conditioning), bytes saved for backward linear in ℓ without recompute and flat
(one hidden state per pass) with it, route replay's recorded pass-0 routes untouched by the recompute,
routing probe and MoE aux-loss logging counted once.

Tolerance: fp32, exact up to reassociation (rtol 1e-5 / atol 1e-7): recompute re-runs the same ops on
the same inputs.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig

PAR = ParallelConfig()


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
        moe_z_loss_coeff=1e-3,
        route_replay=True,
    )
    return ModelConfig(**{**base, **kw})


def run(cfg: ModelConfig, recompute: str, *, loops: int, exits=(), state=None, probe: bool = False):
    torch.manual_seed(0)
    net = build_model(cfg, PAR, recompute=recompute).train()
    if state is not None:
        net.load_state_dict(state)
    net.set_modes(conditioning=True)
    with torch.no_grad():  # the conditioning head is zero-initialised: give it something to differentiate
        net.loop_conditioning.out.weight.normal_(0, 0.02)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    clear_aux_losses_tracker()
    if probe:
        net.start_routing_probe()
    out = net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops, exits=exits)
    loss = sum(v.mean() for v in out.values())
    routes = {i: dict(c.pass0_routes) for i, c in enumerate(net.core_layers())}
    loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    aux = {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}
    clear_aux_losses_tracker()
    stats = net.stop_routing_probe()
    return dict(loss=loss.detach(), grads=grads, state=net.state_dict(), net=net, routes=routes, aux=aux, probe=stats)


@pytest.mark.parametrize("recompute", ["selective", "pass"])
def test_recompute_gives_the_same_loss_and_gradients(mesh1, recompute):
    cfg = tiny()
    ref = run(cfg, "none", loops=3, exits=(1,))
    got = run(cfg, recompute, loops=3, exits=(1,), state=ref["state"])
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-7)
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    # the MoE aux/z-loss logging counts every pass once (the pass-recompute forward runs without grad)
    assert got["aux"].keys() == ref["aux"].keys() and ref["aux"]
    for k, v in ref["aux"].items():
        torch.testing.assert_close(got["aux"][k], v, rtol=1e-5, atol=1e-7)


def test_recompute_replays_recorded_routes_without_overwriting_them(mesh1, monkeypatch):
    """The backward's re-run of pass 0 replays the recorded routes (not a fresh top-k) and records nothing
    (megatron's RouterReplay path; the default dispatch path: tests/model/test_replay_dispatch.py)."""
    ref = run(tiny(route_replay_impl="router"), "none", loops=2)
    calls: list[str] = []
    from megatron.core.transformer.moe import router_replay

    original = router_replay.RouterReplay.get_replay_topk

    def spy(self, scores, topk, *args, **kw):
        calls.append(self.router_replay_action.value if self.router_replay_action else "none")
        return original(self, scores, topk, *args, **kw)

    monkeypatch.setattr(router_replay.RouterReplay, "get_replay_topk", spy)
    got = run(tiny(route_replay_impl="router"), "pass", loops=2, state=ref["state"])
    net = got["net"]
    for i, core in enumerate(net.core_layers()):
        assert core.pass0_routes[None] is got["routes"][i][None]  # the very tensor recorded in forward
    # forward: pass 0 records, pass 1 replays; backward re-runs pass 1 and pass 0: both replay
    assert calls == ["record", "replay_forward", "replay_forward", "replay_forward"]


def test_routing_probe_counts_each_pass_once(mesh1):
    ref = run(tiny(), "none", loops=3, probe=True)
    got = run(tiny(), "pass", loops=3, state=ref["state"], probe=True)
    torch.testing.assert_close(got["probe"].counts_KL, ref["probe"].counts_KL)
    torch.testing.assert_close(got["probe"].sums_KLS, ref["probe"].sums_KLS)


def saved_bytes(cfg: ModelConfig, recompute: str, loops: int, *, batch: int = 2, seq: int = 16) -> int:
    """Bytes of distinct storages saved for backward by one forward (parameters excluded)."""
    torch.manual_seed(0)
    net = build_model(cfg, PAR, recompute=recompute).train()
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(3))
    seen: dict[int, int] = {}
    alive: list[torch.UntypedStorage] = []  # no address reuse within the forward: a freed storage's address
    # handed to a later one made two storages count as one (the count then depended on the allocator's history)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
            alive.append(storage)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops)
    return sum(seen.values())


def test_saved_bytes_grow_linearly_in_loops_without_recompute_and_stay_flat_with_it(mesh1):
    cfg = tiny(route_replay=False, loops=3, flatten=2, core_layers=2)  # L_max = 6
    none = [saved_bytes(cfg, "none", ell) for ell in (1, 2, 4, 6)]
    per_pass = none[1] - none[0]
    assert per_pass > 0
    assert [b - none[0] for b in none] == [0, per_pass, 3 * per_pass, 5 * per_pass]  # linear in ℓ
    flat = [saved_bytes(cfg, "pass", ell) for ell in (1, 2, 4, 6)]
    hidden = 16 * 2 * cfg.hidden_size * 4  # one pass's input, fp32: all a recomputed pass keeps
    assert [b - flat[0] for b in flat] == [0, hidden, 3 * hidden, 5 * hidden]
    assert hidden * 20 < per_pass


def test_a_training_session_builds_the_model_with_train_recompute(monkeypatch):
    """The trainer hands ``train.recompute`` to the model (stopped right at model construction)."""
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.train import session
    from tests.conftest import REPO

    class Built(Exception):
        pass

    seen: dict = {}

    def build(model, parallel, **kw):
        seen.update(kw)
        raise Built

    monkeypatch.setattr(session, "build_model", build)
    with pytest.raises(Built):
        session.build_session(load_job(REPO / "jobs" / "tiny-cpu.yaml", ["train.recompute=pass"]), mesh=None)
    assert seen["recompute"] == "pass"
