"""Mixed depth vs fixed depth: measured step-time ratio next to the ratio the executed passes predict.

    .venv/bin/python bench/bench_mixed_depth.py [--repeats 5] [--steps 4] [--micro 4]

One process, CPU, 1 thread, the default job's model (bench_depth.py's shape), micro-batches of 4 x 128
tokens, forward + backward. Per repeat it times, alternately, ``--steps`` steps of ``--micro``
micro-batches each:

- ``fixed``: every micro-batch at L_max;
- ``mixed``: ℓ drawn by the sampler (independent_rank, ELR) for replica 0;
- ``mixed+ghosts``: the same, also joining the passes of an EP peer (replica 1) as ghost MoE calls,
  as replica 0 of an EP=2 group does (``DepthPlan.group_loops``).

Predictions (step_flops of train/mfu.py, ratio to fixed): ``useful`` counts the passes each micro-batch
needs, ``executed`` also counts ghost passes as full passes. On one process no peer keeps a ghost pass
waiting, so ``mixed+ghosts`` measures only a ghost call's own cost (one token, but a whole MoE call's
fixed overhead: router, dispatch, permutation); in a real EP group the waiting rank follows
``executed`` — which is what ``depth_group: expert_group`` removes.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    from elastic_pretrain.model.config import ModelConfig
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
    from elastic_pretrain.schedule import DepthPlan, ExpertLayout, ScheduleConfig, ScheduleController
    from elastic_pretrain.train.mfu import DepthCounts, step_flops

    par = ParallelConfig()
    init_mesh(par, seed=0)
    cfg = ModelConfig(
        hidden_size=96,
        num_heads=4,
        ffn_hidden_size=256,
        prelude_layers=1,
        coda_layers=1,
        core_layers=2,
        num_experts=4,
        loops=2,
        flatten=2,
        moe_top_k=2,
        moe_ffn_hidden_size=96,
    )
    model = build_model(cfg, par)
    tokens = torch.randint(0, 257, (4, 129))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ctl = ScheduleController(
        ScheduleConfig(sampler="independent_rank", switch_at=0.0), max_loops=cfg.max_loops, total_tokens=1, seed=0
    )
    pair = ExpertLayout(group=(0, 1), key={0: 0, 1: 1})
    ghosted = [
        p
        for s in range(args.steps)
        for _, p in ctl.step_plans(step=s, micro_batches=args.micro, replica=0, layout=pair)
    ]
    variants = {
        "fixed": [DepthPlan(cfg.max_loops, (cfg.max_loops,))] * len(ghosted),
        "mixed": [DepthPlan(p.loops, p.exits) for p in ghosted],
        "mixed+ghosts": ghosted,
    }

    def run(plans: list[DepthPlan]) -> None:
        model.zero_grad(set_to_none=True)
        for p in plans:
            out = model(inputs, labels=labels, loops=p.loops, exits=p.exits, sync_loops=p.group_loops)
            out[p.loops].mean().backward()
            clear_aux_losses_tracker()

    for plans in variants.values():  # warm-up
        run(plans[:2])
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, plans in variants.items():  # interleaved
            t0 = time.perf_counter()
            run(plans)
            times[name].append(time.perf_counter() - t0)

    def flops(loops: float) -> float:
        return step_flops(
            cfg, DepthCounts(loops=loops, exits=1, ghost_passes=0), seq_len=128, micro_batch_tokens=512
        ).model

    mean_useful = statistics.mean(p.loops for p in ghosted)
    mean_executed = statistics.mean(p.group_loops or p.loops for p in ghosted)
    predicted = {
        "fixed": 1.0,
        "mixed": flops(mean_useful) / flops(cfg.max_loops),
        "mixed+ghosts": flops(mean_executed) / flops(cfg.max_loops),
    }
    base = statistics.median(times["fixed"])
    print(
        f"{args.steps} steps x {args.micro} micro-batches, mean ℓ {mean_useful:.2f} useful, {mean_executed:.2f} "
        f"executed with an EP=2 peer (depth efficiency {mean_useful / mean_executed:.3f}); median of {args.repeats}"
    )
    print(f"  {'variant':>13} {'s/step':>8} {'measured/fixed':>15} {'predicted: useful':>18} {'executed':>9}")
    for name in variants:
        t = statistics.median(times[name]) / args.steps
        useful = predicted["mixed"] if name != "fixed" else 1.0
        print(f"  {name:>13} {t:8.3f} {t * args.steps / base:15.3f} {useful:18.3f} {predicted[name]:9.3f}")
    teardown()


if __name__ == "__main__":
    main()
