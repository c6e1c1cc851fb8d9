"""model.fp8 on a CPU machine: refused (one line naming the fix), FP8-incompatible shapes refused at
config time, the TransformerConfig FP8 fields per recipe, and the FP8 autocast entered around every
layer call of the looped model (which bypasses megatron's TransformerBlock, where megatron enters it):
counted with a stand-in for megatron's ``get_fp8_context`` (TE cannot run here)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from elastic_pretrain.config import ConfigError
from elastic_pretrain.job import load_job
from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel import megatron as pm
from elastic_pretrain.parallel.mesh import ParallelConfig
from tests.conftest import REPO

PAR = ParallelConfig()
FP8_SHAPE = dict(hidden_size=64, num_heads=4, ffn_hidden_size=128, moe_ffn_hidden_size=32, dtype="bf16")


def test_fp8_on_a_machine_without_cuda_and_te_is_refused_not_dropped(mesh1):
    cfg = ModelConfig(**FP8_SHAPE, fp8="tensorwise")
    with pytest.raises(ConfigError, match=r"model.fp8=tensorwise needs CUDA and Transformer Engine.*model.fp8=off"):
        pm.transformer_config(cfg, PAR)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.fp8=delayed"], r"model.fp8=delayed needs model.dtype=bf16"),
        (["model.fp8=tensorwise", "model.dtype=bf16", "model.hidden_size=72", "model.num_heads=4"],
         r"model.hidden_size=72 is not a multiple of 16"),
        (["model.fp8=mxfp8", "model.dtype=bf16", "model.hidden_size=80", "model.moe_ffn_hidden_size=96"],
         r"model.hidden_size=80 is not a multiple of 32"),
        (["model.fp8=blockwise", "model.dtype=bf16", "model.hidden_size=96", "model.moe_ffn_hidden_size=96",
          "data.seq_len=20", "train.micro_batch_size=1", "train.global_batch_size=2"],
         r"20 tokens per micro-batch .* not a multiple of 16"),
        (["model.fp8=tensorwise", "model.dtype=bf16", "model.hidden_size=96", "model.moe_ffn_hidden_size=96",
          "model.ffn_hidden_size=272", "parallel=cpu-tp2"],
         r"model.ffn_hidden_size=272 is not a multiple of 32"),  # 136 per TP rank
        (["model.fp8=delayed", "model.dtype=bf16", "model.hidden_size=96", "model.moe_ffn_hidden_size=96",
          "train.recompute=pass"],
         r"model.fp8=delayed with train.recompute=pass.*model.fp8=tensorwise"),
    ],
)
def test_fp8_incompatible_shapes_are_refused_when_the_job_is_read(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_job(REPO / "jobs" / "tiny-cpu.yaml", overrides)


def test_an_fp8_compatible_job_validates():
    job = load_job(REPO / "jobs" / "tiny-cpu.yaml",
                   ["model.fp8=tensorwise", "model.dtype=bf16", "model.hidden_size=96", "model.moe_ffn_hidden_size=96"])
    assert job.model.fp8 == "tensorwise"


@pytest.mark.parametrize(("recipe", "fmt"), [("delayed", "hybrid"), ("tensorwise", "hybrid"),
                                             ("blockwise", "e4m3"), ("mxfp8", "e4m3")])
def test_transformer_config_gets_the_recipe(mesh1, monkeypatch, recipe, fmt):
    """With TE and CUDA present (stood in: megatron's TE version checks and our availability probe)."""
    from megatron.core.transformer import transformer_config as tc

    monkeypatch.setattr(pm, "te_available", lambda: True)
    monkeypatch.setattr(tc, "is_te_min_version", lambda *a, **k: True)
    config = pm.transformer_config(ModelConfig(**FP8_SHAPE, fp8=recipe), PAR)
    assert (config.fp8, config.fp8_recipe) == (fmt, recipe)
    # delayed scaling reduces amax histories at every autocast exit: TP only, since replicas may run different ℓ
    assert config.tp_only_amax_red is (recipe == "delayed")
    assert pm.transformer_config(ModelConfig(**FP8_SHAPE), PAR).fp8 is None


@pytest.mark.parametrize("recompute", ["none", "pass"])
def test_fp8_context_is_entered_around_every_layer_call(mesh1, monkeypatch, recompute):
    from megatron.core import fp8_utils

    cfg = ModelConfig(**{**FP8_SHAPE, "dtype": "fp32"}, prelude_layers=1, coda_layers=1, core_layers=2, flatten=2,
                      loops=2, num_experts=2)
    torch.manual_seed(0)
    net = pm.build_model(cfg, PAR, recompute=recompute).train()
    net.config.fp8 = "hybrid"  # what a TE machine's config holds; the model reads it at every call
    entered: list[int] = []
    inside = {"depth": 0}

    @contextlib.contextmanager
    def stand_in(config, layer_no=-1, is_init=False):
        assert config is net.config and not is_init
        entered.append(layer_no)
        inside["depth"] += 1
        try:
            yield
        finally:
            inside["depth"] -= 1

    monkeypatch.setattr(fp8_utils, "get_fp8_context", stand_in)
    # under FP8 a pass is checkpointed by TE's checkpoint (keeps the forward's scaling for the re-run):
    # stood in by ours, recording that it was the one called
    from megatron.core.extensions import transformer_engine as te_ext

    from elastic_pretrain.model.recompute import checkpoint_pass

    te_calls: list[int] = []

    def te_checkpoint(run, distribute, get_rng_tracker, tp_group, *args):
        assert distribute is False
        te_calls.append(len(args))
        return checkpoint_pass(run, *args)

    monkeypatch.setattr(te_ext, "te_checkpoint", te_checkpoint)
    # and the layers' GEMMs run inside it: every attention / MLP linear sees depth 1
    depths: list[int] = []
    for module in net.modules():
        if type(module).__name__ in ("ColumnParallelLinear", "RowParallelLinear") and module is not net.output_layer:
            module.register_forward_hook(lambda *a: depths.append(inside["depth"]))
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    loops = 3
    out = net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops)
    prelude, core, coda = 0, 1, 2  # megatron layer numbers 1, 2, 3 -> layer_no 0, 1, 2 (core_layers_built = 1)
    assert entered == [prelude] + [core] * loops + [coda]  # once per layer call: ℓ passes of the core layer
    assert depths and set(depths) == {1}
    entered.clear()
    out[loops].sum().backward()
    assert entered == ([core] * loops if recompute == "pass" else [])  # the re-run passes enter it again
    assert len(te_calls) == (loops if recompute == "pass" else 0)
    net.config.fp8 = None
    assert dataclasses.is_dataclass(net.config)
