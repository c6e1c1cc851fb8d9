"""Quality-budget artifacts: validation loss and perplexity against loop count, per eval.

An elastic-depth model trades compute (loops) for quality; the plot shows that trade at the latest
eval, with a few earlier evals faded behind it so progress over training is visible. The table
(CSV, one row per eval step and loop count) keeps every eval and is re-read on resume.

Rendered with matplotlib's object API on an Agg canvas (no pyplot global state), so it is safe in
the tracker's background thread and needs no display.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from elastic_pretrain.errors import UserError
from elastic_pretrain.files import atomic_file, read_text_bounded, write_atomic

PNG_NAME = "quality_budget.png"
CSV_NAME = "quality_budget.csv"
_EARLIER_SHOWN = 4  # faded earlier evals in the plot; more turns it into noise


def perplexity(loss: float) -> float:
    """``exp(loss)``, clipped so a diverged run (loss > 709) yields inf instead of an OverflowError."""
    return math.exp(loss) if loss < 709.0 else math.inf


History = dict[int, dict[int, float]]  # eval step -> {loop count: validation loss}


def read_table(path: Path) -> History:
    """Evals recorded by an earlier attempt of this run (empty if none or unreadable)."""
    history: History = {}
    try:  # a regular file of bounded size: a FIFO or a link there is not read (files.py)
        text = read_text_bounded(path, "quality_budget.csv")
        for row in csv.DictReader(io.StringIO(text, newline="")):
            history.setdefault(int(row["step"]), {})[int(row["loops"])] = float(row["val_loss"])
    except (OSError, KeyError, TypeError, ValueError, UserError):
        return {}
    return history


def write_table(path: Path, history: History, *, root: Path) -> None:
    """The table replaces ``path`` (below ``root``) atomically: an artifact upload never sees half a file, and
    a link planted at its name (or a temporary one) is never written through (files.py)."""
    text = io.StringIO(newline="")
    w = csv.writer(text)
    w.writerow(["step", "loops", "val_loss", "val_ppl"])
    for step in sorted(history):
        for loops, loss in sorted(history[step].items()):
            w.writerow([step, loops, f"{loss:.6g}", f"{perplexity(loss):.6g}"])
    write_atomic(path, text.getvalue(), root=root)


def write_plot(path: Path, history: History, *, root: Path) -> None:
    """Two panels (loss, perplexity) vs loop count; latest eval solid, earlier ones faded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = sorted(history)
    latest = steps[-1]
    fig = Figure(figsize=(9, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax_loss, ax_ppl = fig.subplots(1, 2)
    shown = steps[-1 - _EARLIER_SHOWN :]
    for i, step in enumerate(shown):
        loops = sorted(history[step])
        losses = [history[step][k] for k in loops]
        is_latest = step == latest
        style = {
            "marker": "o",
            "linewidth": 2.0 if is_latest else 1.0,
            "alpha": 1.0 if is_latest else 0.25 + 0.5 * i / max(1, len(shown) - 1),
            "color": "C0" if is_latest else "0.5",
            "label": f"step {step}",
        }
        ax_loss.plot(loops, losses, **style)
        ax_ppl.plot(loops, [perplexity(x) for x in losses], **style)
    all_loops = sorted({k for s in shown for k in history[s]})
    for ax, label in ((ax_loss, "validation loss"), (ax_ppl, "validation perplexity")):
        ax.set_xlabel("loop count")
        ax.set_ylabel(label)
        ax.set_xticks(all_loops)
        ax.grid(True, alpha=0.3)
    ax_loss.legend(fontsize=8)
    fig.suptitle(f"quality budget at step {latest}")
    fig.tight_layout()
    with atomic_file(path, root=root) as f:
        fig.savefig(f, format="png")
