"""Presentation shared by ``elastic-pretrain eval`` and the experiments: markdown tables and plots.

Tables are markdown strings; plots are PNGs written with matplotlib's Agg backend (no display).
The numbers come from ``eval/curves.py`` (curves, AUC) and ``eval/loss.py`` (losses).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_pretrain.eval.curves import Comparison, QualityCurve, compare
from elastic_pretrain.files import atomic_file


def markdown_table(curve: QualityCurve) -> str:
    """A markdown table of the curve and its AUC."""
    rows = [
        f"**{curve.name}**",
        "",
        "| loops | FLOPs/token | relative compute | loss | perplexity |",
        "|---|---|---|---|---|",
    ]
    for p in curve.points:
        flops = f"{p.relative_compute * curve.flops_max:,.0f}" if curve.flops_max else "–"
        loops = f"{p.loops:g}" if float(p.loops).is_integer() else f"{p.loops:.2f}"
        rows.append(f"| {loops} | {flops} | {p.relative_compute:.3f} | {p.loss:.4f} | {p.perplexity:.3f} |")
    rows += [
        "",
        f"AUC (compute-averaged loss over [{curve.points[0].relative_compute:.3f}, "
        f"{curve.points[-1].relative_compute:.3f}]): {curve.auc:.4f}",
        "",
    ]
    return "\n".join(rows)


def comparison_table(cmp: Comparison) -> str:
    """A markdown table of the AUCs of a :func:`~elastic_pretrain.eval.curves.compare`, relative to the first."""
    rows = ["| curve | AUC | vs " + cmp.names[0] + " |", "|---|---|---|"]
    for name, a, r in zip(cmp.names, cmp.aucs, cmp.relative, strict=True):
        rows.append(f"| {name} | {a:.4f} | {r:+.2%} |")
    return "\n".join(rows) + f"\n\nAUC over relative compute [{cmp.lo:.3f}, {cmp.hi:.3f}] (common range).\n"


def plot(
    curves: Sequence[QualityCurve], path: Path, *, title: str = "quality vs compute", root: Path | None = None
) -> Path:
    """Loss against relative compute for each curve, written as a PNG (matplotlib Agg, no display); ``root``:
    as for :func:`save_figure`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    try:
        for c in curves:
            xs = [p.relative_compute for p in c.points]
            ax.plot(xs, [p.loss for p in c.points], marker="o", label=f"{c.name} (AUC {c.auc:.3f})")
            for p in c.points:
                if float(p.loops).is_integer():
                    ax.annotate(
                        f"ℓ={p.loops:g}",
                        (p.relative_compute, p.loss),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=7,
                    )
        ax.set_xlabel("relative compute  FLOPs(ℓ) / FLOPs(L_max)")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.set_title(title, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    except BaseException:
        plt.close(fig)
        raise
    return save_figure(fig, path, root=root)


def plot_comparison(curves: Sequence[QualityCurve], path: Path) -> Comparison:
    """:func:`~elastic_pretrain.eval.curves.compare` the curves and plot them with their AUCs in the title."""
    cmp = compare(curves)
    title = "quality vs compute: " + ", ".join(
        f"{n} AUC {a:.3f} ({r:+.1%})" for n, a, r in zip(cmp.names, cmp.aucs, cmp.relative, strict=True)
    )
    plot(curves, path, title=title)
    return cmp


def save_figure(fig: Any, path: str | Path, *, root: Path | None = None) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure; returns the path. ``root``: the
    directory the caller named (default: the figure's own folder), below which no link is followed: the
    figure replaces ``path`` through a new file (files.py), so a link planted there is never written through."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        fig.tight_layout()
        with atomic_file(path, root=path.parent if root is None else root) as f:
            fig.savefig(f, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path
