"""The TE layer spec builds the same model as the local spec (docs/gpu.md, "Transformer Engine spec").

Transformer Engine cannot import here, so megatron's TE spec is built with TE's classes stood in by
local modules of the same interface (``TENorm`` → a torch norm, ``TELayerNormColumnParallelLinear``
→ norm + ``ColumnParallelLinear`` holding ``layer_norm_weight`` like TE's, TE linears/attention → the
local ones). The spec's *structure* is megatron's own: which norms it leaves to ``IdentityOp``
(fused into the next linear) and which it builds. The tests check that no norm the model needs is
an ``IdentityOp``, and that with the same weights the TE-spec model computes what the local-spec
model computes at every loop count — with the conditioning heads on and with the decider.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from elastic_pretrain.model.config import DeciderConfig, ModelConfig
from elastic_pretrain.model.decider import PerTokenRun
from elastic_pretrain.model.looped import LoopedMoEModel
from elastic_pretrain.model.vocab import padded_vocab_size
from elastic_pretrain.parallel.cpu_compat import SequenceParallelTorchNorm
from elastic_pretrain.parallel.megatron import layer_specs, transformer_config
from elastic_pretrain.parallel.mesh import ParallelConfig

PAR = ParallelConfig()


def _accepting(cls: type) -> type:
    """``cls`` taking (and dropping) the TE-only keyword arguments megatron passes to TE modules."""
    known = set(inspect.signature(cls.__init__).parameters)

    class StandIn(cls):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{k: v for k, v in kwargs.items() if k in known})

    StandIn.__name__ = StandIn.__qualname__ = f"StandIn{cls.__name__}"
    return StandIn


class StandInLayerNormColumnParallelLinear(_accepting(ColumnParallelLinear)):  # type: ignore[misc]
    """TE's fused norm + column-parallel linear: the norm's weight is ``layer_norm_weight`` as in TE."""

    def __init__(self, input_size: int, output_size: int, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        config = kwargs["config"]
        self.rms = config.normalization == "RMSNorm"
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size))
        self.layer_norm_bias = None if self.rms else torch.nn.Parameter(torch.zeros(input_size))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        shape = x.shape[-1:]
        if self.rms:
            x = F.rms_norm(x, shape, self.layer_norm_weight, self.eps)
        else:
            x = F.layer_norm(x, shape, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        return super().forward(x, *args, **kwargs)


@pytest.fixture
def te_standins(monkeypatch):
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    # gpt_layer_specs imports the provider only when TE imports
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(provider, "TENorm", SequenceParallelTorchNorm)
    monkeypatch.setattr(provider, "TELayerNormColumnParallelLinear", StandInLayerNormColumnParallelLinear)
    monkeypatch.setattr(provider, "TEColumnParallelLinear", _accepting(ColumnParallelLinear))
    monkeypatch.setattr(provider, "TERowParallelLinear", _accepting(RowParallelLinear))
    monkeypatch.setattr(provider, "TEDotProductAttention", _accepting(DotProductAttention))
    monkeypatch.setattr(provider, "is_te_min_version", lambda *a, **k: True)


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
        moe_z_loss_coeff=0.0,
    )
    return ModelConfig(**{**base, **kw})


def build(cfg: ModelConfig, backend: str, decider: DeciderConfig | None = None) -> LoopedMoEModel:
    return LoopedMoEModel(
        cfg,
        transformer_config(cfg, PAR),
        layer_specs(cfg, backend),  # type: ignore[arg-type]
        padded_vocab=padded_vocab_size(cfg.vocab_size, 1),
        decider=decider,
    )


def is_norm(module: Any) -> bool:
    return not isinstance(module, IdentityOp) and any(True for _ in module.parameters())


def unnormalised(model: LoopedMoEModel) -> list[str]:
    """Every place the model needs a norm and has none (an IdentityOp not fused into the next linear)."""
    missing = [] if is_norm(model.final_layernorm) else ["final_layernorm"]
    for name, layer in model.named_modules():
        if not isinstance(layer, TransformerLayer):
            continue
        qkv = layer.self_attention.linear_qkv
        if not (is_norm(layer.input_layernorm) or hasattr(qkv, "layer_norm_weight")):
            missing.append(f"{name}: attention input")
        if isinstance(layer.mlp, IdentityOp):  # an attention-only pass: its MLP half is pass 0's
            continue
        fused = not isinstance(layer.mlp, MoELayer) and hasattr(layer.mlp.linear_fc1, "layer_norm_weight")
        if not (is_norm(layer.pre_mlp_layernorm) or fused):
            missing.append(f"{name}: {'MoE' if isinstance(layer.mlp, MoELayer) else 'MLP'} input")
    return missing


@pytest.mark.parametrize("edge_mlp", ["dense", "moe"])
def test_te_spec_model_has_every_norm(mesh1, te_standins, edge_mlp):
    te = build(tiny(edge_mlp=edge_mlp), "te")
    # the TE spec really is the fused one (else this test checks nothing): norms live inside the linears
    first = te.prelude[0]
    assert isinstance(first.input_layernorm, IdentityOp)
    assert isinstance(first.self_attention.linear_qkv, StandInLayerNormColumnParallelLinear)
    assert unnormalised(te) == []
    assert unnormalised(build(tiny(edge_mlp=edge_mlp), "local")) == []


def to_te_names(state: dict[str, torch.Tensor], te_keys: set[str]) -> dict[str, torch.Tensor]:
    """Local-spec parameter names → TE-spec names (norms fused into the linear after them)."""
    out = {}
    for name, t in state.items():
        if name not in te_keys:
            suffix = "layer_norm_weight" if name.endswith(".weight") else "layer_norm_bias"
            for local, fused in (
                (".input_layernorm.", ".self_attention.linear_qkv."),
                (".pre_mlp_layernorm.", ".mlp.linear_fc1."),
            ):
                if local in name:
                    name = name.split(local)[0] + fused + suffix
        out[name] = t
    return out


@pytest.mark.parametrize(
    ("normalization", "backbone"), [("RMSNorm", "per_token"), ("LayerNorm", "per_token"), ("RMSNorm", "joint")]
)
def test_te_spec_computes_what_the_local_spec_computes(mesh1, te_standins, normalization, backbone):
    """Same weights → same logits at every ℓ, with the loop-conditioning heads on, and the same decider
    outputs (per-token depth, the default backbone, and the joint all-exits run): the heads and the decider
    work beside TE modules."""
    cfg = tiny(normalization=normalization)
    decider = DeciderConfig(hidden_size=16, backbone=backbone)
    torch.manual_seed(0)
    local = build(cfg, "local", decider).eval()
    te = build(cfg, "te", decider).eval()
    with torch.no_grad():  # non-trivial norms and heads (norms start at 1, the conditioning output at 0)
        for name, p in local.named_parameters():
            if "norm" in name or "loop_conditioning.out" in name:
                p.normal_(1.0 if "weight" in name and "norm" in name else 0.0, 0.1)
    mapped = to_te_names(local.state_dict(), set(te.state_dict()))
    missing, unexpected = te.load_state_dict(mapped, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected, (missing, unexpected)
    local.set_modes(conditioning=True)
    te.set_modes(conditioning=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, 1)
    with torch.no_grad():
        for ell in range(1, cfg.max_loops + 1):
            torch.testing.assert_close(te(tokens, loops=ell)[ell], local(tokens, loops=ell)[ell], rtol=0, atol=1e-6)
        te_run, local_run = te.forward_decider(tokens, labels), local.forward_decider(tokens, labels)
    if backbone == "per_token":
        assert isinstance(te_run, PerTokenRun) and isinstance(local_run, PerTokenRun)
        assert torch.equal(te_run.active_L_BT, local_run.active_L_BT)
        for field in ("exit_ce_BT", "ce_L_BT", "ahead_L_BT", "logit_LTB"):
            torch.testing.assert_close(getattr(te_run, field), getattr(local_run, field), rtol=0, atol=1e-6)
        return
    assert isinstance(te_run, tuple) and isinstance(local_run, tuple)
    (te_losses, te_logits), (local_losses, local_logits) = te_run, local_run
    torch.testing.assert_close(te_logits, local_logits, rtol=0, atol=1e-6)
    for ell in local_losses:
        torch.testing.assert_close(te_losses[ell], local_losses[ell], rtol=0, atol=1e-6)


def test_the_local_spec_is_announced_once_per_process(caplog: pytest.LogCaptureFixture) -> None:
    """Evaluation builds a model per checkpoint: the 'no Transformer Engine' line is said once, not per model."""
    from elastic_pretrain.parallel import megatron as pm

    pm._SAID["local_spec"] = False
    with caplog.at_level("INFO", logger=pm.log.name):
        for _ in range(3):
            layer_specs(tiny(), "local")
    assert [r.getMessage() for r in caplog.records].count(
        "no Transformer Engine/CUDA: using megatron-core's local layer spec (torch modules)"
    ) == 1
