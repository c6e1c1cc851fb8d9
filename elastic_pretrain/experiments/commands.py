"""``elastic-pretrain experiment <name>|all [--quick] [--seeds N] [--scale K]``: train every job of the set
once per seed, evaluate, decide the papers' claims over the seeds, write ``docs/results/<name>.md``.
``--from-json PATH`` / ``--rerender``: decide the claims again from a report's stored numbers, no training
(``experiments/rerender.py``)."""

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
    if args.gpu_smoke:
        gpu_smoke(args, names)
    if args.scale < 1:
        raise UserError(f"--scale {args.scale}: must be a positive integer (e.g. 1, 4, 16)")
    runs = Path(args.runs or ("runs/experiments-quick" if args.quick else "runs/experiments"))
    default_out = Path("docs/results") if args.scale == 1 else Path(f"docs/results/scale-{args.scale}")
    out = Path(args.out or (runs / "results" if args.quick else default_out))
    if args.from_json or args.rerender:
        return _rerender(args, names, out)
    seeds = args.seeds or "3"
    overrides = [*(QUICK_OVERRIDES if args.quick else ()), *args.overrides]
    for name in names:
        flags = [
            *(["--quick"] if args.quick else []),
            "--seeds",
            seeds,
            *(["--scale", str(args.scale)] if args.scale != 1 else []),
            *(["--tokens-per-param", str(args.tokens_per_param)] if args.tokens_per_param is not None else []),
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
            seeds=seeds,
            scale=args.scale,
            tokens_per_param=args.tokens_per_param,
        )
    return 0


SMOKE_SCALE, SMOKE_TOKENS_PER_PARAM = 4, 1.0  # ~3-4 M parameters, ~350-500 steps of 64 x 128 tokens per run


def gpu_smoke(args: argparse.Namespace, names: list[str], *, cuda: bool | None = None) -> None:
    """``--gpu-smoke`` (issue 32 item 4): the premise probe at ~3-4 M parameters for one H200: ``--scale 4
    --tokens-per-param 1 --seeds 3`` into docs/results/gpu-smoke/, depth-premise only (12 runs of 345-505 steps).
    Its time on an H200 is not measured yet (no GPU was lent): time the first run before trusting the budget."""
    import torch

    if names != ["depth-premise"]:
        raise UserError("--gpu-smoke runs the premise probe: name depth-premise alone (experiment depth-premise "
                        "--gpu-smoke)")  # fmt: skip
    if not (torch.cuda.is_available() if cuda is None else cuda):
        raise UserError("--gpu-smoke is sized for one GPU and this machine has no CUDA device: run it on a GPU "
                        "node, or drop --gpu-smoke for the CPU design")  # fmt: skip
    if args.scale != 1 or args.tokens_per_param is not None or args.quick:
        raise UserError("--gpu-smoke sets --scale and --tokens-per-param itself and trains for real: drop --scale, "
                        "--tokens-per-param and --quick")  # fmt: skip
    args.scale, args.tokens_per_param = SMOKE_SCALE, SMOKE_TOKENS_PER_PARAM
    args.seeds = args.seeds or "3"
    args.out = args.out or "docs/results/gpu-smoke"


def _rerender(args: argparse.Namespace, names: list[str], out: Path) -> int:
    """``--from-json PATH`` (one experiment) or ``--rerender`` (``<out>/<name>.json`` of each): no training."""
    from elastic_pretrain.experiments.registry import EXPERIMENTS
    from elastic_pretrain.experiments.rerender import rerender

    flag = "--from-json" if args.from_json else "--rerender"
    if args.from_json and args.rerender:
        raise UserError("--from-json PATH names one report, --rerender every named one in --out: give one of them")
    if args.from_json and len(names) != 1:
        raise UserError(f"--from-json {args.from_json}: name the one experiment it reports on (or use --rerender)")
    changes = [*(["--quick"] if args.quick else []), *(["--seeds"] if args.seeds else []), *args.overrides]
    if changes or args.runs:
        raise UserError(f"{flag} re-decides stored numbers and trains nothing: drop {(changes or ['--runs'])[0]}")
    done = 0
    for name in names:
        path = Path(args.from_json) if args.from_json else out / f"{name}.json"
        if len(names) > 1 and not path.exists():  # `all`: an experiment never run has nothing to re-decide
            print(f"{name}: no stored report {path} (run `elastic-pretrain experiment {name}` first): skipped")
            continue
        command = shlex.join(["elastic-pretrain", "experiment", name, "--from-json", str(path)])
        rerender(EXPERIMENTS[name], path, command=command)
        done += 1
    if not done:
        raise UserError(f"--rerender: no stored report in {out} (run the experiments first, or name --out)")
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
        default=None,
        metavar="N|S1,S2,...",
        help="seeds every job trains with: a count N (the set's own seed and the N-1 after it; default 3, the "
        "fewest a claim's interval is decided on; at most 100) or a list of seeds (one seed: 1234,)",
    )
    p.add_argument(
        "--scale",
        type=int,
        default=1,
        metavar="K",
        help="the same designs K times wider, K times the batch, lr / sqrt(K), and the tokens per parameter of "
        "the design (or --tokens-per-param) (e.g. 4, 16; for a GPU; reports go to docs/results/scale-K/)",
    )
    p.add_argument(
        "--gpu-smoke",
        action="store_true",
        help="depth-premise only: the premise probe sized for one GPU (--scale 4 --tokens-per-param 1 --seeds 3, "
        "reports in docs/results/gpu-smoke/); refused without CUDA",
    )
    p.add_argument(
        "--tokens-per-param",
        type=float,
        default=None,
        metavar="R",
        help="train every run on R tokens per parameter of its (scaled) model (default: the design's own ratio)",
    )
    p.add_argument("--runs", help="run directories root (default runs/experiments, --quick: runs/experiments-quick)")
    p.add_argument("--out", help="report folder (default docs/results, --quick: <runs>/results)")
    p.add_argument(
        "--from-json",
        metavar="PATH",
        help="decide the claims again from a report's stored numbers (e.g. docs/results/decider.json) and rewrite "
        "its claim and seed-noise tables (and plot where drawn from stored numbers) beside it: no training",
    )
    p.add_argument(
        "--rerender",
        action="store_true",
        help="--from-json for every named experiment (or all), reading <out>/<name>.json (default docs/results)",
    )
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    p.set_defaults(handler=_experiment, overrides=[])
