"""model.fp8 on a CPU machine: refused (one line naming the fix), FP8-incompatible shapes refused at
config time, a recipe the GPU cannot run refused when the model is built (a stand-in compute capability),
the TransformerConfig FP8 fields per recipe, and where the FP8 autocast is entered: as megatron's
TransformerBlock does (the looped model bypasses it), once around the whole forward for ``delayed`` scaling and
around every layer call for the others — counted with a stand-in for megatron's ``get_fp8_context`` (TE
cannot run here)."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from elastic_pretrain.config import ConfigError
from elastic_pretrain.job_loader import load_job
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
        (
            ["model.fp8=tensorwise", "model.dtype=bf16", "model.hidden_size=72", "model.num_heads=4"],
            r"model.hidden_size=72 is not a multiple of 16",
        ),
        (
            ["model.fp8=mxfp8", "model.dtype=bf16", "model.hidden_size=80", "model.moe_ffn_hidden_size=96"],
            r"model.hidden_size=80 is not a multiple of 32",
        ),
        (
            [
                "model.fp8=blockwise",
                "model.dtype=bf16",
                "model.hidden_size=96",
                "model.moe_ffn_hidden_size=96",
                "data.seq_len=20",
                "train.micro_batch_size=1",
                "train.global_batch_size=2",
            ],
            r"20 tokens per micro-batch .* not a multiple of 16",
        ),
        (
            [
                "model.fp8=tensorwise",
                "model.dtype=bf16",
                "model.hidden_size=96",
                "model.moe_ffn_hidden_size=96",
                "model.ffn_hidden_size=272",
                "parallel=cpu-tp2",
            ],
            r"model.ffn_hidden_size=272 is not a multiple of 32",
        ),  # 136 per TP rank
        (
            [
                "model.fp8=delayed",
                "model.dtype=bf16",
                "model.hidden_size=96",
                "model.moe_ffn_hidden_size=96",
                "train.recompute=pass",
            ],
            r"model.fp8=delayed with train.recompute=pass.*model.fp8=tensorwise",
        ),
    ],
)
def test_fp8_incompatible_shapes_are_refused_when_the_job_is_read(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_job(REPO / "jobs" / "tiny-cpu.yaml", overrides)


def test_an_fp8_compatible_job_validates():
    job = load_job(
        REPO / "jobs" / "tiny-cpu.yaml",
        ["model.fp8=tensorwise", "model.dtype=bf16", "model.hidden_size=96", "model.moe_ffn_hidden_size=96"],
    )
    assert job.model.fp8 == "tensorwise"


@pytest.mark.parametrize(
    ("recipe", "fmt"), [("delayed", "hybrid"), ("tensorwise", "hybrid"), ("blockwise", "e4m3"), ("mxfp8", "e4m3")]
)
def test_transformer_config_gets_the_recipe(mesh1, monkeypatch, recipe, fmt):
    """With TE and CUDA present (stood in: megatron's TE version checks and our availability probe)."""
    from megatron.core.transformer import transformer_config as tc

    monkeypatch.setattr(pm, "te_available", lambda: True)
    monkeypatch.setattr(pm, "device_capability", lambda: (10, 0))
    monkeypatch.setattr(tc, "is_te_min_version", lambda *a, **k: True)
    config = pm.transformer_config(ModelConfig(**FP8_SHAPE, fp8=recipe), PAR)
    assert (config.fp8, config.fp8_recipe) == (fmt, recipe)
    # delayed scaling reduces amax histories at every autocast exit: TP only, since replicas may run different ℓ
    assert config.tp_only_amax_red is (recipe == "delayed")
    assert pm.transformer_config(ModelConfig(**FP8_SHAPE), PAR).fp8 is None


@pytest.mark.parametrize(
    ("recipe", "capability", "fix"),
    [
        ("mxfp8", (9, 0), "compute capability 10.0 or higher (Blackwell); this one is 9.0: set model.fp8=blockwise"),
        ("blockwise", (8, 9), "compute capability 9.0 or higher (Hopper); this one is 8.9: set model.fp8=tensorwise"),
        ("tensorwise", (8, 0), "compute capability 8.9 or higher (Ada or Hopper); this one is 8.0: set model.fp8=off"),
        ("delayed", (8, 0), "compute capability 8.9 or higher (Ada or Hopper); this one is 8.0: set model.fp8=off"),
    ],
)
def test_a_recipe_the_gpu_cannot_run_is_refused_when_the_model_is_built(mesh1, monkeypatch, recipe, capability, fix):
    """Transformer Engine would only assert inside the first forward; the refusal names the recipe to use."""
    from megatron.core.transformer import transformer_config as tc

    monkeypatch.setattr(pm, "te_available", lambda: True)
    monkeypatch.setattr(tc, "is_te_min_version", lambda *a, **k: True)
    monkeypatch.setattr(pm, "device_capability", lambda: capability)
    with pytest.raises(ConfigError, match=re.escape(f"model.fp8={recipe} needs a GPU of {fix}")) as err:
        pm.transformer_config(ModelConfig(**FP8_SHAPE, fp8=recipe), PAR)
    assert "\n" not in str(err.value)
    monkeypatch.setattr(pm, "device_capability", lambda: (10, 0))  # a Blackwell runs every recipe
    assert pm.transformer_config(ModelConfig(**FP8_SHAPE, fp8=recipe), PAR).fp8_recipe == recipe


class AutocastStandIn:
    """megatron's ``get_fp8_context`` (TE's ``fp8_autocast``), recording each entry's ``layer_no`` and whether
    a linear runs inside one."""

    def __init__(self, config) -> None:
        self.config, self.entered, self.depth = config, [], 0

    @contextlib.contextmanager
    def __call__(self, config, layer_no=-1, is_init=False):
        assert config is self.config and not is_init
        self.entered.append(layer_no)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


def fp8_model(monkeypatch, recipe: str, recompute: str = "none"):
    """A small model whose config holds what a TE machine's holds for ``recipe``, with the autocast stood in
    and the depth of autocasts recorded at every attention / MLP linear call."""
    from megatron.core import fp8_utils

    cfg = ModelConfig(
        **{**FP8_SHAPE, "dtype": "fp32"},
        prelude_layers=1,
        coda_layers=1,
        core_layers=2,
        flatten=2,
        loops=2,
        num_experts=2,
    )
    torch.manual_seed(0)
    net = pm.build_model(cfg, PAR, recompute=recompute).train()
    monkeypatch.setattr(net.config, "fp8", "hybrid" if recipe in ("delayed", "tensorwise") else "e4m3")
    monkeypatch.setattr(net.config, "fp8_recipe", recipe)  # the model reads both at every call
    autocast = AutocastStandIn(net.config)
    monkeypatch.setattr(fp8_utils, "get_fp8_context", autocast)
    depths: list[int] = []
    for module in net.modules():
        if type(module).__name__ in ("ColumnParallelLinear", "RowParallelLinear") and module is not net.output_layer:
            module.register_forward_hook(lambda *a: depths.append(autocast.depth))
    return cfg, net, autocast, depths


PRELUDE, CORE, CODA = 0, 1, 2  # megatron layer numbers 1, 2, 3 -> layer_no 0, 1, 2 (core_layers_built = 1)


@pytest.mark.parametrize(
    ("recipe", "recompute"), [("tensorwise", "none"), ("tensorwise", "pass"), ("blockwise", "none"), ("mxfp8", "none")]
)
def test_current_and_block_scaling_enter_the_autocast_around_every_layer_call(mesh1, monkeypatch, recipe, recompute):
    """As megatron's TransformerBlock for every recipe but ``delayed``: per layer (scales are per call)."""
    cfg, net, autocast, depths = fp8_model(monkeypatch, recipe, recompute)
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
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    loops = 3
    out = net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops)
    assert autocast.entered == [PRELUDE] + [CORE] * loops + [CODA]  # once per layer call: ℓ passes of the core layer
    assert depths and set(depths) == {1}  # every layer's GEMMs ran inside it
    autocast.entered.clear()
    out[loops].sum().backward()
    assert autocast.entered == ([CORE] * loops if recompute == "pass" else [])  # the re-run passes enter it again
    assert len(te_calls) == (loops if recompute == "pass" else 0)


def test_delayed_scaling_enters_the_autocast_once_per_forward(mesh1, monkeypatch):
    """megatron enters one autocast around all of a block's layers for ``delayed`` (every exit reduces and
    updates the amax histories; it refuses per-layer entry). The looped model: once per forward — with ghost
    MoE calls of mixed depth inside it, whatever entry point runs it — and a layer outside it is an error."""
    cfg, net, autocast, depths = fp8_model(monkeypatch, "delayed")
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    out = net(inputs, labels=labels, loops=2, exits=(1,), sync_loops=3)  # two exits, one ghost pass
    assert autocast.entered == [-1]  # layer_no -1: all layers
    assert depths and set(depths) == {1}  # every GEMM inside it, the ghost pass's experts too
    autocast.entered.clear()
    out[2].sum().backward()
    assert autocast.entered == []
    net.run_loops(inputs, loops=2, exits=(2,))  # an entry point of its own (decider loss)
    assert autocast.entered == [-1]
    with pytest.raises(RuntimeError, match=r"model\.fp8=delayed: a layer ran outside its forward's FP8 autocast"):
        net.embed(inputs, net.rotary_pos_emb(inputs.shape[1]))


@pytest.mark.parametrize(("recipe", "want"), [("delayed", [-1]), ("tensorwise", [CORE, CODA])])
def test_a_pipeline_chunk_with_its_head_is_one_forward(mesh1, monkeypatch, recipe, want):
    """The interleaved schedule's forward step runs a chunk and, on the last one, the head: under delayed
    scaling one autocast around both, as megatron's model chunk (parallel/pipeline.py ``_ChunkForward``)."""
    from types import SimpleNamespace

    from elastic_pretrain.parallel.pipeline import MicroBatch, _ChunkForward
    from elastic_pretrain.schedule import DepthPlan

    cfg, net, autocast, depths = fp8_model(monkeypatch, recipe)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    last = net.cfg.max_loops  # the last chunk: its pass, then the head
    chunk = SimpleNamespace(net=net, pass_idx=last - 1, input_tensor=torch.randn(16, 2, cfg.hidden_size))
    forward = _ChunkForward([last], loss_scale=1.0, training=True)
    losses, _ = forward(iter([(0, MicroBatch(tokens, DepthPlan(last, (last,))))]), chunk)
    assert set(losses) == {last}
    assert autocast.entered == want
    assert depths and set(depths) == {1}
