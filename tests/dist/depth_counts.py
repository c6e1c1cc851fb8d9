"""Global depth counts for MFU: run by tests/train/test_mfu.py under torchrun with 2 processes (EP=2, DP=2).

Each replica runs its own ℓ per micro-batch; every rank must report the same global means (not its
own), and the ghost passes its expert group's deeper micro-batches forced on it.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
from elastic_pretrain.parallel.pipeline import MicroBatch
from elastic_pretrain.schedule import DepthPlan
from elastic_pretrain.train.step import depth_counts

# replica r's micro-batches: (ℓ, supervised exits)
PLANS = {0: [(1, (1,)), (3, (2, 3))], 1: [(4, (4,)), (2, (1, 2))]}

if __name__ == "__main__":
    mesh = init_mesh(ParallelConfig(expert=2), seed=1)
    try:
        import torch

        plans = PLANS[mesh.replica]
        mbs = [MicroBatch(torch.zeros(1, 2, dtype=torch.long), DepthPlan(ell, exits)) for ell, exits in plans]
        d = depth_counts(mbs)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [d.loops, d.exits, d.ghost_passes])
        if mesh.rank == 0:
            print("DEPTH " + json.dumps(gathered), file=sys.stdout, flush=True)
    finally:
        teardown()
