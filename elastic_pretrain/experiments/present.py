"""Tables and plots shared by the experiment reports: the claim table, the seed-noise table, markdown
tables, ranked lists and matplotlib figures. The quality-curve plot and table live with the curves
(``eval/curves.py``, ``eval/report.py``);
they are re-exported here so that analyses import presentation from one place."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from elastic_pretrain.eval.curves import QualityCurve
from elastic_pretrain.eval.report import markdown_table as curve_table
from elastic_pretrain.eval.report import plot as plot_curves
from elastic_pretrain.eval.report import save_figure
from elastic_pretrain.experiments.stats import CONFIDENCE, ClaimResult, Metrics, t_interval

__all__ = [
    "QualityCurve",
    "claim_table",
    "curve_table",
    "figure",
    "noise_table",
    "pct",
    "plot_curves",
    "ranked",
    "save_figure",
    "table",
]


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table; cells are written with ``str`` (format numbers before)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(a: float, b: float) -> str:
    """``a`` relative to ``b`` as a signed percentage."""
    return f"{(a - b) / b:+.1%}"


def ranked(values: dict[str, float]) -> str:
    """``name value`` pairs, lowest value first."""
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(values.items(), key=lambda kv: kv[1]))


def figure(path: Path, draw: Callable[[Any], None], *, panels: int = 1) -> None:
    """A 1 x ``panels`` matplotlib figure drawn by ``draw(axes)`` and saved to ``path`` (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.6), dpi=100)
    try:
        draw(axes)
    except BaseException:
        plt.close(fig)
        raise
    save_figure(fig, path)


def claim_table(results: Sequence[ClaimResult]) -> str:
    """The table every report opens with: the paper's claim · what we measured · resolved? and why. A premise
    row says so in its first cell; an implementation check says so beside its verdict (stats.py)."""
    if not results:
        return (
            "No claim of the papers is tested here: this report measures a yardstick for the others "
            "(the seed-noise table below)."
        )
    rows = []
    for r in results:
        c = r.claim
        measured = f"{c.measure}: {r.interval.text()}" if r.interval else c.measure
        kind = {"premise": "**premise** — ", "implementation check": "", "paper": ""}[c.kind]
        label = " (implementation check, not evidence for the paper)" if c.kind == "implementation check" else ""
        cells = (
            f"{kind}{c.paper} ({c.source}; expected: {c.expect}, {c.magnitude})",
            measured,
            f"**{r.verdict}**{label} — {r.reason}",
        )
        rows.append(tuple(cell.replace("|", "\\|") for cell in cells))  # a '|' in a quote would split the row
    note = (
        f"Measured: the mean over seeds of a paired difference (each seed's arms share initialisation, data "
        f"order and depth draws) with its two-sided {CONFIDENCE:.0%} Student-t interval [lo, hi]. A direction is "
        "stated (yes / contradicted) only when the interval excludes 0; a 'matches' claim is yes only when the "
        "interval lies inside the stated band. **not resolved — premise absent**: the claim presupposes a premise "
        "(its own row, e.g. that more passes lower the loss on these runs) that did not resolve yes, so its own "
        "interval is shown but not read. **not comparable**: our metric is not the paper's (e.g. next-token "
        "accuracy against benchmark scores), so agreement or contradiction with the paper's number is not stated. "
        "An **implementation check** is an accounting identity of this code (e.g. training compute replayed from "
        "the schedule), evidence that the implementation does what the recipe says, not evidence for the paper."
    )
    return table(("the paper's claim (direction, magnitude)", "what we measured", "resolved?"), rows) + "\n\n" + note


def noise_table(by_seed: dict[int, Metrics], metrics: Sequence[str] | None = None) -> str:
    """Per arm and metric: mean over the seeds, standard deviation (the seed noise) and the 95% interval."""
    seeds = list(by_seed)
    arms = list(by_seed[seeds[0]]) if seeds else []
    found = list(dict.fromkeys(k for m in by_seed.values() for a in m.values() for k in a))
    names = list(metrics) if metrics is not None else found
    rows = []
    for arm in arms:
        for name in names:
            values = [by_seed[s][arm][name] for s in seeds if name in by_seed[s].get(arm, {})]
            if not values:
                continue
            iv = t_interval(values)
            spread = f"[{iv.lo:.4f}, {iv.hi:.4f}]" if iv.n > 1 else "–"
            std = f"{iv.std:.4f}" if iv.n > 1 else "–"
            rows.append((arm, name, f"{iv.mean:.4f}", std, spread, " ".join(f"{v:.4f}" for v in values)))
    per_seed = f"per seed ({', '.join(map(str, seeds))})"
    return table(("arm", "metric", "mean", "std over seeds", f"{CONFIDENCE:.0%} interval", per_seed), rows)
