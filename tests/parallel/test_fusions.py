"""Throughput switches (parallel/fusions.py): auto = on with CUDA + TE and off without; an explicit request
on a machine without them is a one-line error; the resolved values reach megatron's TransformerConfig."""

from __future__ import annotations

import dataclasses
import subprocess
from typing import Any

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from elastic_pretrain.config import ConfigError
from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel import fusions, megatron
from elastic_pretrain.parallel.mesh import ParallelConfig
from tests.conftest import REPO, VENV_BIN

# the tests of what a machine without CUDA + TE does (skipped on one that has them)
without_gpu_kernels = pytest.mark.skipif(fusions.cuda_te_available(), reason="CUDA and Transformer Engine present")

SWITCHES = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
            "cross_entropy_loss_fusion", "moe_permute_fusion", "moe_router_fusion", "moe_grouped_gemm")


def resolved_kwargs(monkeypatch, model: ModelConfig) -> dict[str, Any]:
    """The keyword arguments transformer_config() hands megatron's TransformerConfig (recorded: the real one
    checks in __post_init__ that TE's fused kernels import, which they cannot here)."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(megatron, "TransformerConfig", lambda **kw: seen.update(kw) or kw)
    megatron.transformer_config(model, ParallelConfig())
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(seen) <= fields, set(seen) - fields  # every switch is a real TransformerConfig field
    return seen


@without_gpu_kernels
def test_cpu_resolves_every_switch_off():
    config = megatron.transformer_config(ModelConfig(), ParallelConfig())  # the real TransformerConfig
    assert [getattr(config, name) for name in SWITCHES] == [False] * len(SWITCHES)
    assert config.gradient_accumulation_fusion is False and config.persist_layer_norm is False


def test_simulated_cuda_te_turns_them_on(monkeypatch):
    monkeypatch.setattr(fusions, "cuda_te_available", lambda: True)
    kw = resolved_kwargs(monkeypatch, ModelConfig())
    assert {name: kw[name] for name in SWITCHES} == dict.fromkeys(SWITCHES, True)
    # explicit off wins over auto; the grouped GEMM switch is separate
    kw = resolved_kwargs(monkeypatch, ModelConfig(fusions="off", moe_grouped_gemm="on"))
    assert kw["moe_grouped_gemm"] is True
    assert [kw[name] for name in SWITCHES if name != "moe_grouped_gemm"] == [False] * (len(SWITCHES) - 1)


def test_route_replay_keeps_the_router_unfused(monkeypatch):
    """megatron's fused top-k never consults RouterReplay: with it, passes >= 1 would silently route afresh."""
    monkeypatch.setattr(fusions, "cuda_te_available", lambda: True)
    kw = resolved_kwargs(monkeypatch, ModelConfig(route_replay=True))
    assert kw["moe_router_fusion"] is False and kw["moe_permute_fusion"] is True


def test_flex_dispatcher_needs_deepep(monkeypatch):
    monkeypatch.setattr(fusions, "cuda_te_available", lambda: True)
    with pytest.raises(ConfigError, match="needs DeepEP"):
        fusions.resolve(ModelConfig(moe_dispatcher="flex"))


@pytest.mark.parametrize(("override", "message"), [
    (dict(fusions="on"), "model.fusions=on needs CUDA and Transformer Engine"),
    (dict(moe_grouped_gemm="on"), "model.moe_grouped_gemm=on needs CUDA and Transformer Engine"),
    (dict(moe_dispatcher="flex"), "model.moe_dispatcher=flex needs CUDA"),
])
@without_gpu_kernels
def test_explicit_request_on_cpu_is_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        megatron.transformer_config(ModelConfig(**override), ParallelConfig())


@without_gpu_kernels
def test_cli_prints_one_line_naming_the_fix(tmp_path):
    proc = subprocess.run(
        [str(VENV_BIN / "elastic-pretrain"), "train", "jobs/tiny-cpu.yaml", "parallel=single", "model.fusions=on",
         "--run-dir", str(tmp_path / "run"), "tracking.backend=none"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == ["elastic-pretrain train: error: model.fusions=on needs CUDA and Transformer Engine, which this "
                      "machine lacks: use model.fusions=auto (on where they exist) or off"]


def test_unquoted_on_off_in_yaml_are_the_switch_values():
    """YAML 1.1 reads ``fusions: on`` as true: a Literal offering "on"/"off" takes the boolean back."""
    from elastic_pretrain.config import apply_overrides, build

    data = apply_overrides({}, ["fusions=on", "moe_grouped_gemm=off"])
    assert data == {"fusions": True, "moe_grouped_gemm": False}
    model = build(ModelConfig, data)
    assert (model.fusions, model.moe_grouped_gemm) == ("on", "off")
    with pytest.raises(ConfigError, match="is not one of"):
        build(ModelConfig, {"dtype": True})  # no on/off among its values: still refused
