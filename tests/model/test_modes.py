"""The looped model's run modes (``RunModes``: ghost passes, per-pass recompute, loop conditioning) have one typed
surface: the constructor (``build_model``) and ``set_modes``. A mode set as an attribute is refused (it would set
a field no forward reads), and the per-token decider run steps the model through public methods only (issue 34,
item 2)."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from elastic_pretrain.model import decider, looped
from elastic_pretrain.model.config import ModelConfig, RunModes
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig

PAR = ParallelConfig()
CFG = ModelConfig(
    hidden_size=32,
    num_heads=4,
    ffn_hidden_size=64,
    core_layers=2,
    num_experts=4,
    loops=2,
    moe_top_k=2,
    moe_ffn_hidden_size=32,
    prelude_layers=1,
    coda_layers=1,
)


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))


def loss(net: looped.LoopedMoEModel, tokens: torch.Tensor, loops: int = 2, **kw) -> torch.Tensor:
    return net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops, **kw)[loops].mean()


@pytest.mark.parametrize(
    ("attribute", "value"), [("ghosts", "full_passes"), ("recompute", "pass"), ("conditioning_active", True)]
)
def test_a_mode_set_as_an_attribute_is_refused(mesh1, attribute, value):
    net = build_model(CFG, PAR)
    with pytest.raises(AttributeError, match=r"is a run mode: .*set_modes\("):
        setattr(net, attribute, value)
    assert net.modes == RunModes()


def test_build_model_hands_the_modes_to_the_model_and_set_modes_changes_only_the_named_ones(mesh1):
    net = build_model(CFG, PAR, recompute="pass", ghosts="full_passes")
    assert net.modes == RunModes(ghosts="full_passes", recompute="pass")
    before = net.set_modes(conditioning=True)
    assert before == RunModes(ghosts="full_passes", recompute="pass")
    assert net.modes == RunModes(ghosts="full_passes", recompute="pass", conditioning=True)
    assert (net.ghosts, net.recompute, net.conditioning_active) == ("full_passes", "pass", True)
    assert net.one_exit_per_run  # the conditioning heads condition each ℓ on its own target


@pytest.mark.parametrize(("field", "value"), [("ghosts", "all_calls"), ("recompute", "full"), ("conditioning", "yes")])
def test_run_modes_refuse_a_value_outside_their_type(field, value):
    with pytest.raises(ValueError, match=rf"RunModes\.{field}="):
        RunModes(**{field: value})


def test_the_modes_reach_the_forward(mesh1, monkeypatch):
    net = build_model(CFG, PAR).train()
    tokens = batch()
    with torch.no_grad():
        net.loop_conditioning.out.weight.normal_(0.0, 0.1)  # zero-init: make it matter
    plain = loss(net, tokens)
    net.set_modes(conditioning=True)
    conditioned = loss(net, tokens)
    assert conditioned.item() != pytest.approx(plain.item())
    net.set_modes(conditioning=False)
    assert torch.equal(loss(net, tokens), plain)

    checkpointed, full_ghosts = [], []
    real_checkpoint, real_full = looped.checkpoint_pass, looped.LoopedMoEModel._run_with_full_ghosts
    monkeypatch.setattr(looped, "checkpoint_pass", lambda *a: checkpointed.append(1) or real_checkpoint(*a))
    monkeypatch.setattr(
        looped.LoopedMoEModel,
        "_run_with_full_ghosts",
        lambda self, *a, **kw: full_ghosts.append(1) or real_full(self, *a, **kw),
    )
    one = loss(net, tokens, loops=1, sync_loops=2)  # a deeper partner: ghost MoE calls
    assert (checkpointed, full_ghosts) == ([], [])
    net.set_modes(recompute="pass")
    recomputed = loss(net, tokens)
    assert len(checkpointed) == 2 and torch.equal(recomputed, plain)  # one checkpointed run per pass, same loss
    net.set_modes(recompute="none", ghosts="full_passes")
    assert torch.equal(loss(net, tokens, loops=1, sync_loops=2), one)
    assert full_ghosts == [1]


def test_the_per_token_decider_run_uses_only_public_methods_of_the_model():
    tree = ast.parse(inspect.getsource(decider))
    private = sorted(
        f"{node.value.id}.{node.attr} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "model"
        and node.attr.startswith("_")
    )
    assert private == []
