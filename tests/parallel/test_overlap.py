"""The gradient ledger of ``parallel.grad_reduce: overlap`` (parallel/overlap.py), in one process.

The 2-process equality with the after-backward reduction is tests/train/test_overlap_grad_reduce.py;
here: the expected hooks counted from the forwards equal the hooks that fire, parameter by parameter,
so every bucket starts during backward (none left for ``finish_grad_sync``); a hook beyond the
count raises (its bucket may have started); the job option and its refusal.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from elastic_pretrain.config import ConfigError
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig
from elastic_pretrain.parallel.overlap import DepthOverlapDDP, bucket_size_for, overlapped_step
from elastic_pretrain.parallel.pipeline import MicroBatch
from elastic_pretrain.schedule import DepthPlan
from elastic_pretrain.train.session import wrap_ddp
from elastic_pretrain.train.step import _forward_step
from tests.conftest import REPO
from tests.dist.equivalence import wrap_ddp_for_test
from tests.dist.overlap_grads import MODEL

PLANS = [[(3, (3,)), (1, (1,)), (2, (1, 2))], [(1, (1,)), (2, (2,)), (1, (1,))]]  # per step: (ℓ, exits)


@pytest.mark.parametrize(
    ("recompute", "replay"), [("none", None), ("pass", None), ("pass", "dispatch"), ("none", "router")]
)
def test_expected_hooks_equal_the_hooks_that_fire(mesh1, recompute, replay):
    cfg = dataclasses.replace(MODEL, route_replay=replay is not None, route_replay_impl=replay or "dispatch")
    net = build_model(cfg, ParallelConfig(), recompute=recompute)
    net.set_modes(conditioning=True)
    model = wrap_ddp_for_test(net, grad_reduce="overlap", bucket_size=4000)
    assert isinstance(model, DepthOverlapDDP)
    ledger = model.ledger
    buckets = sum(len(lane) for lane in ledger.lanes)
    assert buckets >= 8
    router = next(p for n, p in net.named_parameters() if n.endswith("router.weight"))
    attn2 = [p for n, p in net.named_parameters() if ".passes.2." in n]
    assert attn2
    tokens = torch.randint(0, MODEL.vocab_size, (len(PLANS), 3, 2, 17), generator=torch.Generator().manual_seed(0))
    for s, step in enumerate(PLANS):
        model.zero_grad_buffer()
        micro = [
            MicroBatch(tokens[s, i], DepthPlan(ell, exits, group_loops=ell)) for i, (ell, exits) in enumerate(step)
        ]
        with overlapped_step(model, _forward_step, len(micro)) as forward_step:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[model],
                num_microbatches=len(micro),
                seq_length=16,
                micro_batch_size=2,
                forward_only=False,
            )
        assert ledger.fired == ledger.expected  # parameter by parameter: nothing missed, nothing extra
        assert ledger.overlapped == buckets  # so every bucket started before finish_grad_sync
        # a hook per micro-batch, or per pass under per-pass recompute (shared router); pass 3 only if ℓ = 3
        assert ledger.expected[router] == (sum(ell for ell, _ in step) if recompute == "pass" else len(step))
        assert all(ledger.expected[p] == sum(ell == 3 for ell, _ in step) for p in attn2)


def test_a_gradient_beyond_the_count_is_refused(mesh1):
    net = build_model(MODEL, ParallelConfig())
    model = wrap_ddp_for_test(net, grad_reduce="overlap", bucket_size=4000)
    model.zero_grad_buffer()
    with overlapped_step(model, lambda: None, 1) as forward_step:
        forward_step()  # a step without uses: every parameter final, every bucket started at once
    assert model.ledger.started == [len(lane) for lane in model.ledger.lanes]
    name, param = next(iter(net.named_parameters()))
    with pytest.raises(RuntimeError, match=f"{re.escape(name)} got 1 gradients, more than the 0 uses counted"):
        model.ledger.grad_ready(param)
    model.finish_grad_sync()


def test_grad_reduce_option(mesh1):
    base = REPO / "jobs" / "tiny-cpu.yaml"
    for value, ddp_class in (("after_backward", DistributedDataParallel), ("overlap", DepthOverlapDDP)):
        job = load_job(base, ["parallel=single", f"parallel.grad_reduce={value}"])
        assert type(wrap_ddp(job, build_model(job.model, job.parallel))) is ddp_class
    assert load_job(base).parallel.grad_reduce == "after_backward"
    with pytest.raises(ConfigError, match=r"parallel\.grad_reduce=overlap drives megatron's gradient buckets"):
        load_job(base, ["engine=deepspeed", "parallel=single", "parallel.grad_reduce=overlap"])


def test_bucket_size_rule():
    """clamp(params per rank / 16, 2^18 x DP, max(40 M, 1 M x DP)), by hand."""
    # jobs/gpu-16node.yaml: 730,976,768 non-expert + 4,429,185,024 / EP 8 expert parameters per rank, DP 128
    assert bucket_size_for(730_976_768 + 553_648_128, 128) == 80_289_056  # ceil(1,284,624,896 / 16), in bounds
    # jobs/gpu-1node.yaml: 178,873,600 + 138,412,032 / 8, DP 8
    assert bucket_size_for(178_873_600 + 17_301_504, 8) == 12_260_944  # ceil(196,175,104 / 16)
    assert bucket_size_for(1000, 4) == 4 * 2**18  # floor: 1 MiB of fp32 gradient per rank's ring chunk
    assert bucket_size_for(10**10, 8) == 40_000_000  # ceiling: megatron's default
    assert bucket_size_for(10**10, 512) == 512_000_000  # its DP-scaled default
    assert bucket_size_for(1000, 1024) == 2**28  # the floor exceeds 40 M: clamped to the (DP-scaled) ceiling
    with pytest.raises(ValueError, match="must be >= 1"):
        bucket_size_for(0, 8)


def _job(*overrides: str):
    return load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", *overrides])


def test_param_gather_option(mesh1):
    """The configs we hand megatron: overlap_param_gather in the DDP and optimizer configs exactly with
    param_gather=overlap and the distributed optimizer, our pre-hook on every module; the GPU presets' default."""
    from elastic_pretrain.train.session import build_optimizer

    for gather, distributed in (("overlap", True), ("overlap", False), ("after_step", True)):
        job = _job(
            "parallel.grad_reduce=overlap",
            f"parallel.param_gather={gather}",
            f"train.distributed_optimizer={str(distributed).lower()}",
        )
        net = build_model(job.model, job.parallel)
        model = wrap_ddp(job, net)
        assert isinstance(model, DepthOverlapDDP)
        on = gather == "overlap" and distributed
        assert model.ddp_config.overlap_param_gather == model.gathers == on
        assert build_optimizer(job, model)[0].config.overlap_param_gather == on
        hooked = set(model.remove_forward_pre_hook_handles)
        assert hooked == (set(net.modules()) if on else set())
        # parallel.bucket_size=0: the rule, from this rank's parameters at DP 1
        assert model.ddp_config.bucket_size == bucket_size_for(sum(p.numel() for p in net.parameters()), 1)
    assert (
        wrap_ddp(
            _job("parallel.grad_reduce=overlap", "parallel.bucket_size=5000"),
            build_model(_job().model, ParallelConfig()),
        ).ddp_config.bucket_size
        == 5000
    )
    assert _job().parallel.param_gather == "after_step"  # the CPU path is unchanged
    with pytest.raises(ConfigError, match=r"param_gather=overlap needs grad_reduce=overlap.*parallel\.grad_reduce="):
        _job("parallel.param_gather=overlap")
    with pytest.raises(ConfigError, match="bucket_size: must be >= 0"):
        _job("parallel.bucket_size=-1")
    for name in ("gpu-1node", "gpu-2node", "gpu-16node"):
        par = load_job(REPO / "jobs" / f"{name}.yaml").parallel
        assert (par.grad_reduce, par.param_gather, par.bucket_size) == ("overlap", "overlap", 0)


def _train(gather: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    """``steps`` optimizer steps of TrainStep at DP 1 with the distributed optimizer: (losses, parameters,
    all-gathers still pending after each step)."""
    from elastic_pretrain.train.session import build_optimizer
    from elastic_pretrain.train.step import TrainStep

    torch.manual_seed(5)
    job = _job(
        "parallel.grad_reduce=overlap",
        f"parallel.param_gather={gather}",
        "train.lr=1e-2",
        "train.warmup_steps=0",
        "train.distributed_optimizer=true",
    )
    net = build_model(MODEL, ParallelConfig())
    net.set_modes(conditioning=True)
    # buckets of <= 1000 parameters: pass 2's attention fills buckets of its own, which step 2 (ℓ <= 2) leaves
    # unused, so no forward waits for their gathers (finish_grad_sync must, before the optimizer writes)
    model = wrap_ddp(job, net, bucket_size=1000)
    optimizer, scheduler = build_optimizer(job, model)
    step = TrainStep(model, optimizer, scheduler, seq_len=16, micro_batch_size=2, max_loops=MODEL.max_loops)
    tokens = torch.randint(0, MODEL.vocab_size, (steps, 3, 2, 17), generator=torch.Generator().manual_seed(0))
    losses, pending = [], []
    for s in range(steps):
        plans = PLANS[s % len(PLANS)]
        got = step(
            [MicroBatch(tokens[s, i], DepthPlan(ell, exits, group_loops=ell)) for i, (ell, exits) in enumerate(plans)]
        )
        losses.append(got.loss)
        pending.append(sum(g.param_gather_handle is not None for lane in model.ledger.lanes for g in lane))
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}, pending


def test_overlapped_param_gather_equals_the_gather_in_the_step(mesh1):
    """At DP 1 the gather is a copy, so this checks the wiring, not the collective (tests/dist/overlap_grads.py
    dp4 does): losses and parameters bitwise, and after each step every bucket's all-gather is in flight."""
    ref_losses, ref_params, ref_pending = _train("after_step", 3)
    losses, params, pending = _train("overlap", 3)
    assert losses == ref_losses
    assert [n for n in ref_params if not torch.equal(ref_params[n], params[n])] == []
    assert ref_pending == [0, 0, 0] and min(pending) >= 20  # every bucket's gather deferred


def test_checkpoint_reads_and_writes_after_the_gathers(mesh1, tmp_path):
    """save_tensors / load_tensors wait for the step's in-flight all-gathers (megatron's training loop
    disables its pre-hooks, forcing a synchronous gather, around saves; we wait for ours)."""
    from elastic_pretrain.checkpoint import parallel_io
    from elastic_pretrain.checkpoint.tensors import load_tensors, save_tensors
    from elastic_pretrain.train.session import build_optimizer
    from elastic_pretrain.train.step import TrainStep

    job = _job("parallel.grad_reduce=overlap", "parallel.param_gather=overlap", "train.distributed_optimizer=true")
    net = build_model(MODEL, ParallelConfig())
    model = wrap_ddp(job, net, bucket_size=4000)
    optimizer, scheduler = build_optimizer(job, model)
    step = TrainStep(model, optimizer, scheduler, seq_len=16, micro_batch_size=2, max_loops=MODEL.max_loops)

    def in_flight() -> int:
        step([MicroBatch(torch.randint(0, MODEL.vocab_size, (2, 17)), DepthPlan(1, (1,), group_loops=1))])
        return sum(g.param_gather_handle is not None for lane in model.ledger.lanes for g in lane)

    assert in_flight() > 0
    save_tensors(net, optimizer, tmp_path, parallel_io.save_strategy(None))
    assert sum(g.param_gather_handle is not None for lane in model.ledger.lanes for g in lane) == 0
    assert in_flight() > 0
    load_tensors(net, optimizer, tmp_path)
    assert sum(g.param_gather_handle is not None for lane in model.ledger.lanes for g in lane) == 0
