"""Host syncs per training step (issue 31 item 2): a fixed, small number per step, not per MoE call.

One process, the real step (megatron's schedule, DDP, optimizer) of a tiny looped MoE model, with every
host read of a tensor counted by call site (elastic_pretrain/train/host_syncs.py). Across ℓ, the number
of micro-batches and the number of core layers:

- the project's own syncs and megatron's optimizer's are the same number every step;
- the only sync that grows is megatron's alltoall dispatcher reading the tokens per expert, once per MoE
  call (it sizes the permutation and the all-to-all from them) — and with route replay only pass 0
  of each micro-batch pays it: later passes reuse pass 0's split sizes.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig
from elastic_pretrain.parallel.pipeline import MicroBatch
from elastic_pretrain.schedule import DepthPlan
from elastic_pretrain.train.config import TrainConfig
from elastic_pretrain.train.host_syncs import DISPATCHER, count_host_syncs
from elastic_pretrain.train.session import build_optimizer
from elastic_pretrain.train.step import TrainStep
from tests.dist.equivalence import wrap_ddp_for_test

MODEL = ModelConfig(
    hidden_size=32,
    num_heads=4,
    ffn_hidden_size=64,
    prelude_layers=1,
    coda_layers=1,
    core_layers=1,
    num_experts=4,
    loops=4,
    flatten=1,
    moe_top_k=2,
    moe_ffn_hidden_size=32,
)
ROWS, SEQ = 2, 16
# (ℓ, supervised exits) per micro-batch of each measured step
STEPS = [[(1, (1,))], [(2, (2,))], [(4, (4,))], [(4, (2, 4)), (1, (1,)), (3, (3,))]]


def _syncs_per_step(core_layers: int, replay: bool) -> list[tuple[int, dict[str, int]]]:
    """(dispatcher syncs, the other device syncs by site) of each step of ``STEPS``."""
    cfg = dataclasses.replace(MODEL, core_layers=core_layers, route_replay=replay)
    net = build_model(cfg, ParallelConfig(), recompute="none")
    model = wrap_ddp_for_test(net)
    job = SimpleNamespace(
        model=cfg, train=TrainConfig(steps=9, warmup_steps=0, lr=1e-3, clip_grad=1.0, distributed_optimizer=False)
    )
    optimizer, scheduler = build_optimizer(job, model)  # type: ignore[arg-type]
    step = TrainStep(model, optimizer, scheduler, seq_len=SEQ, micro_batch_size=ROWS, max_loops=cfg.max_loops)
    gen = torch.Generator().manual_seed(0)
    out = []
    for plan in [STEPS[0], *STEPS]:  # the first step also builds the optimizer state: not measured
        micro = [
            MicroBatch(
                torch.randint(0, cfg.vocab_size, (ROWS, SEQ + 1), generator=gen), DepthPlan(ell, exits, group_loops=ell)
            )
            for ell, exits in plan
        ]
        with count_host_syncs() as counter:
            step(micro)
        syncs = counter.device_syncs()
        out.append((syncs.pop(DISPATCHER, 0), syncs))
    return out[1:]


@pytest.mark.parametrize("replay", [False, True], ids=["plain", "route-replay"])
def test_host_syncs_per_step_do_not_grow_with_depth_micro_batches_or_layers(mesh1, replay):
    others = []
    for core in (1, 2):
        for plan, (dispatcher, rest) in zip(STEPS, _syncs_per_step(core, replay)):
            passes = sum(ell for ell, _ in plan)
            # one sync per MoE call (core layers × passes); with replay, per micro-batch's pass 0 only
            assert dispatcher == core * (len(plan) if replay else passes), (core, plan, dispatcher)
            others.append(rest)
    assert all(rest == others[0] for rest in others), others  # same sites, same counts, every step
    ours = {site: n for site, n in others[0].items() if site.startswith("elastic_pretrain/")}
    # the step's reduction (objective and per-exit losses), the MoE aux metrics, the depth counts
    assert sum(ours.values()) <= 3, ours
