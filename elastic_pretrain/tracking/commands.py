"""``elastic-pretrain runs``: the runs of an experiment, with their loss per loop count, as a table."""

from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path
from typing import Any

from elastic_pretrain.config import clip
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import read_bounded
from elastic_pretrain.jsonsafe import loads as json_loads
from elastic_pretrain.tracking import store
from elastic_pretrain.tracking.config import ENV_TRACKING_URI, local_store_dir, local_store_uri, redact_uri
from elastic_pretrain.tracking.mlflow_env import is_transient, make_client, short_error
from elastic_pretrain.tracking.names import LOSS, SYSTEM_PREFIX, loops_of_val_loss, val_loss_loops

_REQUEST_TIMEOUT_S = 10  # a CLI answers within seconds or says why; the tracker's timeout is separate


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "runs",
        help="list the MLflow runs of an experiment (status, last step, loss per loop count)",
        description="List the MLflow runs of an experiment: name, id, status, last step, last loss and the "
        "last validation loss per loop count. With RUN_DIR, the store and experiment that run used.",
    )
    p.add_argument(
        "run_dir",
        nargs="?",
        type=Path,
        metavar="RUN_DIR",
        help="a run directory (runs/<name>): use its tracking store and experiment",
    )
    p.add_argument(
        "--uri",
        help=f"tracking URI (default: ${ENV_TRACKING_URI}, else RUN_DIR's local store; the server a run "
        "directory names is used only when given here)",
    )
    p.add_argument("--experiment", "-e", help="experiment name (default: the one RUN_DIR logged to)")
    p.add_argument("--max-runs", type=int, default=50, help="newest runs shown (default 50)")
    p.set_defaults(handler=runs_command)


def _run_info(run_dir: Path | None) -> dict[str, Any]:
    """What the tracker recorded in RUN_DIR/mlflow/run.json (store URI, experiment), if anything."""
    if run_dir is None:
        return {}
    path = local_store_dir(run_dir) / "run.json"
    try:  # a FIFO or /dev/zero there is a one-line error, not a hang (files.py)
        info = json_loads(read_bounded(path, "run.json"), path)
    except (OSError, ValueError):  # no store of ours there (a bad run.json included): nothing recorded
        return {}
    return info if isinstance(info, dict) else {}


def resolve_target(uri: str | None, experiment: str | None, run_dir: Path | None) -> tuple[str, str]:
    """(uri, experiment): the URI from ``--uri``, else ``$MLFLOW_TRACKING_URI``, else RUN_DIR's local store.

    A run directory may come from someone else: the server its run.json names is never contacted on its
    say-so (MLflow would send that server the user's ``MLFLOW_TRACKING_TOKEN``/password). Only its local
    sqlite store, inside the directory itself, is used without asking."""
    if run_dir is not None and not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory (runs live in runs/<name>)")
    info = _run_info(run_dir)
    uri = uri or os.environ.get(ENV_TRACKING_URI) or None
    if uri is None and run_dir is not None:
        stored, local = info.get("uri"), local_store_uri(run_dir)
        if isinstance(stored, str) and stored and stored != local and _outside(stored, run_dir):
            raise UserError(
                f"{local_store_dir(run_dir) / 'run.json'} says the run logged to {clip(redact_uri(stored), 100)}; "
                "a run directory does not choose where your MLflow credentials go: pass --uri with that URI "
                f"if you trust it (or set ${ENV_TRACKING_URI})"
            )
        uri = local
    if uri is None:
        raise UserError(f"no tracking store given: pass RUN_DIR or --uri URI (or set {ENV_TRACKING_URI})")
    if run_dir is not None and uri == local_store_uri(run_dir):
        # the run directory's own store, possibly someone else's: a link, a FIFO, random bytes or a view that
        # never ends is one line here, before MLflow opens it (tracking/store.py)
        if store.check_store(run_dir, writing=False) is None:
            db = store.store_db(run_dir)
            raise UserError(f"no MLflow store at {db}: run a job with tracking first, or pass --uri")
    elif uri.startswith("sqlite:"):
        db = Path(uri.removeprefix("sqlite:///"))
        if not db.is_file():  # opening a missing sqlite store would silently create an empty one
            raise UserError(f"no MLflow store at {db}: run a job with tracking first, or pass --uri")
    stored_experiment = info.get("experiment") if isinstance(info.get("experiment"), str) else None
    experiment = experiment or stored_experiment or (run_dir.absolute().name if run_dir else None)
    if not experiment:
        raise UserError("which experiment? pass --experiment NAME (or a RUN_DIR)")
    return uri, experiment


def _outside(uri: str, run_dir: Path) -> bool:
    """True unless ``uri`` is a sqlite store inside ``run_dir`` (a moved run directory keeps working)."""
    if not uri.startswith("sqlite:///"):
        return True
    db = Path(uri.removeprefix("sqlite:///"))
    return not (db.is_relative_to(local_store_dir(run_dir)) or (db.name == "mlflow.db" and db.parent.name == "mlflow"))


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def runs_table(runs: list[Any]) -> str:
    """One row per run; a val-loss column per loop count seen in any of the runs."""
    latest = []  # per run: key -> (value, step) of the metric's value at its largest step
    for run in runs:
        latest.append({m.key: (m.value, m.step) for m in run.data.to_proto().metrics})
    loops = sorted({k for m in latest for key in m if (k := loops_of_val_loss(key)) is not None})
    rows = [["NAME", "RUN ID", "STATUS", "STEP", "LOSS", *[f"VAL_LOSS@{k}" for k in loops]]]
    for run, metrics in zip(runs, latest):
        steps = [step for key, (_, step) in metrics.items() if not key.startswith(SYSTEM_PREFIX)]
        rows.append(
            [
                run.info.run_name or "-",
                run.info.run_id,
                run.info.status,
                str(max(steps)) if steps else "-",
                _fmt(metrics.get(LOSS, (None, 0))[0]),
                *[_fmt(metrics.get(val_loss_loops(k), (None, 0))[0]) for k in loops],
            ]
        )
    return _table(rows)


def runs_command(args: argparse.Namespace) -> int:
    if args.max_runs < 1:
        raise UserError(f"--max-runs must be >= 1, got {args.max_runs}")
    uri, name = resolve_target(args.uri, args.experiment, args.run_dir)
    shown = redact_uri(uri)  # printed: without user:password@
    own = args.run_dir is not None and uri == local_store_uri(args.run_dir)
    if own:
        store.time_box(store.store_db(args.run_dir))
    try:
        client = make_client(uri, _REQUEST_TIMEOUT_S)
        if own:  # MLflow logs a failed query with its traceback; the one line below says it instead
            logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
        exp = client.get_experiment_by_name(name)
        if exp is None:
            names = [e.name for e in client.search_experiments(max_results=20)]
            raise UserError(
                f"experiment {name!r} not found at {shown} (existing: {', '.join(names) or 'none'}); "
                "pass --experiment NAME"
            )
        runs = client.search_runs(
            [exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=args.max_runs
        )
    except UserError:
        raise
    except Exception as err:
        if own:  # a local file: nothing to reach, so a failure is the store's (e.g. a time-boxed query)
            raise store.store_error(store.store_db(args.run_dir), err) from None
        if is_transient(err):
            raise UserError(
                f"cannot reach MLflow at {shown} ({short_error(err)}): "
                f"start the server or fix --uri / ${ENV_TRACKING_URI}"
            ) from None
        raise UserError(f"MLflow at {shown} refused the query: {short_error(err)}") from None
    if not runs:
        print(f"experiment {name!r} at {shown}: no runs")
        return 0
    print(f"experiment {name!r} at {shown}: {len(runs)} run(s), newest first")
    print(runs_table(runs))
    return 0
