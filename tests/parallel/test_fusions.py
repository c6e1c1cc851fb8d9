"""Throughput switches (parallel/fusions.py): auto = on with CUDA + TE and off without; an explicit request
on a machine without them is a one-line error; the resolved values reach megatron's TransformerConfig.
Fused weight-gradient accumulation per machine (CUDA, TE and Apex stood in)."""

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

SWITCHES = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "cross_entropy_loss_fusion",
    "moe_permute_fusion",
    "moe_router_fusion",
    "moe_grouped_gemm",
)


def resolved_kwargs(monkeypatch, model: ModelConfig, **options: Any) -> dict[str, Any]:
    """The keyword arguments transformer_config() hands megatron's TransformerConfig (recorded: the real one
    checks in __post_init__ that TE's fused kernels import, which they cannot here)."""
    seen: dict[str, Any] = {}
    with monkeypatch.context() as patch:
        patch.setattr(megatron, "TransformerConfig", lambda **kw: seen.update(kw) or kw)
        megatron.transformer_config(model, ParallelConfig(), **options)
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


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (dict(fusions="on"), "model.fusions=on needs CUDA and Transformer Engine"),
        (dict(moe_grouped_gemm="on"), "model.moe_grouped_gemm=on needs CUDA and Transformer Engine"),
        (dict(moe_dispatcher="flex"), "model.moe_dispatcher=flex needs CUDA"),
    ],
)
@without_gpu_kernels
def test_explicit_request_on_cpu_is_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        megatron.transformer_config(ModelConfig(**override), ParallelConfig())


@without_gpu_kernels
def test_cli_prints_one_line_naming_the_fix(tmp_path):
    proc = subprocess.run(
        [
            str(VENV_BIN / "elastic-pretrain"),
            "train",
            "jobs/tiny-cpu.yaml",
            "parallel=single",
            "model.fusions=on",
            "--run-dir",
            str(tmp_path / "run"),
            "tracking.backend=none",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [
        "elastic-pretrain train: error: model.fusions=on needs CUDA and Transformer Engine, which this "
        "machine lacks: use model.fusions=auto (on where they exist) or off"
    ]


def test_unquoted_on_off_in_yaml_are_the_switch_values():
    """YAML 1.1 reads ``fusions: on`` as true: a Literal offering "on"/"off" takes the boolean back."""
    from elastic_pretrain.config import apply_overrides, build

    data = apply_overrides({}, ["fusions=on", "moe_grouped_gemm=off"])
    assert data == {"fusions": True, "moe_grouped_gemm": False}
    model = build(ModelConfig, data)
    assert (model.fusions, model.moe_grouped_gemm) == ("on", "off")
    with pytest.raises(ConfigError, match="is not one of"):
        build(ModelConfig, {"dtype": True})  # no on/off among its values: still refused


@pytest.mark.parametrize(
    ("cuda_te", "apex", "main_grad", "layers", "head"),
    [
        (False, False, True, False, False),  # a CPU machine (this one): nothing changes
        (True, True, True, True, True),  # CUDA + TE + Apex, the trainer's model (megatron DDP)
        (True, False, True, True, False),  # CUDA + TE without Apex: TE's linears only, the output layer unfused
        (True, True, False, False, False),  # a bare model (DeepSpeed, benches): no main_grad to accumulate into
    ],
    ids=["cpu", "cuda-te-apex", "cuda-te-no-apex", "no-main-grad"],
)
def test_fused_weight_gradient_accumulation_resolves_per_machine(monkeypatch, cuda_te, apex, main_grad, layers, head):
    """Issue 30, item 6: without it the ℓ passes' weight gradients of a shared expert are summed in bf16 by
    autograd before reaching the fp32 main_grad. With TE's fused accumulation every pass's wgrad GEMM adds
    into main_grad — and megatron's TE layers must then pass is_first_microbatch=None, or TE's first-micro-batch
    call would overwrite main_grad, dropping the other passes' gradients (disable_parameter_transpose_cache)."""
    config = megatron.transformer_config(ModelConfig(), ParallelConfig())  # this CPU machine's, the real class
    assert (config.gradient_accumulation_fusion, config.disable_parameter_transpose_cache) == (False, False)
    monkeypatch.setattr(fusions, "cuda_te_available", lambda: cuda_te)
    monkeypatch.setattr(fusions, "apex_wgrad_available", lambda: apex)
    kw = resolved_kwargs(monkeypatch, ModelConfig(), main_grad=main_grad)
    assert kw["gradient_accumulation_fusion"] is layers
    assert kw["disable_parameter_transpose_cache"] is layers
    assert fusions.wgrad_fusion(main_grad=main_grad) == fusions.WgradFusion(te=layers, head=head)
    config.gradient_accumulation_fusion = layers  # what that machine's TransformerConfig holds
    out = megatron.output_layer_config(config)
    assert out.gradient_accumulation_fusion is head
    assert (out is config) == (head == layers)  # a copy only where the head differs; the layers keep theirs
    assert config.gradient_accumulation_fusion is layers


def test_without_apex_the_output_layer_builds_from_its_own_config(mesh1):
    """megatron's ColumnParallelLinear (the output layer) refuses fused accumulation without Apex's kernel —
    this machine has none — while TE's linears need none: the head gets a config with it off."""
    from megatron.core import tensor_parallel

    assert not fusions.apex_wgrad_available()
    config = megatron.transformer_config(ModelConfig(), ParallelConfig())
    config.gradient_accumulation_fusion = True  # as on a CUDA + TE machine, for the TE layers

    def head(cfg: TransformerConfig) -> Any:
        return tensor_parallel.ColumnParallelLinear(64, 128, config=cfg, init_method=cfg.init_method, bias=False)

    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        head(config)
    assert head(megatron.output_layer_config(config)).gradient_accumulation_fusion is False


def test_the_trainer_builds_its_model_for_megatron_ddp(monkeypatch):
    """The trainer's model gets main_grad buffers (megatron DDP), so it asks for the fused accumulation."""
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.train import session

    seen: dict[str, Any] = {}

    class Built(Exception):
        pass

    def build_model(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(session, "build_model", build_model)
    with pytest.raises(Built):
        session.build_session(load_job(REPO / "jobs" / "tiny-cpu.yaml", []), None)  # type: ignore[arg-type]
    assert seen["main_grad"] is True
