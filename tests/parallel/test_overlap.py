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
from elastic_pretrain.job import load_job
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig
from elastic_pretrain.parallel.overlap import DepthOverlapDDP, overlapped_step
from elastic_pretrain.train.schedule import DepthPlan
from elastic_pretrain.train.session import wrap_ddp
from elastic_pretrain.train.step import MicroBatch, _forward_step
from tests.conftest import REPO
from tests.dist.equivalence import wrap_ddp_for_test
from tests.dist.overlap_grads import MODEL

PLANS = [[(3, (3,)), (1, (1,)), (2, (1, 2))], [(1, (1,)), (2, (2,)), (1, (1,))]]  # per step: (ℓ, exits)


@pytest.mark.parametrize(("recompute", "replay"), [("none", None), ("pass", None), ("pass", "dispatch"),
                                                  ("none", "router")])
def test_expected_hooks_equal_the_hooks_that_fire(mesh1, recompute, replay):
    cfg = dataclasses.replace(MODEL, route_replay=replay is not None, route_replay_impl=replay or "dispatch")
    net = build_model(cfg, ParallelConfig(), recompute=recompute)
    net.conditioning_active = True
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
        micro = [MicroBatch(tokens[s, i], DepthPlan(ell, exits, group_loops=ell))
                 for i, (ell, exits) in enumerate(step)]
        with overlapped_step(model, _forward_step, len(micro)) as forward_step:
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                                        num_microbatches=len(micro), seq_length=16, micro_batch_size=2,
                                        forward_only=False)
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
