"""Incremental decoding: per-loop cache vs the real model, last-loop cache vs a naive reference, KV bytes."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

from elastic_pretrain.eval.loss import loss_by_loops
from elastic_pretrain.model.inference import LoopedDecoder, generate, kv_bytes_per_token, teacher_forced_loss
from elastic_pretrain.parallel.megatron import build_model
from tests.eval.conftest import PAR, TOL, tiny


def ids(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 257, (b, t), generator=torch.Generator().manual_seed(seed))


def token_by_token(dec: LoopedDecoder, x_BT: torch.Tensor) -> torch.Tensor:
    return torch.cat([dec.step(x_BT[:, t : t + 1]).logits_BSV for t in range(x_BT.shape[1])], 1)


@pytest.mark.parametrize("ell", [1, 4])
def test_per_loop_cache_matches_the_model_forward(model, ell):
    x = ids(2, 10, 1)
    with torch.no_grad():
        expected = model(x, loops=ell)[ell]
    dec = LoopedDecoder(model, loops=ell, kv_cache="per-loop")
    torch.testing.assert_close(token_by_token(dec, x), expected, **TOL)
    # a prefill of 6 tokens followed by single steps gives the same logits
    dec = LoopedDecoder(model, loops=ell, kv_cache="per-loop")
    mixed = torch.cat([dec.step(x[:, :6]).logits_BSV, token_by_token(dec, x[:, 6:])], 1)
    torch.testing.assert_close(mixed, expected, **TOL)


def test_per_loop_cache_with_route_replay_and_active_conditioning(mesh1):
    model = build_model(tiny(route_replay=True), PAR).eval()
    model.set_modes(conditioning=True)
    with torch.no_grad():
        model.loop_conditioning.out.weight.normal_(0, 0.5)
    x = ids(1, 8, 2)
    for ell in (2, 4):
        with torch.no_grad():
            expected = model(x, loops=ell)[ell]
        got = token_by_token(LoopedDecoder(model, loops=ell, kv_cache="per-loop"), x)
        torch.testing.assert_close(got, expected, **TOL)


def naive_last_loop_logits(model, x_BT: torch.Tensor, loops: int) -> torch.Tensor:
    """Last-loop semantics without a cache: at pass j token t attends to the last-pass K/V of tokens s < t and
    its own pass-j K/V. The last-pass K/V of all tokens are found by repeating a whole-sequence forward with
    explicit masks until they stop changing (token t depends only on tokens < t, so T sweeps are exact)."""
    t_len = x_BT.shape[1]
    rope = model.rotary_pos_emb(t_len)
    tri = torch.tril(torch.ones(t_len, t_len, dtype=torch.bool), diagonal=-1)  # s < t
    mask = torch.cat([tri, torch.eye(t_len, dtype=torch.bool)], dim=1)  # [T, 2T]: past last-pass | own
    cores = model.core_layers()
    last = [None] * len(cores)
    with torch.no_grad():
        emb = model.embedding(input_ids=x_BT, position_ids=None)
        h0 = emb
        for layer in model.prelude:
            h0, _ = layer(h0, attention_mask=None, rotary_pos_emb=rope)
        for _ in range(t_len):
            h, new_last = h0, []
            for j in range(loops):
                for i, core in enumerate(cores):
                    layer = core.attention_for(j)
                    sa = layer.self_attention
                    q, k, v = sa.get_query_key_value_tensors(layer.input_layernorm(h), None)
                    q = apply_rotary_pos_emb(q, rope, config=sa.config)
                    k = apply_rotary_pos_emb(k, rope, config=sa.config)
                    lk, lv = last[i] if last[i] is not None else (torch.zeros_like(k), torch.zeros_like(v))
                    keys, vals = torch.cat([lk, k]), torch.cat([lv, v])  # [2T, B, H, d]
                    scores = torch.einsum("tbhd,sbhd->bhts", q, keys) / math.sqrt(q.shape[-1])
                    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
                    ctx = torch.einsum("bhts,sbhd->tbhd", probs, vals).flatten(2)
                    h = h + sa.linear_proj(ctx)[0]
                    h = core.full_layer._forward_mlp(h)
                    if j == loops - 1:
                        new_last.append((k, v))
            last = new_last
        for layer in model.coda:
            h, _ = layer(h, attention_mask=None, rotary_pos_emb=rope)
        return model.logits(model.final_layernorm(h))[..., :257].transpose(0, 1)


def test_last_loop_cache_equals_naive_reference_and_per_loop_at_one_loop(model):
    x = ids(2, 7, 3)
    for ell in (1, 3):
        got = token_by_token(LoopedDecoder(model, loops=ell, kv_cache="last-loop"), x)
        torch.testing.assert_close(got, naive_last_loop_logits(model, x, ell), **TOL)
        # one step of several tokens is decoded one by one (same result)
        whole = LoopedDecoder(model, loops=ell, kv_cache="last-loop").step(x).logits_BSV
        torch.testing.assert_close(whole, got, rtol=0, atol=0)
    per_loop = token_by_token(LoopedDecoder(model, loops=1, kv_cache="per-loop"), x)
    torch.testing.assert_close(token_by_token(LoopedDecoder(model, loops=1, kv_cache="last-loop"), x), per_loop, **TOL)
    # beyond one loop the attention pattern differs from training's: the logits must differ
    a = token_by_token(LoopedDecoder(model, loops=3, kv_cache="last-loop"), x)
    b = token_by_token(LoopedDecoder(model, loops=3, kv_cache="per-loop"), x)
    assert (a[:, 1:] - b[:, 1:]).abs().max() > 1e-4
    torch.testing.assert_close(a[:, 0], b[:, 0], **TOL)  # the first token has no past


def test_kv_bytes_per_token(model):
    cfg = model.cfg  # one prelude, one coda, one built core layer; D = 32 fp32: 2·32·4 = 256 B per layer
    assert kv_bytes_per_token(cfg, "per-loop", 4) == 256 * (1 + 4 + 1)
    assert kv_bytes_per_token(cfg, "last-loop", 4) == kv_bytes_per_token(cfg, "last-loop", 1) == 256 * 3
    x = ids(2, 5, 4)
    for policy in ("per-loop", "last-loop"):
        for ell in (1, 4):
            dec = LoopedDecoder(model, loops=ell, kv_cache=policy)
            dec.step(x)
            assert dec.position == 5
            assert dec.cache.bytes_per_token() == kv_bytes_per_token(cfg, policy, ell)
            assert dec.cache.bytes_per_token("core") == 256 * (ell if policy == "per-loop" else 1)  # core only


def test_teacher_forced_loss_per_policy(model):
    tokens = ids(3, 9, 5)
    fixed = loss_by_loops(model, tokens)
    per_loop = teacher_forced_loss(model, tokens, loops=4, kv_cache="per-loop", batch_size=2)
    last_loop = teacher_forced_loss(model, tokens, loops=4, kv_cache="last-loop", batch_size=2)
    assert per_loop.loss == pytest.approx(fixed[4], abs=1e-5)
    assert per_loop.tokens == last_loop.tokens == 24 and per_loop.mean_passes == last_loop.mean_passes == 4
    assert math.isfinite(last_loop.loss) and abs(last_loop.loss - per_loop.loss) > 1e-6
    assert last_loop.kv_bytes_per_token < per_loop.kv_bytes_per_token
    one = [teacher_forced_loss(model, tokens, loops=1, kv_cache=p).loss for p in ("per-loop", "last-loop")]
    assert one[0] == pytest.approx(fixed[1], abs=1e-5) and one[1] == pytest.approx(one[0], abs=1e-5)


def test_greedy_generate_equals_argmax_of_full_forwards(model):
    prompt = [72, 105, 32]
    out = generate(model, prompt, loops=2, max_new_tokens=4, kv_cache="per-loop")
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(4):
            nxt = model(seq, loops=2)[2][:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out.tokens_BT, seq)
    assert out.passes_BN.tolist() == [[2, 2, 2]]  # fed tokens after the prompt (the last is never fed)
    last = generate(model, prompt, loops=2, max_new_tokens=4, kv_cache="last-loop")
    assert last.tokens_BT.shape == (1, 7) and last.kv_bytes_per_token == 256 * 3


def test_generate_sampling_eos_and_errors(model):
    g = torch.Generator().manual_seed(0)
    a = generate(model, ids(2, 3, 6), loops=1, max_new_tokens=5, temperature=1.0, generator=g)
    g = torch.Generator().manual_seed(0)
    b = generate(model, ids(2, 3, 6), loops=1, max_new_tokens=5, temperature=1.0, generator=g)
    assert torch.equal(a.tokens_BT, b.tokens_BT) and a.tokens_BT.shape == (2, 8)
    greedy = generate(model, ids(1, 3, 7), loops=1, max_new_tokens=1)
    first = int(greedy.tokens_BT[0, -1])
    stopped = generate(model, ids(1, 3, 7), loops=1, max_new_tokens=5, eos_id=first)
    assert stopped.tokens_BT.shape == (1, 4)  # EOS generated first: nothing after it
    with pytest.raises(ValueError, match="needs a stop function"):
        generate(model, [1, 2], loops="auto")
    with pytest.raises(ValueError, match="kv_cache"):
        LoopedDecoder(model, kv_cache="all")  # type: ignore[arg-type]
