"""seed-noise: the fixed-depth job over the seeds; the yardstick for the differences in the other reports."""

from __future__ import annotations

from elastic_pretrain.eval.loss import quality_curve
from elastic_pretrain.experiments.present import plot_curves, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings


def analyse(ctx: Context) -> Findings:
    tokens = ctx.val_tokens()
    curves = [quality_curve(ctx.model(r.name), tokens, name=r.name) for r in ctx.runs]
    max_loops = ctx.runs[0].job.model.max_loops
    ells = list(range(1, max_loops + 1))
    by = {c.name: {int(p.loops): p.loss for p in c.points} for c in curves}
    rows = [
        (r.name, r.seed, *(f"{by[c.name][e]:.4f}" for e in ells), f"{c.auc:.4f}")
        for r, c in zip(ctx.runs, curves, strict=True)
    ]
    anchor = ctx.runs[0].job.schedule.loops or max_loops
    return Findings(
        tables=[table(("job", "seed", *(f"loss ℓ={e}" for e in ells), "AUC"), rows)],
        reading=[
            f"The jobs train at ℓ = {anchor} only; the other ℓ are exits they never supervise. The spread over "
            "seeds is in the seed-noise table above (std and interval per ℓ).",
        ],
        numbers={"loss_by_loops": by, "auc": {c.name: c.auc for c in curves}},
        metrics={c.name: {**{f"loss@{e}": by[c.name][e] for e in ells}, "auc": c.auc} for c in curves},
        plot=lambda path: plot_curves(curves, path, title="fixed-depth job: held-out loss vs compute"),
        method=[
            "The seed sets the initialisation, the order of the training sequences and the depth draws "
            "(train/config.py), so this spread covers both initialisation and data-order noise. Every other report "
            "measures the seed noise of its own arms the same way (its seed-noise table).",
        ],
    )


EXPERIMENT = Experiment(
    name="seed-noise",
    title="Seed noise: the fixed-depth job over the seeds",
    question="How far apart do two runs of the same job land when only the seed differs? The fixed-depth job "
    "of exit-schedules, trained with every seed of --seeds.",
    analyse=analyse,
)
