"""The looped model against megatron-core's GPTModel, sharing/untying, flattening invariants."""

from __future__ import annotations

import pytest
import torch

from elastic_pretrain.config import ConfigError
from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.model.vocab import padded_vocab_size
from elastic_pretrain.parallel.megatron import build_model, layer_specs, transformer_config
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
        moe_top_k=2,
        moe_ffn_hidden_size=32,
        moe_z_loss_coeff=0.0,
    )
    return ModelConfig(**{**base, **kw})


def test_parity_with_megatron_gpt_model(mesh1):
    """ℓ=1, flatten=1, no prelude/coda: logits equal a megatron-core GPTModel with copied weights."""
    from megatron.core.models.gpt import GPTModel

    cfg = tiny(loops=1, loop_conditioning=False)
    torch.manual_seed(0)
    ours = build_model(cfg, PAR).eval()
    gpt = GPTModel(
        config=transformer_config(cfg, PAR),
        transformer_layer_spec=layer_specs(cfg).moe,
        vocab_size=padded_vocab_size(cfg.vocab_size, 1),
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=cfg.rope_base,
        share_embeddings_and_output_weights=False,
    ).eval()
    mapped = {}
    for name, tensor in ours.state_dict().items():
        if name.startswith("core."):
            _, i, _, _, rest = name.split(".", 4)
            name = f"decoder.layers.{i}.{rest}"
        elif name.startswith("final_layernorm."):
            name = "decoder." + name
        mapped[name] = tensor
    missing, unexpected = gpt.load_state_dict(mapped, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    assert not unexpected, unexpected
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = gpt(tokens, position_ids=None, attention_mask=None)[..., : cfg.vocab_size]
        got = ours(tokens, loops=1)[1]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_attention_untied_experts_shared_and_all_passes_get_gradient(mesh1):
    cfg = tiny(loops=3, prelude_layers=1, coda_layers=1)
    model = build_model(cfg, PAR)
    core = model.core[0]
    assert len(core.passes) == 3
    qkv = [core.attention_for(j).self_attention.linear_qkv.weight for j in range(3)]
    assert len({id(w) for w in qkv}) == 3
    assert not torch.equal(qkv[0], qkv[1])
    # the MLP half of every pass is the single shared module, registered once
    assert all(isinstance(p.mlp, torch.nn.Module) for p in core.passes)
    names = [n for n, _ in model.named_parameters() if ".mlp." in n and n.startswith("core.0.")]
    assert names and all(n.startswith("core.0.passes.0.mlp.") for n in names)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:], loops=3)[3].mean()
    loss.backward()
    for j in range(3):
        g = core.attention_for(j).self_attention.linear_qkv.weight.grad
        assert g is not None and g.abs().sum() > 0, f"pass {j} attention got no gradient"
    assert core.shared_mlp.router.weight.grad.abs().sum() > 0


def test_shared_experts_receive_gradient_of_every_pass(mesh1):
    """The gradient of a shared expert equals the sum of its per-pass contributions (naive reference)."""
    cfg = tiny(loops=2, core_layers=1, moe_aux_loss_coeff=0.0)
    model = build_model(cfg, PAR)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    w = model.core[0].shared_mlp.router.weight
    model(tokens[:, :-1], labels=tokens[:, 1:], loops=2)[2].sum().backward()
    full = w.grad.clone()
    # Recompute with pass 1's MLP detached from the shared weights: the difference is pass 1's share.
    model.zero_grad(set_to_none=True)
    losses = model(tokens[:, :-1], labels=tokens[:, 1:], loops=1)[1].sum()
    losses.backward()
    assert not torch.allclose(full, w.grad), "pass 2 contributed nothing to the shared router"


@pytest.mark.parametrize("flatten", [1, 2, 4])
def test_flattening_keeps_expert_params_and_active_flops(mesh1, flatten):
    cfg = tiny(core_layers=4, num_experts=2, loops=2, flatten=flatten)
    model = build_model(cfg, PAR)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert = sum(p.numel() for p in model.core[0].shared_mlp.experts.local_experts[0].parameters())
    active = len(model.core) * cfg.max_loops * cfg.moe_top_k * per_expert  # MACs per token ∝ weights touched
    attention = sum(p.numel() for n, p in model.named_parameters() if ".self_attention." in n)
    ref = tiny(core_layers=4, num_experts=2, loops=2)
    ref_per_expert = 3 * ref.hidden_size * ref.moe_ffn_hidden_size  # SwiGLU: fc1 (2W x D) + fc2 (D x W)
    assert per_expert == ref_per_expert
    assert expert_params == 4 * 2 * ref_per_expert
    assert active == 4 * 2 * 2 * ref_per_expert
    assert attention == 4 * 2 * 4 * 32 * 32  # layers x passes (untied) x (qkv 3 + proj 1) x D x D
    assert len(model.core) == 4 // flatten and cfg.max_loops == 2 * flatten


def test_loops_out_of_range_is_a_clear_error(mesh1):
    cfg = tiny(loops=2)
    model = build_model(cfg, PAR)
    with pytest.raises(ConfigError, match=r"loops=3 is outside \[1, 2\]"):
        model(torch.zeros(1, 4, dtype=torch.long), loops=3)


def test_exits_share_one_forward(mesh1):
    """Losses at exit ℓ' inside an ℓ-pass run equal a separate ℓ'-pass run (same prefix)."""
    cfg = tiny(loops=3, coda_layers=1)
    model = build_model(cfg, PAR).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        both = model(tokens[:, :-1], labels=tokens[:, 1:], loops=3, exits=[1, 2])
        alone = model(tokens[:, :-1], labels=tokens[:, 1:], loops=2)
    assert sorted(both) == [1, 2, 3]
    torch.testing.assert_close(both[2], alone[2], rtol=0, atol=0)


def test_conditioning_head_leaves_the_rest_of_the_initialisation_unchanged(mesh1):
    """With and without the ELR heads, one seed gives the same value to every other parameter (experiments
    compare arms with and without heads as paired runs)."""
    models = {}
    for heads in (False, True):
        torch.manual_seed(1234)
        models[heads] = build_model(tiny(loops=3, prelude_layers=1, coda_layers=1, loop_conditioning=heads), PAR)
    without, with_heads = (dict(models[h].named_parameters()) for h in (False, True))
    extra = set(with_heads) - set(without)
    assert extra and all(k.startswith("loop_conditioning.") for k in extra)
    for name, p in without.items():
        assert torch.equal(p, with_heads[name]), name
