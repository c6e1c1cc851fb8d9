"""Transformer Engine's FP8 weight cache against the schedules (issue 30, item 2), with a stand-in of its contract.

A TE linear quantizes its weight and caches the FP8 copy; megatron's TE wrapper passes its attribute
``is_first_microbatch`` to TE and clears it after every call, and TE re-quantizes only on a call made with
``True`` (or ``None``: ``disable_parameter_transpose_cache``, no cache at all). megatron's schedules set the
attribute on every module through ``model.set_is_first_microbatch()`` before the first micro-batch of a step
— on whatever model object they were handed. :class:`CachedWeightLinear` is that contract on megatron's local
linears (TE cannot run on CPU): the "quantized" weight is a bf16-rounded copy of the fp32 weight, refreshed
only when told, and each call records whether the copy it used was the current weight's.

:func:`run` trains 2 steps through the real ``TrainStep`` (megatron's schedule, DDP, optimizer), ℓ = 2 (every
shared MLP called twice per micro-batch), then evaluates with ``loss_by_loops``; per step and per stand-in it
records how often the layer re-quantized and whether any call used a stale copy. Every layer must re-quantize
exactly once per step and never compute with old weights. tests/parallel/test_fp8_weight_cache.py runs it in
one process (PP = 1); under PP = 2 it runs in the 4-process launch of tests/parallel/test_pipeline.py
(pipeline_checks.py, ranks 0 and 1), or alone: ``torchrun --nproc-per-node 2 fp8_weight_cache.py OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig
from elastic_pretrain.parallel.pipeline import MicroBatch, Pipeline
from elastic_pretrain.schedule import DepthPlan
from elastic_pretrain.train.config import TrainConfig
from elastic_pretrain.train.step import TrainStep

MODEL = ModelConfig(hidden_size=32, num_heads=4, ffn_hidden_size=64, prelude_layers=1, coda_layers=1, core_layers=2,
                    num_experts=4, loops=2, flatten=1, moe_top_k=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.0)
STEPS, MICRO, ROWS, SEQ = 2, 2, 2, 16


def quantize(w: torch.Tensor) -> torch.Tensor:
    """The stand-in's "FP8 cast": a lower-precision copy, so a stale one differs from the current weight's."""
    return w.detach().to(torch.bfloat16).to(w.dtype)


class FusedWgrad(torch.autograd.Function):
    """TE's ``fuse_wgrad_accumulation``: the weight gradient goes straight into ``weight.main_grad`` — added to it,
    except for a call made with ``is_first_microbatch=True``, whose wgrad GEMM *overwrites* it (TE 2.9-2.11
    ``linear.py``/``grouped_linear.py``: ``accumulate = fuse_wgrad_accumulation and not is_first_microbatch``);
    autograd gets a zero gradient for the weight and megatron's DDP hook skips it (``grad_added_to_main_grad``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.nn.Parameter, values: torch.Tensor,
                first: bool | None) -> torch.Tensor:
        ctx.save_for_backward(x, values)
        ctx.weight, ctx.first = weight, first
        return F.linear(x, values)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, values = ctx.saved_tensors
        weight: Any = ctx.weight
        wgrad = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if ctx.first:  # True: TE writes the GEMM's output over main_grad
            weight.main_grad.copy_(wgrad)
        else:  # False or None: accumulates
            weight.main_grad.add_(wgrad)
        weight.grad_added_to_main_grad = True
        return grad @ values, torch.zeros_like(weight), None, None


class CachedWeightLinear:
    """Mixed into megatron's Column/RowParallelLinear (TP = 1): TE's weight cache behind megatron's TE wrapper,
    and with ``fuse_wgrad_accumulation`` TE's fused weight-gradient accumulation (:class:`FusedWgrad`)."""

    weight: torch.nn.Parameter
    is_first_microbatch: bool
    disable_parameter_transpose_cache: bool
    fuse_wgrad_accumulation: bool
    cached: torch.Tensor | None
    refreshes: int
    stale_calls: int

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        first = None if self.disable_parameter_transpose_cache else self.is_first_microbatch
        if first is None or first or self.cached is None:  # TE: update_workspace, or no workspace yet
            self.cached = quantize(self.weight)
            self.refreshes += 1
        self.is_first_microbatch = False  # megatron's TE wrapper, after every call
        self.stale_calls += int(not torch.equal(self.cached, quantize(self.weight)))
        if self.fuse_wgrad_accumulation:
            return FusedWgrad.apply(input_, self.weight, self.cached, first), None
        # the cached values forward; the weight gradient to the weight itself (as TE's FP8 GEMMs do)
        weight = self.weight + (self.cached - self.weight).detach()
        return F.linear(input_, weight), None


def install_stand_ins(net: torch.nn.Module) -> dict[str, Any]:
    """Every attention / MLP / expert linear becomes a :class:`CachedWeightLinear` (the TE spec's linears; the
    output layer is megatron's own in both specs). Returns them by name."""
    found = {}
    for name, module in net.named_modules():
        base = type(module)
        if base.__name__ in ("ColumnParallelLinear", "RowParallelLinear") and name != "output_layer":
            module.__class__ = type(f"TE{base.__name__}", (CachedWeightLinear, base), {})
            module.is_first_microbatch = True  # as megatron's TE wrappers start
            # megatron's TE wrappers read both from the config
            module.disable_parameter_transpose_cache = net.config.disable_parameter_transpose_cache  # type: ignore[union-attr]
            module.fuse_wgrad_accumulation = net.config.gradient_accumulation_fusion  # type: ignore[union-attr]
            module.cached, module.refreshes, module.stale_calls = None, 0, 0
            found[name] = module
    assert found
    return found


def run(par: ParallelConfig, *, pp_size: int, dp_rank: int = 0) -> dict[str, Any]:
    """``STEPS`` training steps and an evaluation on an initialised mesh; per phase, each stand-in's
    re-quantizations and stale calls."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from elastic_pretrain.eval.loss import loss_by_loops
    from elastic_pretrain.train.session import build_optimizer
    from tests.dist.equivalence import wrap_ddp_for_test

    # a bare backward earlier in this process left megatron's aux-loss scale 0-dim; the schedule copies a [1] into it
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    net = build_model(MODEL, par)
    net.config.fp8 = "hybrid"  # what a TE machine's config holds (megatron's set_is_first_microbatch reads it)
    net.config.fp8_recipe = "tensorwise"  # the per-layer autocast; megatron's get_fp8_context is a no-op without TE
    layers = install_stand_ins(net)
    model = wrap_ddp_for_test(net)
    job = SimpleNamespace(model=MODEL, train=TrainConfig(steps=STEPS, warmup_steps=0, lr=1e-2, clip_grad=0.0,
                                                         distributed_optimizer=False))
    optimizer, scheduler = build_optimizer(job, model)  # type: ignore[arg-type]
    pipeline = Pipeline(model, net, pp_size) if pp_size > 1 else None
    step = TrainStep(model, optimizer, scheduler, seq_len=SEQ, micro_batch_size=ROWS, max_loops=MODEL.max_loops,
                     pipeline=pipeline)
    tokens = torch.randint(0, MODEL.vocab_size, (STEPS + 1, MICRO, ROWS, SEQ + 1),
                           generator=torch.Generator().manual_seed(dp_rank))
    phases: list[dict[str, Any]] = []

    def record(phase: str, before: dict[str, tuple[int, int]]) -> None:
        phases.append({"phase": phase,
                       "refreshes": {n: m.refreshes - before[n][0] for n, m in layers.items()},
                       "stale_calls": {n: m.stale_calls - before[n][1] for n, m in layers.items()}})

    for s in range(STEPS):
        before = {n: (m.refreshes, m.stale_calls) for n, m in layers.items()}
        result = step([MicroBatch(tokens[s, i], DepthPlan(2, (2,), group_loops=2)) for i in range(MICRO)])
        assert not result.skipped
        record(f"step {s + 1}", before)
    before = {n: (m.refreshes, m.stale_calls) for n, m in layers.items()}
    loss_by_loops(model, tokens[STEPS].flatten(0, 1), [2], pipeline, batch_size=ROWS)
    record("evaluation", before)
    return {"phases": phases, "layers": sorted(layers)}


def check_phases(result: dict[str, Any]) -> None:
    """Every stand-in re-quantized exactly once in every step and in the evaluation, and no call used a copy
    of an older weight."""
    phases = result["phases"]
    assert [p["phase"] for p in phases] == [f"step {s + 1}" for s in range(STEPS)] + ["evaluation"]
    for p in phases:
        assert p["refreshes"] == dict.fromkeys(result["layers"], 1), p["phase"]
        assert p["stale_calls"] == dict.fromkeys(result["layers"], 0), p["phase"]


def main(out: Path) -> None:
    """PP = 2 on ranks 0 and 1 (a file store of its own, so it can share a launch with other checks)."""
    import torch.distributed as dist

    from elastic_pretrain.parallel.mesh import init_mesh, teardown

    rank = int(os.environ["RANK"])
    if rank >= 2:
        return
    dist.init_process_group("gloo", init_method=f"file://{out}/store_fp8_cache", rank=rank, world_size=2)
    par = ParallelConfig(pipeline=2)
    mesh = init_mesh(par, seed=5)
    torch.set_num_threads(1)
    result = run(par, pp_size=mesh.pp_size, dp_rank=mesh.dp_rank)
    (out / f"fp8_cache_rank{rank}.json").write_text(json.dumps({**result, "stage": mesh.pp_rank}))
    teardown()


if __name__ == "__main__":
    target = Path(sys.argv[1]).resolve()
    target.mkdir(parents=True, exist_ok=True)
    main(target)
