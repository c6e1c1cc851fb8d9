"""The EP group's loop counts computed locally equal the old all-reduce's answer: run by
tests/train/test_depth_samplers.py under torchrun with 4 processes (EP=2 × DP=4: two EP groups).

For each sampler setting and several steps, every rank compares ``DepthPlan.group_loops`` from
``ScheduleController.step_plans`` with ``expert_group_max_each`` (the collective training used to run
before every micro-batch), and measures the global depth efficiency with ``depth_counts`` (real
all-reduce over the replicas).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from elastic_pretrain.parallel.mesh import ParallelConfig, expert_group_max_each, expert_layout, init_mesh, teardown
from elastic_pretrain.parallel.pipeline import MicroBatch
from elastic_pretrain.schedule import ScheduleConfig, ScheduleController
from elastic_pretrain.train.step import depth_counts

SETTINGS = {"draw": {}, "deep_first": {"order": "deep_first"}, "expert_group": {"depth_group": "expert_group"}}

if __name__ == "__main__":
    mesh = init_mesh(ParallelConfig(expert=2), seed=1)
    try:
        layout = expert_layout()
        out: dict = {"group": list(layout.group), "key": {str(k): v for k, v in sorted(layout.key.items())}}
        for name, kw in SETTINGS.items():
            cfg = ScheduleConfig(sampler="independent_rank", switch_at=0.0, **kw)
            ctl = ScheduleController(cfg, max_loops=4, total_tokens=1, seed=7)
            useful = executed = 0.0
            for step in range(8):
                plans = ctl.step_plans(step=step, micro_batches=4, replica=mesh.replica, layout=layout)
                local = [p.group_loops for _, p in plans]
                collective = expert_group_max_each([p.loops for _, p in plans])
                assert local == collective, (name, step, local, collective)
                # the global counts, by the training path's reduction (hand-built plans: the collective)
                mbs = [MicroBatch(torch.zeros(1, 2, dtype=torch.long), p) for _, p in plans]
                d = depth_counts(mbs)
                useful, executed = useful + d.loops, executed + d.loops + d.ghost_passes
            out[name] = useful / executed
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, out)
        if mesh.rank == 0:
            print("LOCAL " + json.dumps(gathered), file=sys.stdout, flush=True)
    finally:
        teardown()
