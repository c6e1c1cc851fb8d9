"""The markdown report of an experiment (``<out>/<name>.md``), its plot and its numbers as JSON.

Every report opens with the claim table (the papers' claims, decided over the seeds by
:mod:`~elastic_pretrain.experiments.stats`), then how it was made (command, wall time, tokens trained),
the seed noise of every arm and metric, the setup, and the first seed's detailed tables and plot."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.experiments.measure import max_flops, parameters, training_compute
from elastic_pretrain.experiments.present import claim_table, noise_table
from elastic_pretrain.experiments.runner import (
    Context,
    Experiment,
    Findings,
    Run,
    check_runs_root,
    ensure_trained,
    job_diff,
    load_jobs,
    load_post_training,
    processes,
    seeds_of,
)
from elastic_pretrain.experiments.stats import ClaimResult, Metrics, evaluate
from elastic_pretrain.files import ensure_dir, write_atomic
from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
from elastic_pretrain.provenance import UNRECORDED, code_label, code_version, mixed_code_note


@dataclasses.dataclass(frozen=True)
class Outcome:
    """An experiment over its seeds: the findings per seed, the claims decided, what it cost."""

    experiment: Experiment
    runs: list[Run]  # every (arm, seed), seed-major
    findings: dict[int, Findings]  # seed -> that seed's findings
    claims: list[ClaimResult]
    command: str
    quick: bool
    scale: int
    wall_s: float  # the command's wall time for this experiment (training included)
    train_wall_s: float  # of which: training (or finding) the runs

    @property
    def seeds(self) -> list[int]:
        return list(self.findings)

    @property
    def tokens_trained(self) -> int:
        """Tokens trained by this command (runs reused from earlier commands not counted)."""
        return sum(r.tokens for r in self.runs if r.status != "reused")


def run_experiment(
    experiment: Experiment,
    *,
    runs_root: Path,
    out_dir: Path,
    overrides: list[str],
    quick: bool,
    command: str,
    seeds: str | None = None,
    scale: int = 1,
    tokens_per_param: float | None = None,
) -> Path:
    """Train or reuse every (job, seed), analyse each seed, decide the claims over the seeds, write
    ``<out_dir>/<name>.{md,png,json}``; returns the .md path. ``seeds``: runner.parse_seeds."""
    t0 = time.perf_counter()
    jobs = load_jobs(experiment.name, runs_root, overrides, seeds=seeds, scale=scale,
                     tokens_per_param=tokens_per_param)  # config errors first  # fmt: skip
    check_runs_root(runs_root)
    runs: list[Run] = []
    for path, seed, job in jobs:
        job = job or load_post_training(path, experiment.name, runs_root, overrides, runs, seed=seed, scale=scale,
                                        tokens_per_param=tokens_per_param)  # fmt: skip
        runs.append(ensure_trained(path, job, runs_root))
    train_wall = time.perf_counter() - t0
    init_mesh(ParallelConfig(), seed=0)  # one process, for loading and evaluating the checkpoints
    try:
        contexts = {s: Context(experiment, [r for r in runs if r.seed == s], quick=quick) for s in seeds_of(runs)}
        findings = {}
        for s, ctx in contexts.items():
            findings[s] = experiment.analyse(ctx)
            if s != runs[0].seed:
                ctx.forget_models()  # the first seed's models stay for the setup table
        metrics = {s: f.metrics for s, f in findings.items()}
        claims = [evaluate(c, metrics) for c in experiment.claims]
        wall = time.perf_counter() - t0
        outcome = Outcome(experiment, runs, findings, claims, command, quick, scale, wall, train_wall)
        md = write_report(out_dir, contexts[runs[0].seed], outcome)
    finally:
        teardown()
    print(f"written: {md}, {md.with_suffix('.png')}, {md.with_suffix('.json')}", flush=True)
    return md


def write_report(out_dir: Path, first: Context, o: Outcome) -> Path:
    """``<out_dir>/<name>.{png,md,json}`` of an outcome (``first``: the first seed's context); the .md path."""
    ensure_dir(out_dir, root=out_dir)
    png = out_dir / f"{o.experiment.name}.png"
    o.findings[o.seeds[0]].plot(png)
    md = out_dir / f"{o.experiment.name}.md"
    write_atomic(md, render(first, o, png=png.name), root=out_dir)
    write_atomic(md.with_suffix(".json"), json.dumps(numbers(first, o), indent=1) + "\n", root=out_dir)
    return md


def numbers(ctx: Context, o: Outcome) -> dict[str, Any]:
    """Every number of the report: the run rows, the claims with their per-seed values, each seed's numbers."""
    first = o.findings[o.seeds[0]]
    return {
        "experiment": o.experiment.name,
        "command": o.command,
        "quick": o.quick,
        "scale": o.scale,
        "seeds": o.seeds,
        "wall_s": o.wall_s,
        "train_wall_s": o.train_wall_s,
        "tokens_trained": o.tokens_trained,
        "runs": [_run_row(ctx, r) for r in o.runs],
        "claims": claim_rows(o.claims),
        "metrics_by_seed": {str(s): f.metrics for s, f in o.findings.items()},
        **first.numbers,  # the first seed's detail, as in the report's tables
        "numbers_by_seed": {str(s): f.numbers for s, f in o.findings.items()},
    }


def claim_rows(claims: list[ClaimResult]) -> list[dict[str, Any]]:
    """The claims as the JSON report holds them: the claim, its kind and premise, per-seed values, verdict."""
    return [
        {
            "paper": c.claim.paper,
            "measure": c.claim.measure,
            "expect": c.claim.expect,
            "kind": c.claim.kind,
            "comparable": c.claim.comparable,
            "premise": c.premise and {"measure": c.premise.claim.measure, "verdict": c.premise.verdict},
            "values": list(c.values),
            "interval": dataclasses.asdict(c.interval) if c.interval else None,
            "verdict": c.verdict,
            "reason": c.reason,
        }
        for c in claims
    ]


def _run_row(ctx: Context, r: Run) -> dict[str, Any]:
    return {
        "job": r.name,
        "seed": r.seed,
        "file": str(r.job_path),
        "run_dir": str(r.run_dir),
        "status": r.status,
        "steps": r.steps,
        "tokens": r.tokens,
        "parameters": parameters(ctx, r),
        "flops_per_token_at_max_loops": max_flops(r),
        "max_loops": r.job.model.max_loops,
        "train_seconds": r.summary["elapsed_s"],
        "code": code_label(r.summary),
    }


def _status(run: Run) -> str:
    own = run.run_dir.resolve() == run.job.run_path.resolve()
    return run.status if own else f"{run.status}: `{run.run_dir}` (same config)"


def _how(o: Outcome, png: str) -> list[str]:
    e = o.experiment
    return [
        "## How this report was made",
        "",
        "```",
        o.command,
        "```",
        "",
        f"- **Wall time** {o.wall_s:,.0f} s for this experiment (training or finding the runs {o.train_wall_s:,.0f} "
        f"s of it, evaluation the rest); **tokens "
        f"trained** {o.tokens_trained:,} by this command ({sum(r.tokens for r in o.runs):,} in the "
        f"{len(o.runs)} runs the report reads; a reused run was trained by an earlier command).",
        f"- **Seeds** {', '.join(map(str, o.seeds))} for every arm (initialisation, data order, depth draws): the "
        "arms of one seed are paired.",
        f"- Reproduce with the command above from the repository root (after `elastic-pretrain prepare-data "
        f"{_recipe(o.runs[0].job.data)}`). It trains every job of `jobs/experiments/{e.name}/` once per seed, "
        "one after the other, "
        f"{_processes(o.runs)} (a finished run whose config is unchanged is reused, also from another experiment), "
        f"evaluates the final checkpoints and rewrites this page, `{png}` and `{e.name}.json` (all numbers).",
        _code(o.runs),
    ]


def _code(runs: list[Run]) -> str:
    """The code the runs were trained with (``summary.json``'s ``code``): one version, or how many."""
    labels = [code_label(r.summary) for r in runs]
    note = mixed_code_note(r.summary for r in runs)
    if note is not None:
        return f"- {note} The code of each run is in the table under Setup."
    if labels[0] == UNRECORDED:
        return "- **Code**: not recorded (the runs were trained before `summary.json` recorded its code)."
    if labels[0] == "unknown":
        return "- **Code**: unknown (the runs were trained outside a git checkout)."
    return (
        f"- **Code**: every run was trained by one version of the code ({code_version(runs[0].summary)}: commits "
        + ", ".join(f"`{label}`" for label in sorted(set(labels)))
        + "; `+`: with uncommitted changes)."
    )


def _recipe(data: DataConfig) -> str:
    """The data recipe a job trains on, by the name of the directory its shards are prepared into."""
    return Path(data.prepare.output).name if data.prepare else Path(data.streams[0].path).name


def _corpus(data: DataConfig) -> str:
    """The training corpus in words, e.g. ``byte-level CPython standard library (`data: stdlib-code`)``."""
    prep = data.prepare
    if prep is not None and prep.synthetic is not None:
        return (f"synthetic {prep.synthetic.task} text generated from seed {prep.seed}, byte-level, a difficulty per "
                f"token (`data: {_recipe(data)}`, docs/data.md)")  # fmt: skip
    if prep is not None and prep.source == "stdlib":
        return f"byte-level CPython standard library (`data: {_recipe(data)}`)"
    return f"`data: {_recipe(data)}`"


def _layouts(runs: list[Run]) -> str:
    """The layouts the runs trained with (``summary.json``), e.g. ``one process (`parallel: single`)``."""
    seen: dict[str, list[str]] = {}
    for r in runs:
        lay = r.summary.get("layout") or {"world_size": 1}
        text = (
            "one process (`parallel: single`)"
            if int(lay["world_size"]) == 1
            else f"{lay['world_size']} processes (TP {lay['tp']} x PP {lay['pp']} x DP {lay['dp']}, EP {lay['ep']})"
        )
        seen.setdefault(text, [])
        if r.name not in seen[text]:
            seen[text].append(r.name)
    if len(seen) == 1:
        return next(iter(seen))
    return "; ".join(f"{text}: {', '.join(names)}" for text, names in seen.items())


def _processes(runs: list[Run]) -> str:
    n = sorted({processes(r.job) for r in runs})
    if n == [1]:
        return "in one process"
    return (
        "each in the processes its `slurm.nproc_per_node` names "
        f"({', '.join(map(str, n))}; `elastic-pretrain train --nproc-per-node`'s launcher)"
    )


def _setup(ctx: Context, o: Outcome) -> list[str]:
    runs, first = o.runs, o.runs[0].job
    tokens = sorted({r.tokens for r in runs})
    m = first.model
    lines = [
        "## Setup",
        "",
        f"- **Training tokens** {', '.join(f'{t:,}' for t in tokens)} per run ({runs[0].steps} steps x "
        f"{first.train.global_batch_size} sequences x {first.data.seq_len} tokens), {_corpus(first.data)}, "
        f"{_layouts(runs)}.",
        "- **Held-out tokens**: "
        + (
            o.findings[o.seeds[0]].held_out
            or f"the first {ctx.eval_sequences} sequences of the validation split "
            f"({ctx.eval_sequences * first.data.seq_len:,} predicted tokens, files never trained on)"
        )
        + "; losses are cross-entropy in nats/token over the real 257-token vocabulary.",
        f"- **Scale** {o.scale} (`--scale`): hidden {m.hidden_size}, "
        f"{parameters(ctx, runs[0]):,} parameters in {runs[0].name} — far smaller and shorter than the papers' "
        "runs; a claim not resolved here may resolve at a larger `--scale` (docs/experiments.md).",
    ]
    if o.quick:
        lines.append("- **--quick**: a smoke test of the pipeline (2 steps per job); the numbers mean nothing.")
    lines += [
        "",
        "| job | seed | file | parameters | FLOPs/token at L_max | L_max | steps | tokens | mean passes in training "
        "| training FLOPs | train time | code | run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        passes, flops = training_compute(r)
        lines.append(
            f"| {r.name} | {r.seed} | `{r.job_path}` | {parameters(ctx, ctx.run(r.name)):,} | {max_flops(r):,.0f} "
            f"| {r.job.model.max_loops} | {r.steps} | {r.tokens:,} | {passes:.2f} | {flops:.3g} "
            f"| {r.summary['elapsed_s']:.0f} s | `{code_label(r.summary)}` | {_status(r)} |"
        )
    diff = [k for k in job_diff([r.job for r in runs]) if k not in ("train.seed",)]
    lines += [
        "",
        "Training FLOPs = 3 x forward matmul FLOPs (docs/evaluation.md) summed over the training tokens at "
        "each micro-batch's depth (replayed from the seed), plus a coda and output layer per extra supervised "
        "exit: same tokens does not mean same training compute when depth is sampled.",
        "",
        "Jobs differ (besides the seed) only in: " + (", ".join(f"`{k}`" for k in diff) or "nothing") + ".",
    ]
    return lines


def heading(e: Experiment) -> list[str]:
    """The title and question a report opens with (``--from-json`` rewrites them too)."""
    return [f"# {e.title}", "", e.question, ""]


def claims_section(claims: list[ClaimResult]) -> list[str]:
    """The report's claim table (``--from-json`` rewrites exactly this section and :func:`noise_section`)."""
    return ["## Claims", "", claim_table(claims), ""]


def noise_section(by_seed: dict[int, Metrics]) -> list[str]:
    return [
        "## Seed noise",
        "",
        "Every metric the claims and the reading use, per arm, over the seeds (std = the seed noise of that "
        "arm; the interval is of the arm's own mean, not of a difference).",
        "",
        noise_table(by_seed),
        "",
    ]


def render(ctx: Context, o: Outcome, *, png: str) -> str:
    """The report; ``ctx`` is the first seed's context (its models give the parameter counts)."""
    e, seed = o.experiment, o.seeds[0]
    findings = o.findings[seed]
    lines = [*heading(e), *claims_section(o.claims)]
    lines += [*_how(o, png), ""]
    lines += noise_section({s: f.metrics for s, f in o.findings.items()})
    lines += [*_setup(ctx, o), ""]
    if findings.method:
        lines += ["## Method", "", *[f"- {m}" for m in findings.method], ""]
    lines += [f"## Results of seed {seed}", ""]
    if len(o.seeds) > 1:
        lines += [f"One seed's tables and plot ({seed}; every seed's numbers are in `{e.name}.json`).", ""]
    for table in findings.tables:
        lines += [table.rstrip(), ""]
    reading = list(findings.reading)
    flops = {r.name: training_compute(r)[1] for r in ctx.runs}
    ref = ctx.runs[0].name
    if max(flops.values()) > 1.01 * min(flops.values()):
        reading.append(
            f"Training compute differs (same tokens, different depth): training FLOPs relative to {ref}: "
            + ", ".join(f"{n} x{f / flops[ref]:.2f}" for n, f in flops.items() if n != ref)
            + "."
        )
    lines += [f"![{e.name}]({png})", "", f"## Reading of seed {seed}", ""]
    lines += [
        "One seed's numbers: a difference or ranking here is a direction only where the claim table above resolves it.",
        "",
        *[f"- {s}" for s in reading],
        "",
    ]
    return "\n".join(lines)
