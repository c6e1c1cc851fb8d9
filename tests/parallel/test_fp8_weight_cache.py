"""Transformer Engine's FP8 weight cache is refreshed once per step, by whatever model object the schedule is
handed, and evaluation never runs on weights from before the last update (issue 30, item 2); TE's fused
weight-gradient accumulation as configured on a GPU keeps every pass's gradient (item 6).

Stand-in of TE's contract and the run: tests/dist/fp8_weight_cache.py. PP = 1 here, in one process; PP = 2 in
the 4-process launch of tests/parallel/test_pipeline.py (``test_fp8_weights_follow_the_optimizer_at_pp2``).
"""

from __future__ import annotations

import torch

from elastic_pretrain.parallel import fusions, megatron
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig
from tests.dist.fp8_weight_cache import MICRO, MODEL, ROWS, SEQ, check_phases, install_stand_ins, run


def test_fp8_weights_follow_the_optimizer_at_pp1(mesh1) -> None:
    """megatron's schedule flags DDP's modules before micro-batch 0; ``loss_by_loops`` calls the model
    directly and flags them itself (before, evaluation used the FP8 copy cast before the last update)."""
    result = run(ParallelConfig(), pp_size=1)
    assert any(".experts." in n for n in result["layers"]) and any("linear_qkv" in n for n in result["layers"])
    check_phases(result)


def main_grads(params: dict[str, torch.Tensor], config: dict[str, bool]) -> dict[str, torch.Tensor]:
    """fp32 ``main_grad`` of every parameter after one step's forward/backward (megatron's schedule and DDP, two
    micro-batches at ℓ = 2) with the stand-ins, the config's wgrad fields set to ``config``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from elastic_pretrain.parallel.pipeline import MicroBatch
    from elastic_pretrain.schedule import DepthPlan
    from elastic_pretrain.train.step import _forward_step
    from tests.dist.equivalence import wrap_ddp_for_test

    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # see tests/dist/fp8_weight_cache.py run()
    net = build_model(MODEL, ParallelConfig())
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(params[name])
    for name, value in config.items():  # as transformer_config() sets them on a CUDA + TE machine
        setattr(net.config, name, value)
    net.config.fp8, net.config.fp8_recipe = "hybrid", "tensorwise"
    install_stand_ins(net)
    model = wrap_ddp_for_test(net)
    tokens = torch.randint(0, MODEL.vocab_size, (MICRO, ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    micro = [MicroBatch(tokens[i], DepthPlan(2, (2,), group_loops=2)) for i in range(MICRO)]
    model.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(micro),
        model=[model],
        num_microbatches=MICRO,
        seq_length=SEQ,
        micro_batch_size=ROWS,
        forward_only=False,
    )
    return {n: p.main_grad.detach().clone() for n, p in net.named_parameters()}


def test_fused_wgrad_accumulation_keeps_every_pass_gradient(mesh1, monkeypatch) -> None:
    """Issue 30, item 6, by TE's contract (:class:`tests.dist.fp8_weight_cache.FusedWgrad`): with fused
    accumulation TE overwrites main_grad in the backward of an ``is_first_microbatch=True`` call. The shared
    experts run twice per micro-batch; the first call's backward runs last and would drop the second pass's
    gradient of micro-batch 0. With the config transformer_config() gives a CUDA + TE machine (the cache
    disabled, so TE gets ``None``) the gradients are the unfused ones; with the cache kept they are not."""
    torch.manual_seed(0)
    state = {n: p.detach().clone() for n, p in build_model(MODEL, ParallelConfig()).named_parameters()}
    unfused = main_grads(state, {"gradient_accumulation_fusion": False, "disable_parameter_transpose_cache": False})
    with monkeypatch.context() as patch:
        patch.setattr(fusions, "cuda_te_available", lambda: True)
        gpu = megatron._wgrad_kwargs(True)
    assert gpu == {"gradient_accumulation_fusion": True, "disable_parameter_transpose_cache": True}
    fused = main_grads(state, gpu)
    experts = [n for n in unfused if ".experts." in n]
    assert experts and all(unfused[n].abs().sum() > 0 for n in experts)
    for name, want in unfused.items():  # fp32, the same products added in another order
        torch.testing.assert_close(fused[name], want, rtol=1e-5, atol=1e-7, msg=name)
    cached = main_grads(state, {"gradient_accumulation_fusion": True, "disable_parameter_transpose_cache": False})
    assert any(not torch.allclose(cached[n], unfused[n], rtol=1e-3, atol=1e-6) for n in experts)
