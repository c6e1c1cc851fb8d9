"""``elastic-pretrain estimate``: memory per rank of a job on its mesh (parallel/memory.py; no torch)."""

from __future__ import annotations

import argparse

from elastic_pretrain.config import ConfigError, parse_bytes


def _estimate(args: argparse.Namespace) -> int:
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.parallel.memory import (
        RECOMPUTE_MODES,
        check_maxvio,
        estimate_memory,
        largest_micro_batch,
    )

    job = load_job(args.job, list(args.overrides))
    world = args.world_size or job.slurm.nodes * job.slurm.procs_per_node
    if world < 1:
        raise ConfigError(f"--world-size: must be >= 1, got {world}")
    device = parse_bytes(args.gpu_memory)
    check_maxvio(args.maxvio, "--maxvio")
    try:
        est = estimate_memory(job, world, spec=args.spec, maxvio=args.maxvio)
    except ConfigError as err:
        if args.world_size:
            raise
        default = f"slurm.nodes x processes per node = {world}"
        raise ConfigError(f"{err} — or pass --world-size N (default: {default})") from None
    print("\n".join(est.lines(device)))
    fits = {
        mode: largest_micro_batch(job, world, device, recompute=mode, spec=args.spec, maxvio=args.maxvio)
        for mode in RECOMPUTE_MODES
    }
    print(
        f"largest micro-batch that fits {args.gpu_memory} (90% of it) at l={job.model.max_loops}: "
        + ", ".join(f"recompute {mode}: {n}" for mode, n in fits.items())
        + f" (train.micro_batch_size={job.train.micro_batch_size}, train.recompute={job.train.recompute})"
    )
    if fits[job.train.recompute] < job.train.micro_batch_size:
        print(
            f"warning: train.micro_batch_size={job.train.micro_batch_size} does not fit with train.recompute="
            f"{job.train.recompute}: lower it or choose another recompute mode"
        )
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from elastic_pretrain.parallel.memory import PLANNING_MAXVIO

    p = sub.add_parser(
        "estimate",
        help="memory per rank: parameters, gradients, optimizer state, activations per loop count and recompute mode",
        description="Estimate memory per rank of a job on its mesh (docs/gpu.md, 'Memory estimate'); no GPU needed.",
    )
    p.add_argument("job", help="job YAML, e.g. jobs/tiny-cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.micro_batch_size=2")
    p.add_argument("--gpu-memory", default="80GiB", metavar="SIZE", help="device memory (default 80GiB; e.g. 141GB)")
    p.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="ranks in the job (default: slurm.nodes x processes per node of the job)",
    )
    p.add_argument(
        "--spec",
        choices=["te", "local"],
        default="te",
        help="layer implementation: te (GPU: Transformer Engine, flash attention) or local (CPU modules)",
    )
    p.add_argument(
        "--maxvio",
        type=float,
        default=PLANNING_MAXVIO,
        metavar="X",
        help=f"routing imbalance assumed for the most loaded expert-parallel rank, max load / mean load - 1 "
        f"(default {PLANNING_MAXVIO}, an assumption; the routing probe's routing/*/maxvio measures it)",
    )
    p.set_defaults(handler=_estimate)
