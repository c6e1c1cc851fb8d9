"""``elastic-pretrain experiment <name>|all [--quick] [--seeds N] [--scale K]``: train every job of the set
once per seed, evaluate, decide the papers' claims over the seeds, write ``docs/results/<name>.md``."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from elastic_pretrain.errors import UserError


def _experiment(args: argparse.Namespace) -> int:
    from elastic_pretrain.experiments.registry import EXPERIMENTS

    args.overrides = [*args.overrides, *(n for n in args.names if "=" in n)]  # cli.main adds ones after flags
    args.names = [n for n in args.names if "=" not in n]
    if args.list:
        for e in EXPERIMENTS.values():
            print(f"{e.name:16s} {e.title}")
        return 0
    if not args.names:
        raise UserError("name an experiment (or 'all'); see --list")
    names = list(EXPERIMENTS) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise UserError(f"unknown experiment '{unknown[0]}' (known: {', '.join(EXPERIMENTS)}, all)")
    from elastic_pretrain.experiments.report import run_experiment
    from elastic_pretrain.experiments.runner import QUICK_OVERRIDES
    from elastic_pretrain.quiet import quiet_logs

    quiet_logs()
    if args.scale < 1:
        raise UserError(f"--scale {args.scale}: must be a positive integer (e.g. 1, 4, 16)")
    runs = Path(args.runs or ("runs/experiments-quick" if args.quick else "runs/experiments"))
    default_out = Path("docs/results") if args.scale == 1 else Path(f"docs/results/scale-{args.scale}")
    out = Path(args.out or (runs / "results" if args.quick else default_out))
    overrides = [*(QUICK_OVERRIDES if args.quick else ()), *args.overrides]
    for name in names:
        flags = [
            *(["--quick"] if args.quick else []),
            "--seeds",
            args.seeds,
            *(["--scale", str(args.scale)] if args.scale != 1 else []),
            *(["--runs", str(runs)] if args.runs else []),
            *(["--out", str(out)] if args.out else []),
            *args.overrides,
        ]
        command = shlex.join(["elastic-pretrain", "experiment", name, *flags])
        run_experiment(
            EXPERIMENTS[name],
            runs_root=runs,
            out_dir=out,
            overrides=overrides,
            quick=args.quick,
            command=command,
            seeds=args.seeds,
            scale=args.scale,
        )
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "experiment",
        help="train a job set of jobs/experiments/<name>/, evaluate it, write docs/results/<name>.md",
        description="Run registered experiments (--list); finished runs with an unchanged config are reused.",
    )
    p.add_argument(
        "names",
        nargs="*",
        metavar="NAME|KEY=VALUE",
        help="experiment name(s) or 'all', then dotted overrides applied to every job (e.g. train.steps=400)",
    )
    p.add_argument("--quick", action="store_true", help="2 steps per job, tiny evaluations (a smoke test)")
    p.add_argument(
        "--seeds",
        default="3",
        metavar="N|S1,S2,...",
        help="seeds every job trains with: a count N (the set's own seed and the N-1 after it; default 3, the "
        "fewest a claim's interval is decided on) or a list of seeds",
    )
    p.add_argument(
        "--scale",
        type=int,
        default=1,
        metavar="K",
        help="the same designs K times wider and K times longer (e.g. 4, 16; for a GPU; reports go to "
        "docs/results/scale-K/)",
    )
    p.add_argument("--runs", help="run directories root (default runs/experiments, --quick: runs/experiments-quick)")
    p.add_argument("--out", help="report folder (default docs/results, --quick: <runs>/results)")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    p.set_defaults(handler=_experiment, overrides=[])
