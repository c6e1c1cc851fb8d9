"""Depth efficiency (useful / executed passes) per sampler for 2..64 ranks, from the samplers' own draws.

    .venv/bin/python bench/bench_depth_efficiency.py [--micro 8] [--steps 20] [--ep all|8|...]

No processes, no model: train/depth_sim.py replays ``ScheduleController.step_plans`` for every replica
(EP groups of consecutive replicas; ``--ep all``: one EP group spanning every rank, the worst case).
``balance`` is the mean/max of the passes replicas execute per step: what the step-end gradient
reduction waits for, which depth efficiency does not see; ``balance: compute`` (compute-balanced mixed
depth) deals the global batch so that it is close to 1 too.
"""

from __future__ import annotations

import argparse

from elastic_pretrain.schedule import ScheduleConfig
from elastic_pretrain.train.depth_sim import simulate

SAMPLERS = {
    "independent_rank (ELR)": {},
    "  + order: deep_first": {"order": "deep_first"},
    "  + depth_group: expert_group": {"depth_group": "expert_group"},
    "  + balance: compute": {"balance": "compute"},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per replica per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ep", default="all", help="EP group size, or 'all' (= ranks)")
    parser.add_argument("--max-loops", type=int, default=4)
    args = parser.parse_args()
    ranks = [2, 4, 8, 16, 32, 64]
    print(f"L_max {args.max_loops}, {args.micro} micro-batches/step, {args.steps} steps, EP = {args.ep}")
    print(f"  {'sampler':<32}" + "".join(f"{r:>14}" for r in ranks))
    print(f"  {'':<32}" + "".join(f"{'eff / balance':>14}" for _ in ranks))
    for name, kw in SAMPLERS.items():
        cells = []
        for r in ranks:
            ep = r if args.ep == "all" else min(int(args.ep), r)
            cfg = ScheduleConfig(sampler="independent_rank", switch_at=0.0, **kw)
            e = simulate(
                cfg, max_loops=args.max_loops, replicas=r, ep_size=ep, micro_batches=args.micro, steps=args.steps
            )
            cells.append(f"{e.mean:.3f} / {e.step_balance:.2f}")
        print(f"  {name:<32}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
