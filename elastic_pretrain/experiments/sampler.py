"""Sampler experiment (issue 19, item 4): does each depth sampler still train the same?

Independent-rank draws (ELR) against the synchronized per-step baseline and compute-balanced mixed
depth, at equal tokens, three seeds each (the seed sets initialisation, data order and draws, so runs
with the same seed are paired): held-out loss at ℓ = 1 and ℓ = L_max with 95% t-intervals over seeds,
the paired difference to independent-rank, and wall time per training token.

The experiment runner trains single-process jobs. With one replica, ``balance: compute`` deals every
micro-batch to that replica and so draws per micro-batch exactly as ``independent_rank`` does (other
draws, same distribution): the job set checks that the balanced code path trains the same; *where*
loop counts are mixed across replicas (ELR's point about the one-loop endpoint) needs multi-process
jobs, which this runner does not run.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from elastic_pretrain.eval.quality import evaluate_loops
from elastic_pretrain.experiments.runner import Context, Experiment, Findings, Run

REFERENCE = "independent_rank"
# two-sided 95% Student t quantiles by degrees of freedom (1..10); beyond: the normal quantile
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def sampler_label(run: Run) -> str:
    s = run.job.schedule
    label = s.sampler + (f" + one_loop_fraction {s.one_loop_fraction:g}" if s.one_loop_fraction else "")
    return label + (f" + balance: {s.balance}" if s.balance != "off" else "")


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval); half-width nan with fewer than two values."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    t = _T975[len(values) - 2] if len(values) - 1 <= len(_T975) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def _fmt(mean: float, half: float) -> str:
    return f"{mean:.4f} ± {half:.4f}" if not math.isnan(half) else f"{mean:.4f}"


def samplers(ctx: Context) -> Findings:
    top = ctx.runs[0].job.model.max_loops
    ends = [1, top]
    loss: dict[str, dict[int, float]] = {}
    for r in ctx.runs:
        evals = evaluate_loops(ctx.model(r.name), ctx.val_tokens(), ends)
        loss[r.name] = {ell: e.loss for ell, e in evals.items()}
    groups: dict[str, list[Run]] = defaultdict(list)
    for r in ctx.runs:
        groups[sampler_label(r)].append(r)
    ref = groups.get(REFERENCE, [])
    ref_by_seed = {r.job.train.seed: r for r in ref}
    rows = [f"| sampler | seeds | loss ℓ=1 | loss ℓ={top} | Δ vs {REFERENCE} ℓ=1 (paired) | Δ ℓ={top} (paired) "
            "| ms / 1k tokens |", "|---|---|---|---|---|---|---|"]
    numbers: dict[str, dict] = {}
    reading = []
    for label, runs in groups.items():
        by_end = {e: interval([loss[r.name][e] for r in runs]) for e in ends}
        paired = {e: [loss[r.name][e] - loss[ref_by_seed[r.job.train.seed].name][e]
                      for r in runs if r.job.train.seed in ref_by_seed] for e in ends}
        delta = {e: interval(d) if d else (math.nan, math.nan) for e, d in paired.items()}
        ms = statistics.fmean(1e6 * r.seconds_per_step / r.job.tokens_per_step for r in runs)
        rows.append(f"| {label} | {len(runs)} | {_fmt(*by_end[1])} | {_fmt(*by_end[top])} | "
                    + " | ".join("–" if label == REFERENCE else _fmt(*delta[e]) for e in ends) + f" | {ms:.2f} |")
        numbers[label] = {"loss": {e: by_end[e] for e in ends}, "paired_delta": {e: delta[e] for e in ends},
                          "ms_per_1k_tokens": ms, "runs": [r.name for r in runs]}
        if label != REFERENCE and ref:
            for e in ends:
                mean, half = delta[e]
                verdict = ("not resolved (the interval contains 0)" if math.isnan(half) or abs(mean) <= half
                           else ("worse" if mean > 0 else "better"))
                reading.append(f"{label} minus {REFERENCE} at ℓ = {e}: {_fmt(mean, half)} nats over "
                               f"{len(paired[e])} paired seeds — {verdict}.")
    return Findings(
        tables=["\n".join(rows)],
        reading=reading or [f"No {REFERENCE} runs to compare with."],
        numbers={"by_sampler": numbers, "loss_by_run": loss},
        plot=lambda path: _plot(path, numbers, ends),
        method=[
            "Mean ± half-width of the 95% Student-t interval over seeds; Δ is paired by seed (same "
            "initialisation and data order), independent_rank subtracted.",
            "Wall time per token: the run's training seconds / steps / tokens per step (single process, the "
            "machine's load included: compare within one report only).",
            "Single-process jobs: balance: compute draws per micro-batch like independent_rank (one replica gets "
            "every slot); mixing across replicas needs multi-process jobs (docs/elastic-depth.md).",
        ],
    )


def _plot(path: Path, numbers: dict[str, dict], ends: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ends), figsize=(5.2 * len(ends), 3.6), dpi=100)
    try:
        for ax, e in zip(axes, ends):
            labels = list(numbers)
            means = [numbers[k]["loss"][e][0] for k in labels]
            halves = [0.0 if math.isnan(numbers[k]["loss"][e][1]) else numbers[k]["loss"][e][1] for k in labels]
            ax.errorbar(range(len(labels)), means, yerr=halves, fmt="o", capsize=4)
            ax.set_xticks(range(len(labels)), labels, rotation=15, fontsize=7)
            ax.set_ylabel(f"held-out loss at ℓ = {e}")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


EXPERIMENT = Experiment(
    name="samplers",
    title="Depth samplers: independent-rank (ELR) vs per-step vs compute-balanced",
    question="At equal tokens, does the sampler change the held-out loss at ℓ = 1 and ℓ = L_max, and the wall "
    "time per token? Independent-rank draws (ELR), one ℓ per optimizer step, and compute-balanced mixed depth "
    "(schedule.balance: compute), three seeds each, mixed depth from the first step.",
    analyse=samplers,
    varies=("train.seed",),
)
