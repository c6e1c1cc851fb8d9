"""The markdown report of an experiment (``<out>/<name>.md``), its plot and its numbers as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elastic_pretrain.eval.quality import flops_breakdown, flops_per_token
from elastic_pretrain.experiments.runner import (
    Context,
    Experiment,
    Findings,
    Run,
    ensure_trained,
    job_diff,
    load_jobs,
    load_post_training,
)
from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown


def run_experiment(
    experiment: Experiment, *, runs_root: Path, out_dir: Path, overrides: list[str], quick: bool, command: str
) -> Path:
    """Train or reuse every job, analyse, write ``<out_dir>/<name>.{md,png,json}``; returns the .md path."""
    runs: list[Run] = []
    for path, job in load_jobs(experiment.name, runs_root, overrides):  # config errors before any training
        job = job or load_post_training(path, experiment.name, runs_root, overrides, runs)
        runs.append(ensure_trained(path, job, runs_root))
    init_mesh(ParallelConfig(), seed=0)  # one process, for loading and evaluating the checkpoints
    try:
        ctx = Context(experiment, runs, quick=quick)
        findings = experiment.analyse(ctx)
        out_dir.mkdir(parents=True, exist_ok=True)
        png = out_dir / f"{experiment.name}.png"
        findings.plot(png)
        md = out_dir / f"{experiment.name}.md"
        md.write_text(render(ctx, findings, command=command, png=png.name))
        numbers = {
            "experiment": experiment.name,
            "command": command,
            "quick": quick,
            "runs": _run_rows(ctx),
            **findings.numbers,
        }
        (out_dir / f"{experiment.name}.json").write_text(json.dumps(numbers, indent=1) + "\n")
    finally:
        teardown()
    print(f"written: {md}, {png}, {out_dir / (experiment.name + '.json')}", flush=True)
    return md


def parameters(ctx: Context, run: Run) -> int:
    return sum(p.numel() for p in ctx.model(run.name).parameters())


def max_flops(run: Run) -> float:
    cfg = run.job.model
    return flops_per_token(cfg, cfg.max_loops, seq_len=run.job.data.seq_len)


def training_compute(run: Run) -> tuple[float, float]:
    """(mean passes per training micro-batch, training FLOPs = 3 x forward FLOPs summed over the tokens).

    Replays the run's depth plans (a pure function of seed, step and micro-batch; train/schedule.py); an
    extra supervised exit costs one more coda + output layer."""
    from elastic_pretrain.train.schedule import ScheduleController

    job = run.job
    cfg, seq = job.model, job.data.seq_len
    micro = job.train.micro_batches(1)
    tokens_per_micro = job.train.micro_batch_size * seq
    ctl = ScheduleController(
        job.schedule, max_loops=cfg.max_loops, total_tokens=run.steps * job.tokens_per_step, seed=job.train.seed
    )
    passes, flops, n = 0.0, 0.0, 0
    for step in range(run.steps):
        ctl.update(step=step, tokens_seen=step * job.tokens_per_step)
        plans = ([p for _, p in ctl.balanced_plans(step=step, micro_batches=micro, replica=0, replicas=1)]
                 if ctl.balanced else [ctl.plan(step=step, micro=i, replica=0) for i in range(micro)])
        for plan in plans:
            b = flops_breakdown(cfg, plan.loops, seq_len=seq)
            per_exit = b.edges * cfg.coda_layers / max(1, cfg.prelude_layers + cfg.coda_layers) + b.output
            passes += plan.loops
            flops += 3 * tokens_per_micro * (b.total + (len(plan.exits) - 1) * per_exit)
            n += 1
    return passes / max(1, n), flops


def _run_rows(ctx: Context) -> list[dict[str, Any]]:
    return [
        {
            "job": r.name,
            "file": str(r.job_path),
            "run_dir": str(r.run_dir),
            "status": r.status,
            "steps": r.steps,
            "tokens": r.tokens,
            "seed": r.job.train.seed,
            "parameters": parameters(ctx, r),
            "flops_per_token_at_max_loops": max_flops(r),
            "max_loops": r.job.model.max_loops,
            "train_seconds": r.summary["elapsed_s"],
        }
        for r in ctx.runs
    ]


def _status(run: Run) -> str:
    own = run.run_dir.resolve() == run.job.run_path.resolve()
    return run.status if own else f"{run.status}: `{run.run_dir}` (same config)"


def render(ctx: Context, findings: Findings, *, command: str, png: str) -> str:
    e, runs = ctx.experiment, ctx.runs
    seeds = sorted({r.job.train.seed for r in runs})
    tokens = sorted({r.tokens for r in runs})
    first = runs[0].job
    lines = [
        f"# {e.title}",
        "",
        e.question,
        "",
        "```",
        command,
        "```",
        "",
        f"Reproduce with the command above from the repository root (after `elastic-pretrain prepare-data "
        f"stdlib-code`). It trains every job of `jobs/experiments/{e.name}/` in one process, one after the other "
        f"(a finished run whose config is unchanged is reused, also from another experiment), evaluates the final "
        f"checkpoints and rewrites this page, `{png}` and `{e.name}.json` (all numbers).",
        "",
        "## Setup",
        "",
        (
            f"- **Seed** {seeds[0]} in every job (initialisation, data order, depth draws): all jobs see the same "
            "training sequences in the same order."
            if len(seeds) == 1
            else f"- **Seeds** {', '.join(map(str, seeds))}, one per job (initialisation, data order, depth draws): "
            "what this experiment varies."
        ),
        f"- **Training tokens** {', '.join(f'{t:,}' for t in tokens)} per job ({runs[0].steps} steps x "
        f"{first.train.global_batch_size} sequences x {first.data.seq_len} tokens), byte-level CPython standard "
        f"library (`data: stdlib-code`), one process (`parallel: single`).",
        "- **Held-out tokens**: "
        + (
            findings.held_out
            or f"the first {ctx.eval_sequences} sequences of the validation split "
            f"({ctx.eval_sequences * first.data.seq_len:,} predicted tokens, files never trained on)"
        )
        + "; losses are cross-entropy in nats/token over the real 257-token vocabulary.",
        "- **Scale and noise**: far smaller and shorter than a real run (hidden 64, a few hundred thousand "
        "parameters, minutes on 2 CPU cores), one seed per job. How far the same job lands with other seeds, per "
        "ℓ: [seed-noise.md](seed-noise.md).",
    ]
    if ctx.quick:
        lines.append("- **--quick**: a smoke test of the pipeline (2 steps per job); the numbers mean nothing.")
    diff = job_diff([r.job for r in runs])
    lines += [
        "",
        "| job | file | parameters | FLOPs/token at L_max | L_max | steps | tokens | mean passes in training "
        "| training FLOPs | train time | run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.name} | `{r.job_path}` | {parameters(ctx, r):,} | {max_flops(r):,.0f} | {r.job.model.max_loops} "
            f"| {r.steps} | {r.tokens:,} | {training_compute(r)[0]:.2f} | {training_compute(r)[1]:.3g} "
            f"| {r.summary['elapsed_s']:.0f} s | {_status(r)} |"
        )
    lines += [
        "",
        "Training FLOPs = 3 x forward matmul FLOPs (docs/evaluation.md) summed over the training tokens at "
        "each micro-batch's depth (replayed from the seed), plus a coda and output layer per extra supervised "
        "exit: same tokens does not mean same training compute when depth is sampled.",
    ]
    lines += ["", "Jobs differ only in: " + (", ".join(f"`{k}`" for k in diff) or "nothing") + "."]
    if findings.method:
        lines += ["", "## Method", "", *[f"- {m}" for m in findings.method]]
    lines += ["", "## Results", ""]
    for table in findings.tables:
        lines += [table.rstrip(), ""]
    reading = list(findings.reading)
    flops = {r.name: training_compute(r)[1] for r in runs}
    ref = runs[0].name
    if max(flops.values()) > 1.01 * min(flops.values()):
        reading.append(
            f"Training compute differs (same tokens, different depth): training FLOPs relative to {ref}: "
            + ", ".join(f"{n} x{f / flops[ref]:.2f}" for n, f in flops.items() if n != ref)
            + "."
        )
    lines += [f"![{e.name}]({png})", "", "## Reading", "", *[f"- {s}" for s in reading], ""]
    return "\n".join(lines)
