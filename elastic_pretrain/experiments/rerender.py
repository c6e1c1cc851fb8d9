"""``elastic-pretrain experiment NAME --from-json docs/results/NAME.json`` (or ``--rerender``): decide a report's
claims again from the numbers it stored, without training or evaluating anything (issue 32 item 2).

A report's JSON holds every seed's metrics (``metrics_by_seed``) and numbers (``numbers_by_seed``). When the
claims change — a premise gate, a label, a new claim row, a scoring such as the decider's Pareto frontier that
the stored numbers allow (``Experiment.rescore``) — this recomputes each seed's metrics from those numbers,
decides today's claims over the seeds and rewrites, in the existing ``.md``, exactly the two sections that
depend on them: the claim table and the seed-noise table (``report.claims_section``/``noise_section``, the
functions a fresh run renders them with). Everything else in the report is the analysis of the stored numbers,
unchanged, and stays as the experiment wrote it. The JSON gets the new claims and metrics, and the plot is
redrawn where the experiment draws it from stored numbers (``Experiment.replot``). A claim whose quantity the
stored numbers lack reads "not measured" — nothing is estimated in its place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastic_pretrain.errors import UserError
from elastic_pretrain.experiments.report import claim_rows, claims_section, heading, noise_section
from elastic_pretrain.experiments.runner import Experiment
from elastic_pretrain.experiments.stats import Metrics, evaluate
from elastic_pretrain.files import read_json_object, read_small, write_atomic

MAX_REPORT_BYTES = 64 << 20  # a report's .md or .json: the largest here (decider.json) is 80 kB


def note(json_name: str, command: str) -> str:
    """The line a re-decided claim table carries (a fresh run's report has none)."""
    return (
        f"Decided again without retraining from the numbers stored in `{json_name}` (`{command}`): the question, "
        "the claims, their premises and labels are today's; every section but this table and the seed-noise table "
        "is as the command below wrote it."
    )


def load_report(experiment: Experiment, path: Path) -> dict[str, Any]:
    """The experiment's JSON report, checked to be one (a one-line error naming the fix otherwise). Read as any
    file someone else may have written: a regular file of bounded size (``files.read_json_object``)."""
    if not path.is_file():
        raise UserError(f"--from-json {path}: no such file (run `elastic-pretrain experiment {experiment.name}` first)")
    fix = f"not a JSON report: rerun `elastic-pretrain experiment {experiment.name}` to write it"
    data = read_json_object(path, fix, limit=MAX_REPORT_BYTES)
    if data.get("experiment") != experiment.name:
        found = data.get("experiment")
        raise UserError(f"--from-json {path}: a report of {found!r}, not of {experiment.name!r}: name its own JSON")
    for key in ("metrics_by_seed", "numbers_by_seed"):
        if not isinstance(data.get(key), dict) or not data[key]:
            raise UserError(f"--from-json {path}: no {key} (written before reports stored every seed): rerun "
                            f"`elastic-pretrain experiment {experiment.name}`")  # fmt: skip
    return data


def _metrics(path: Path, seed: str, raw: Any) -> Metrics:
    """One seed's stored metrics as ``arm -> metric -> float``, every value checked to be a number."""
    ok = isinstance(raw, dict) and all(
        isinstance(arm, dict) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in arm.values())
        for arm in raw.values()
    )
    if not ok:
        raise UserError(f"--from-json {path}: metrics_by_seed[{seed!r}] is not arm -> metric -> number")
    return {a: {k: float(v) for k, v in m.items()} for a, m in raw.items()}


def seed_metrics(experiment: Experiment, data: dict[str, Any], path: Path) -> dict[int, Metrics]:
    """Every seed's metrics, recomputed from its stored numbers where the experiment rescores them."""
    out: dict[int, Metrics] = {}
    for seed, raw in data["metrics_by_seed"].items():
        if not seed.lstrip("-").isdigit():
            raise UserError(f"--from-json {path}: seed {seed!r} is not an integer")
        metrics = _metrics(path, seed, raw)
        if experiment.rescore is not None:
            metrics = experiment.rescore(data["numbers_by_seed"].get(seed, {}), metrics)
        out[int(seed)] = metrics
    return out


def replace_section(text: str, header: str, lines: list[str], path: Path) -> str:
    """``text`` with the section that starts at the line ``header`` (up to the next ``## `` line) replaced."""
    rows = text.split("\n")
    if header not in rows:
        raise UserError(f"{path}: no '{header}' section to rewrite: rerun the experiment to write the report again")
    start = rows.index(header)
    end = next((i for i in range(start + 1, len(rows)) if rows[i].startswith("## ")), len(rows))
    return "\n".join([*rows[:start], *lines, *rows[end:]])


def rerender(experiment: Experiment, json_path: Path, *, command: str) -> Path:
    """Decide ``experiment``'s claims again from ``json_path`` and rewrite the report beside it (module
    docstring); returns the ``.md`` path."""
    data = load_report(experiment, json_path)
    md = json_path.with_suffix(".md")
    if not md.is_file():
        raise UserError(f"--from-json {json_path}: no report {md} beside it to rewrite (rerun the experiment)")
    metrics = seed_metrics(experiment, data, json_path)
    claims = [evaluate(c, metrics) for c in experiment.claims]
    raw = read_small(md, MAX_REPORT_BYTES, "not a report: rerun the experiment to write it again")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{md}: not UTF-8 text: rerun the experiment to write the report again") from None
    text = replace_section(text, "## Claims", [*claims_section(claims), note(json_path.name, command), ""], md)
    text = "\n".join([*heading(experiment), text[text.index("## Claims\n") :]])
    text = replace_section(text, "## Seed noise", noise_section(metrics), md)
    data["claims"] = claim_rows(claims)
    data["metrics_by_seed"] = {str(s): m for s, m in metrics.items()}
    data["rerendered"] = command
    write_atomic(md, text, root=md.parent)
    write_atomic(json_path, json.dumps(data, indent=1) + "\n", root=json_path.parent)
    written = [md, json_path]
    first = next(iter(data["numbers_by_seed"]))
    if experiment.replot is not None:
        png = md.with_suffix(".png")
        experiment.replot(data["numbers_by_seed"][first], png)
        written.append(png)
    print(f"rewritten from the stored numbers: {', '.join(map(str, written))}", flush=True)
    return md
