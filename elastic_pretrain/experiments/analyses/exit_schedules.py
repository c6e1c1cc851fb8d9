"""exit-schedules: telescopic, mixed depth and fixed exits vs fixed depth on the same tokens (TLM)."""

from __future__ import annotations

import math

from elastic_pretrain.eval.quality import auc, compare, quality_curve
from elastic_pretrain.experiments.present import plot_curves, ranked, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings, Run
from elastic_pretrain.experiments.stats import Claim, paired

TLM = "seeds/000, seeds/001 (TLM)"


def sampler(run: Run) -> str:
    s = run.job.schedule
    extra = f" {s.exits}" if s.sampler == "fixed_exits" else ""
    return f"{s.sampler}{extra}" + (f", switch at {s.switch_at:g}" if 0 < s.switch_at < 1 else "")


def analyse(ctx: Context) -> Findings:
    tokens = ctx.val_tokens()
    curves = [quality_curve(ctx.model(r.name), tokens, name=r.name) for r in ctx.runs]
    cmp = compare(curves)
    max_loops = ctx.runs[0].job.model.max_loops
    ells = range(1, max_loops + 1)
    by = {c.name: {int(p.loops): p.loss for p in c.points} for c in curves}
    # AUC on perplexity as TLM scores it, over the same compute range as the loss AUC
    ppl_auc = {
        c.name: auc([p.relative_compute for p in c.points], [math.exp(p.loss) for p in c.points], lo=cmp.lo, hi=cmp.hi)
        for c in curves
    }
    rows = [
        (
            c.name,
            sampler(run),
            *(f"{by[c.name][e]:.4f}" for e in ells),
            f"{a:.4f}",
            f"{rel:+.2%}",
            f"{ppl_auc[c.name]:.3f}",
        )
        for run, c, a, rel in zip(ctx.runs, curves, cmp.aucs, cmp.relative, strict=True)
    ]
    header = ("job", "sampler", *(f"loss ℓ={e}" for e in ells), "AUC", f"AUC vs {cmp.names[0]}", "AUC perplexity")
    compute = " | ".join(f"{p.relative_compute:.3f}" for p in curves[0].points)
    note = (
        f"Relative compute FLOPs(ℓ)/FLOPs(L_max) of ℓ = 1..{max_loops}: {compute}. AUC = compute-averaged loss "
        f"(and perplexity) over [{cmp.lo:.3f}, {cmp.hi:.3f}] (lower is better)."
    )
    aucs = dict(zip(cmp.names, cmp.aucs, strict=True))
    reading = [
        f"AUC, lowest first: {ranked(aucs)}.",
        f"At ℓ = 1 (the cheapest exit): {ranked({n: by[n][1] for n in by})}.",
        f"At ℓ = L_max = {max_loops} (full depth): {ranked({n: by[n][max_loops] for n in by})}.",
    ]
    metrics = {n: {**{f"loss@{e}": by[n][e] for e in ells}, "auc": aucs[n], "auc_ppl": ppl_auc[n]} for n in by}
    return Findings(
        tables=[table(header, rows) + "\n\n" + note],
        reading=reading,
        numbers={"loss_by_loops": by, "auc": aucs, "auc_ppl": ppl_auc, "auc_range": [cmp.lo, cmp.hi]},
        metrics=metrics,
        plot=lambda path: plot_curves(curves, path, title="held-out loss vs compute per exit schedule"),
        method=[
            "Every ℓ is evaluated on the same held-out tokens; a model with the loop-count conditioning on "
            "(mixed-scratch) runs each ℓ separately, conditioned on that ℓ; the others read every exit off one "
            "ℓ = L_max forward (their exits are prefixes of it).",
        ],
    )


EXPERIMENT = Experiment(
    name="exit-schedules",
    title="Exit schedules: telescopic, mixed depth and fixed exits vs fixed depth",
    question="Which way of training the exits gives the best loss at every loop count ℓ and the best "
    "quality-per-compute (AUC)? Four schedules on the same model, tokens and seeds: fixed depth (ℓ = L_max "
    "only), mixed depth from scratch (a random ℓ per micro-batch), telescopic (full depth plus one random "
    "prefix exit, TLM) and fixed exits 1, 2, 4 (Matryoshka-style).",
    analyse=analyse,
    claims=(
        Claim(
            paper='TLM cuts the area under the quality-budget curve relative to fixed-exit suites: "It cuts the '
            'area under the quality-budget curve by 43-44% relative to MLMS"',
            source=TLM,
            magnitude="−43–44% area (perplexity)",
            measure="telescopic minus fixed-exits AUC on perplexity",
            value=paired("telescopic", "fixed-exits", "auc_ppl"),
            expect="negative",
        ),
        Claim(
            paper='Fixed exits leave unsupervised depths bad: "leaves the nested model at chance level everywhere '
            'else"',
            source=TLM,
            magnitude="perplexity 10²–10⁵ at unsupervised depths",
            measure="fixed-exits (exits 1, 2, 4) minus telescopic loss at ℓ = 3, an exit fixed-exits never "
            "supervises (nats)",
            value=paired("fixed-exits", "telescopic", "loss@3"),
            expect="positive",
        ),
        Claim(
            paper='Every prefix becomes a language model: "a valid language model at every one of its twenty layer '
            'prefixes" (vs full-depth-only training, which supervises no prefix)',
            source=TLM,
            magnitude="valid at every prefix",
            measure="telescopic minus fixed-depth loss at ℓ = 1 (nats)",
            value=paired("telescopic", "fixed-depth", "loss@1"),
            expect="negative",
        ),
    ),
)
