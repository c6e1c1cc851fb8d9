"""``elastic-pretrain train``: run a job (one process, or one rank under torchrun)."""

from __future__ import annotations

import argparse
import logging
import os
import warnings


def _quiet_logs() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # megatron-core warns at import time that TE/Apex are absent; the CPU path is deliberate.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _train(args: argparse.Namespace) -> int:
    _quiet_logs()
    from elastic_pretrain.job import load_job
    from elastic_pretrain.train.trainer import train

    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    job = load_job(args.job, overrides)
    train(job)
    return 0


def _show(args: argparse.Namespace) -> int:
    from elastic_pretrain.job import dump_job, load_job

    print(dump_job(load_job(args.job, list(args.overrides))), end="")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a job (run under torchrun for several ranks)",
                       description="Train jobs/<run>.yaml; presets by name, key.path=value overrides.")
    p.add_argument("job", help="job YAML, e.g. jobs/tiny-cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. model.loops=4")
    p.add_argument("--run-dir", help="run directory (default runs/<name>)")
    p.set_defaults(handler=_train)
    c = sub.add_parser("config", help="print the resolved job config (presets and overrides applied)")
    c.add_argument("job")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    c.set_defaults(handler=_show)
