"""GPU-only checks (``pytest -m gpu``; skipped without CUDA): the TE-spec model trains with FP8 inside
the forward, per-pass recompute gives the TE model's gradients, and the memory estimate's per-pass
growth matches the measured peak. bench/gpu_check.sh runs these (its pytest_gpu section)."""

from __future__ import annotations

import pytest
import torch

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel import megatron as pm
from elastic_pretrain.parallel.mesh import ParallelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PAR = ParallelConfig()
SHAPE = dict(
    hidden_size=256,
    num_heads=8,
    ffn_hidden_size=512,
    prelude_layers=1,
    coda_layers=1,
    core_layers=2,
    num_experts=4,
    loops=2,
    flatten=2,
    moe_ffn_hidden_size=256,
    route_replay=True,
)


def tokens(b: int = 2, s: int = 256) -> torch.Tensor:
    return torch.randint(0, 257, (b, s + 1), generator=torch.Generator().manual_seed(0)).cuda()


@pytest.fixture
def mesh(mesh1):
    return mesh1


def fp8_state_manager():
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except ImportError:  # newer TE
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    return FP8GlobalStateManager


def test_te_is_what_build_model_uses(mesh):
    assert pm.te_available(), "CUDA without Transformer Engine: install it (NGC PyTorch container) for the GPU path"


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_runs_inside_the_forward_of_every_layer(mesh, recipe):
    state = fp8_state_manager()
    torch.manual_seed(0)
    recompute = "none" if recipe == "delayed" else "pass"  # delayed + pass is refused (docs/gpu.md)
    net = pm.build_model(ModelConfig(**SHAPE, dtype="bf16", fp8=recipe), PAR, recompute=recompute).train()
    seen = {"fp8": 0, "other": 0}

    def hook(*args):
        seen["fp8" if state.is_fp8_enabled() else "other"] += 1

    for m in net.modules():  # every TE GEMM (the output layer is megatron's own linear, in bf16)
        if type(m).__module__.startswith("megatron.core.extensions") and "Linear" in type(m).__name__:
            m.register_forward_pre_hook(hook)
    x = tokens()
    loss = net(x[:, :-1], labels=x[:, 1:], loops=4)[4].float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert seen["fp8"] > 0 and seen["other"] == 0, seen


def test_recompute_pass_gives_the_same_gradients_on_the_te_model(mesh):
    grads = {}
    for mode in ("none", "pass"):
        torch.manual_seed(0)
        net = pm.build_model(ModelConfig(**SHAPE, dtype="fp32"), PAR, recompute=mode).train()
        x = tokens()
        net(x[:, :-1], labels=x[:, 1:], loops=3, exits=(1,))[3].mean().backward()
        grads[mode] = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["pass"][name], g, rtol=1e-4, atol=1e-6)


def test_memory_estimate_per_pass_growth_matches_the_measured_peak(mesh):
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.parallel.memory import estimate_memory
    from tests.conftest import REPO

    job = load_job(
        REPO / "jobs" / "tiny-cpu.yaml",
        [
            "parallel=single",
            "model.hidden_size=1024",
            "model.num_heads=16",
            "model.ffn_hidden_size=4096",
            "model.moe_ffn_hidden_size=512",
            "model.core_layers=2",
            "model.flatten=1",
            "model.loops=4",
            "model.dtype=bf16",
            "data.seq_len=2048",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
        ],
    )
    est = estimate_memory(job, 1).stages[0].activation_bytes["none"]
    net = pm.build_model(job.model, PAR).train()
    x = tokens(2, 2048)
    peaks = {}
    for ell in (3, 1, 3):  # the first run warms up kernels and the allocator and allocates every pass's gradients
        net.zero_grad(set_to_none=False)  # gradients stay allocated after the first step
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        net(x[:, :-1], labels=x[:, 1:], loops=ell)[ell].float().mean().backward()
        torch.cuda.synchronize()
        peaks[ell] = torch.cuda.max_memory_allocated() - before
    measured, estimated = (peaks[3] - peaks[1]) / 2, (est[3] - est[1]) / 2
    assert measured == pytest.approx(estimated, rel=0.25), (measured / 2**20, estimated / 2**20)
