"""``elastic-pretrain checkpoints <run dir>``: the committed checkpoints of a run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from elastic_pretrain.checkpoint.index import checkpoint_index
from elastic_pretrain.checkpoint.latest import latest_problem
from elastic_pretrain.checkpoint.store import CheckpointStore
from elastic_pretrain.rundir import RunFiles


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _layout(layout: dict[str, int]) -> str:
    return " ".join(f"{k}{layout[k]}" for k in ("tp", "ep", "pp", "dp") if k in layout)


def _list(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    rows = checkpoint_index(run_dir, check=args.verify)
    store = CheckpointStore(RunFiles(run_dir).checkpoints)
    stale = latest_problem(store)
    newest = store.newest()
    if stale:  # before the table, on stderr: --json stays parseable
        fix = " (the next resumed run repairs it)" if newest else ""
        print(f"warning: {stale}{fix}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"{run_dir}: no committed checkpoints")
        return 0
    print(f"{'step':>8}  {'size':>10}  {'tokens':>14}  {'layout':<16} path")
    for r in rows:
        mark = "  <- latest" if r["latest"] and not stale else ""
        if stale and newest is not None and r["step"] == newest.step:
            mark = "  <- latest committed (the latest file is stale)"
        size, layout = _human(r["bytes"]), _layout(r["layout"])
        print(f"{r['step']:>8}  {size:>10}  {r['tokens']:>14,}  {layout:<16} {r['path']}{mark}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "checkpoints",
        help="list a run's committed checkpoints (step, size, tokens, layout)",
        description="List the committed checkpoints under <run dir>/checkpoints.",
    )
    p.add_argument("run_dir", help="run directory, e.g. runs/tiny-cpu")
    p.add_argument("--verify", action="store_true", help="check every file's size and checksum")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_list)
