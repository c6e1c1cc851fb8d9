"""``model.kv_training: last_loop`` (model/kv_training.py) and parallel prefill (``LoopedDecoder.prefill``).

The point of the mode: the training-time per-token loss of a sequence equals, token by token, the loss
of inference with the last-loop KV cache after a parallel prefill of that token's prefix — and under
same-pass training it does not. The prefill runs per-loop semantics on the prompt (its logits equal
the model's forward) and keeps 1/ℓ of the per-loop cache for the core. Per-pass recompute gives the
same loss and gradients in the mode; what the mode cannot express is refused.

Tolerance: fp32, rtol 1e-4 / atol 1e-5: the inference attention is a plain softmax written in
model/inference.py, the training one megatron's; the rest are the same modules.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elastic_pretrain.config import ConfigError
from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.model.inference import LoopedDecoder, teacher_forced_loss
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig

PAR = ParallelConfig()
TOL = dict(rtol=1e-4, atol=1e-5)
LOOPS = 3


def tiny(**kw) -> ModelConfig:
    base = dict(
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        prelude_layers=1,
        coda_layers=1,
        core_layers=2,
        num_experts=4,
        loops=LOOPS,
        flatten=1,
        moe_top_k=2,
        moe_ffn_hidden_size=32,
        kv_training="last_loop",
    )
    return ModelConfig(**{**base, **kw})


def tokens(cfg: ModelConfig, seq: int = 9) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(4))


def model(cfg: ModelConfig, recompute: str = "none"):
    torch.manual_seed(0)
    return build_model(cfg, PAR, recompute=recompute)


def last_loop_inference_losses(net, ids_BT1: torch.Tensor) -> torch.Tensor:
    """CE ``[B, T]`` of token t+1 from last-loop decoding of token t after a parallel prefill of tokens < t."""
    out = []
    for t in range(ids_BT1.shape[1] - 1):
        dec = LoopedDecoder(net, loops=LOOPS, kv_cache="last-loop")
        if t:
            dec.prefill(ids_BT1[:, :t])
        logits_BV = dec.step(ids_BT1[:, t : t + 1]).logits_BSV[:, 0]
        out.append(F.cross_entropy(logits_BV.float(), ids_BT1[:, t + 1], reduction="none"))
    return torch.stack(out, 1)


def test_last_loop_training_loss_equals_last_loop_inference_token_by_token(mesh1):
    cfg = tiny()
    net = model(cfg).eval()
    ids = tokens(cfg)
    with torch.no_grad():
        train_BT = net(ids[:, :-1], labels=ids[:, 1:], loops=LOOPS)[LOOPS]
    infer_BT = last_loop_inference_losses(net, ids)
    torch.testing.assert_close(train_BT, infer_BT, **TOL)
    # the same weights trained same-pass would be scored by another pattern: the mode is what makes them equal
    same = model(tiny(kv_training="same_pass")).eval()
    same.load_state_dict(net.state_dict())
    with torch.no_grad():
        same_BT = same(ids[:, :-1], labels=ids[:, 1:], loops=LOOPS)[LOOPS]
    assert not torch.allclose(same_BT[:, 1:], infer_BT[:, 1:], **TOL)
    torch.testing.assert_close(same_BT[:, 0], infer_BT[:, 0], **TOL)  # token 0 has no past: no difference


def test_one_loop_is_same_pass(mesh1):
    # loss and gradients: at ℓ = 1 the earlier tokens' final K/V are their pass-0 K/V, so the mode must not make
    # them constants (a no-grad run's) and cut their gradient — the late-switch one-loop phase trains as same-pass
    ids = tokens(tiny())
    out = []
    for mode in ("last_loop", "same_pass"):
        net = model(tiny(kv_training=mode)).train()
        loss_BT = net(ids[:, :-1], labels=ids[:, 1:], loops=1)[1]
        loss_BT.mean().backward()
        out.append((loss_BT.detach(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = out
    torch.testing.assert_close(a, b, **TOL)
    assert ga.keys() == gb.keys() and any("linear_qkv" in n for n in ga)
    for name, g in ga.items():
        torch.testing.assert_close(g, gb[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_prefill_is_per_loop_on_the_prompt_and_keeps_one_pass_of_core_kv(mesh1):
    cfg = tiny(kv_training="same_pass")
    net = model(cfg).eval()
    ids = tokens(cfg)
    with torch.no_grad():
        want = net(ids, loops=LOOPS)[LOOPS]
    caches = {}
    for policy in ("last-loop", "per-loop"):
        dec = LoopedDecoder(net, loops=LOOPS, kv_cache=policy)
        torch.testing.assert_close(dec.prefill(ids).logits_BSV, want, **TOL)
        caches[policy] = dec.cache
        with pytest.raises(ValueError, match="prefill the prompt first"):
            dec.prefill(ids)

    def core_bytes(cache) -> int:
        return sum(cache.k[k].nbytes + cache.v[k].nbytes for k in cache.k if k[0] == "core")

    assert core_bytes(caches["last-loop"]) * LOOPS == core_bytes(caches["per-loop"])
    # prefill then score only the continuation
    res = teacher_forced_loss(net, ids, loops=LOOPS, kv_cache="last-loop", prompt_len=4)
    assert res.tokens == ids.shape[0] * (ids.shape[1] - 4)


@pytest.mark.parametrize("route_replay", [False, True])
def test_per_pass_recompute_gives_the_same_loss_and_gradients(mesh1, route_replay):
    cfg = tiny(route_replay=route_replay, flatten=2)
    ids = tokens(cfg)
    results = []
    for recompute in ("none", "pass"):
        net = model(cfg, recompute).train()
        loss = net(ids[:, :-1], labels=ids[:, 1:], loops=LOOPS)[LOOPS].mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert ga.keys() == gb.keys() and any("self_attention" in n for n in ga)
    for name, g in ga.items():
        torch.testing.assert_close(gb[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_what_the_mode_cannot_express_is_refused(mesh1):
    net = model(tiny()).train()
    ids = tokens(tiny())
    with pytest.raises(ValueError, match="one exit per micro-batch"):
        net(ids[:, :-1], labels=ids[:, 1:], loops=LOOPS, exits=(1,))
    with pytest.raises(ConfigError, match=r"parallel\.pipeline=1"):
        build_model(tiny(), ParallelConfig(pipeline=2))


@pytest.mark.parametrize(
    "override", ["schedule.sampler=telescopic", "schedule.sampler=fixed_exits;schedule.exits=[1,2]"]
)
def test_a_job_the_mode_cannot_run_is_refused_before_it_starts(override):
    from elastic_pretrain.job_loader import load_job
    from tests.conftest import REPO

    load_job(REPO / "jobs" / "tiny-cpu.yaml", ["model.kv_training=last_loop"])  # the mode itself is accepted
    with pytest.raises(ConfigError, match="kv_training=same_pass"):
        load_job(
            REPO / "jobs" / "tiny-cpu.yaml",
            ["model.kv_training=last_loop", "model.loop_conditioning=false", *override.split(";")],
        )


def test_evaluation_at_several_loops_runs_one_forward_per_loop(mesh1):
    """One L_max run with an exit per ℓ would attend to L_max's final K/V: evaluation runs each ℓ on its own."""
    from elastic_pretrain.eval.loss import loss_by_loops

    net = model(tiny())
    ids = tokens(tiny())
    assert net.one_exit_per_run
    got = loss_by_loops(net, ids, [1, 2, 3])
    net.eval()
    with torch.no_grad():
        for ell in (1, 2, 3):
            logits = net(ids[:, :-1], loops=ell)[ell]
            want = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
            assert got[ell] == pytest.approx(float(want), rel=1e-5)
