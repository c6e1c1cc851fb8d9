"""DP-pooled lookahead labels (``decider.backbone: per_token``) against one process: run by
tests/eval/test_decider_per_token.py under torchrun with 2 processes (DP=2), with strict device checks."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from elastic_pretrain.model.decider import lookahead_labels
from elastic_pretrain.parallel.device import device
from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
from elastic_pretrain.parallel.strict import strict_devices
from elastic_pretrain.train.decider import pooled_labels


def batch(rank: int, case: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s CE ``[L=4, B=2, T=8]`` and nested active mask; rank 1's gains are larger."""
    g = torch.Generator().manual_seed(100 * case + rank)
    ce = torch.rand(4, 2, 8, generator=g).cumsum(0).flip(0) * (1 + 3 * rank)
    active = torch.ones(4, 2, 8, dtype=torch.bool)
    for j in range(1, 4):
        active[j] = active[j - 1] & (torch.rand(2, 8, generator=g) < 0.7)
    return ce, active


def gain(ce: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    return torch.where(active[:-1], ce[:-1] - ce[1:], torch.zeros_like(ce[1:]))


if __name__ == "__main__":
    mesh = init_mesh(ParallelConfig(), seed=1)
    try:
        rank = dist.get_rank()
        out = {"equal_to_one_process": True, "differs_from_local": False}
        with strict_devices():
            for case in range(3):
                ce, active = batch(rank, case)
                got = pooled_labels(gain(ce, active).to(device()), 0.8).cpu()
                both = [batch(r, case) for r in range(2)]
                ref = lookahead_labels(torch.cat([c for c, _ in both], 1), 0.8, torch.cat([a for _, a in both], 1)[:-1])
                out["equal_to_one_process"] &= torch.equal(got, ref[:, 2 * rank : 2 * rank + 2])
                out["differs_from_local"] |= not torch.equal(got, lookahead_labels(ce, 0.8, active[:-1]))
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, out)
        if rank == 0:
            print("POOLED " + json.dumps(gathered), file=sys.stdout, flush=True)
    finally:
        teardown()
