"""``order: deep_first`` runs the same (micro-batch, ℓ) pairs in another order: the accumulated
gradient equals the drawn order's up to floating-point rounding (one process, the real model)."""

from __future__ import annotations

import torch

from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.schedule import ExpertLayout, ScheduleConfig, ScheduleController
from tests.model.test_elastic import PAR, batch, tiny


def test_deep_first_accumulates_the_same_gradient(mesh1):
    cfg = tiny()
    model = build_model(cfg, PAR)
    tokens = [batch(cfg, seed) for seed in range(4)]
    pair = ExpertLayout(group=(0, 1), key={0: 0, 1: 1})
    grads = {}
    for order in ("draw", "deep_first"):
        ctl = ScheduleController(
            ScheduleConfig(sampler="independent_rank", switch_at=0.0, order=order),
            max_loops=cfg.max_loops,
            total_tokens=1,
            seed=5,
        )
        plans = ctl.step_plans(step=1, micro_batches=4, replica=0, layout=pair)
        model.zero_grad(set_to_none=True)
        for i, p in plans:  # the ghost passes of each position are part of what is run
            t = tokens[i]
            model(t[:, :-1], labels=t[:, 1:], loops=p.loops, exits=p.exits, sync_loops=p.group_loops)[
                p.loops
            ].mean().backward()
        grads[order] = (
            {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None},
            [i for i, _ in plans],
        )
    (g_draw, i_draw), (g_deep, i_deep) = grads["draw"], grads["deep_first"]
    assert i_draw == [0, 1, 2, 3] and i_deep != i_draw  # the order did change (seed 5, step 1)
    assert g_draw.keys() == g_deep.keys()
    for name in g_draw:
        torch.testing.assert_close(g_deep[name], g_draw[name], rtol=1e-5, atol=1e-7)
