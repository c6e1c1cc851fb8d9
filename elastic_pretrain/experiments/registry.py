"""The experiments: each an analysis of the trained runs of ``jobs/experiments/<name>/``.

An analysis receives a :class:`~elastic_pretrain.experiments.runner.Context` (runs in job-file order,
their final checkpoints as models, held-out tokens) and returns tables, a plot, the raw numbers and a
reading generated *from* the numbers (so a rerun with other numbers says what those show). To add an
experiment: a job set under ``jobs/experiments/<name>/``, an ``analyse`` function, a line in
:data:`EXPERIMENTS`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elastic_pretrain.errors import UserError
from elastic_pretrain.eval.quality import (
    CurvePoint,
    QualityCurve,
    compare,
    evaluate_loops,
    flops_per_token,
    plot,
    quality_curve,
)
from elastic_pretrain.experiments.report import parameters
from elastic_pretrain.experiments.runner import Context, Experiment, Findings, Run


def losses(ctx: Context, run: Run, loops: list[int] | None = None) -> dict[int, float]:
    """Held-out loss at each ℓ (default 1..L_max) of the run's final checkpoint."""
    return {ell: e.loss for ell, e in evaluate_loops(ctx.model(run.name), ctx.val_tokens(), loops).items()}


def _flops(run: Run, loops: float) -> float:
    return flops_per_token(run.job.model, loops, seq_len=run.job.data.seq_len)


def _pct(a: float, b: float) -> str:
    return f"{(a - b) / b:+.1%}"


def _ranked(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(values.items(), key=lambda kv: kv[1]))


def _figure(path: Path, draw: Callable[[Any], None], *, panels: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.6), dpi=100)
    try:
        draw(axes)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------------
# 1. exit schedules: telescopic / mixed depth / fixed exits / fixed depth on the same tokens
def exit_schedules(ctx: Context) -> Findings:
    tokens = ctx.val_tokens()
    curves = [quality_curve(ctx.model(r.name), tokens, name=r.name) for r in ctx.runs]
    cmp = compare(curves)
    max_loops = ctx.runs[0].job.model.max_loops
    by = {c.name: {int(p.loops): p.loss for p in c.points} for c in curves}
    head = "| job | sampler | " + " | ".join(f"loss ℓ={ell}" for ell in range(1, max_loops + 1))
    rows = [head + f" | AUC | AUC vs {cmp.names[0]} |", "|---|---|" + "---|" * (max_loops + 2)]
    for run, c, a, rel in zip(ctx.runs, curves, cmp.aucs, cmp.relative, strict=True):
        cells = " | ".join(f"{by[c.name][ell]:.4f}" for ell in range(1, max_loops + 1))
        rows.append(f"| {c.name} | {_sampler(run)} | {cells} | {a:.4f} | {rel:+.2%} |")
    compute = " | ".join(f"{p.relative_compute:.3f}" for p in curves[0].points)
    rows += [
        "",
        "Relative compute FLOPs(ℓ)/FLOPs(L_max) of ℓ = 1.."
        + f"{max_loops}: {compute}. "
        + f"AUC = compute-averaged loss over [{cmp.lo:.3f}, {cmp.hi:.3f}] (lower is better).",
    ]
    aucs = dict(zip(cmp.names, cmp.aucs, strict=True))
    best = min(aucs, key=aucs.__getitem__)
    deepest = {n: by[n][max_loops] for n in by}
    shallow = {n: by[n][1] for n in by}
    reading = [
        f"AUC, lowest first: {_ranked(aucs)}; {best} has the lowest compute-averaged loss.",
        f"At ℓ = 1 (the cheapest exit): {_ranked(shallow)}.",
        f"At ℓ = L_max = {max_loops} (full depth): {_ranked(deepest)}.",
    ]
    ref = cmp.names[0]
    others = [n for n in by if n != ref]
    if others:
        reading.append(
            f"Loss minus {ref}'s (sampler {_sampler(ctx.run(ref))}) at ℓ = {max_loops}: "
            + ", ".join(f"{n} {deepest[n] - deepest[ref]:+.4f}" for n in others)
            + "; at ℓ = 1: "
            + ", ".join(f"{n} {shallow[n] - shallow[ref]:+.4f}" for n in others)
            + "."
        )
    return Findings(
        tables=["\n".join(rows)],
        reading=reading,
        numbers={
            "loss_by_loops": by,
            "auc": aucs,
            "auc_vs_first": dict(zip(cmp.names, cmp.relative, strict=True)),
            "auc_range": [cmp.lo, cmp.hi],
        },
        plot=lambda path: plot(curves, path, title="held-out loss vs compute per exit schedule (same tokens, seed)"),
        method=[
            "Every ℓ is evaluated on the same held-out tokens; a model with the loop-count conditioning on "
            "(mixed-scratch) runs each ℓ separately, conditioned on that ℓ; the others read every exit off one "
            "ℓ = L_max forward (their exits are prefixes of it).",
        ],
    )


def _sampler(run: Run) -> str:
    s = run.job.schedule
    extra = f" {s.exits}" if s.sampler == "fixed_exits" else ""
    return f"{s.sampler}{extra}" + (f", switch at {s.switch_at:g}" if 0 < s.switch_at < 1 else "")


# ---------------------------------------------------------------------------------------------------
# 2. late switch vs mixed from scratch vs a non-looped model of equal parameters
def late_switch(ctx: Context) -> Findings:
    ref = ctx.runs[0]
    fmax = _flops(ref, ref.job.model.max_loops)
    loss = {r.name: losses(ctx, r) for r in ctx.runs}
    rows = [
        "| job | parameters | loss ℓ=1 | FLOPs/token ℓ=1 | loss ℓ=L_max | FLOPs/token ℓ=L_max | L_max |",
        "|---|---|---|---|---|---|---|",
    ]
    curves = []
    for r in ctx.runs:
        top = r.job.model.max_loops
        one = f"{loss[r.name][1]:.4f} | {_flops(r, 1):,.0f}" if top > 1 else "– | –"
        rows.append(
            f"| {r.name} | {parameters(ctx, r):,} | {one} | {loss[r.name][top]:.4f} | {_flops(r, top):,.0f} | {top} |"
        )
        points = tuple(
            CurvePoint(loops=ell, relative_compute=_flops(r, ell) / fmax, loss=v) for ell, v in loss[r.name].items()
        )
        curves.append(QualityCurve(name=r.name, points=points, flops_max=fmax))
    looped = [r for r in ctx.runs if r.job.model.max_loops > 1]
    flat = [r for r in ctx.runs if r.job.model.max_loops == 1]
    deep = {r.name: loss[r.name][r.job.model.max_loops] for r in ctx.runs}
    top_flops = [_flops(r, r.job.model.max_loops) for r in ctx.runs]
    spread = (max(top_flops) - min(top_flops)) / max(top_flops)
    reading = [f"Loss at full depth (FLOPs per token equal within {spread:.1%}), lowest first: {_ranked(deep)}."]
    if looped:
        reading.append("Loss at ℓ = 1: " + _ranked({r.name: loss[r.name][1] for r in looped}) + ".")
    if len(looped) >= 2:
        a, b = looped[0], looped[1]
        reading.append(
            f"{a.name} minus {b.name}: {loss[a.name][1] - loss[b.name][1]:+.4f} nats at ℓ = 1, "
            f"{deep[a.name] - deep[b.name]:+.4f} at ℓ = L_max."
        )
    for f in flat:
        for r in looped:
            top, shallow = r.job.model.max_loops, _pct(loss[r.name][1], deep[f.name])
            reading.append(
                f"{f.name} ({parameters(ctx, f):,} parameters) minus {r.name} ({parameters(ctx, r):,}): "
                f"{deep[f.name] - deep[r.name]:+.4f} nats at full depth; {r.name} at ℓ = 1 costs "
                f"{_flops(r, 1) / _flops(f, 1):.0%} of {f.name}'s FLOPs per token at {shallow} loss relative to "
                f"{f.name} (ℓ = {top}: {_pct(deep[r.name], deep[f.name])})."
            )
    return Findings(
        tables=["\n".join(rows)],
        reading=reading,
        numbers={
            "loss_by_loops": loss,
            "flops_per_token": {r.name: {ell: _flops(r, ell) for ell in loss[r.name]} for r in ctx.runs},
        },
        plot=lambda path: plot(curves, path, title=f"held-out loss vs FLOPs/token (relative to {ref.name} at L_max)"),
        method=[
            "Parameters and compute of the non-looped job: the looped jobs have 4 attention blocks (one per pass) "
            "and one MoE layer of 8 experts run 4 times top-2; the non-looped job has 4 layers of 2 experts run "
            "once top-2 — the same attention and expert parameters and the same 4 x 2 expert calls per token. What "
            "differs: the looped jobs' loop-count conditioning head and their one pre-MLP norm (vs 4); router "
            "FLOPs (a router over 8 experts 4 times vs over 2 experts 4 times). Both are in the table.",
            "The non-looped model has one depth, so its only loss is at ℓ = L_max = 1.",
        ],
    )


# ---------------------------------------------------------------------------------------------------
# 3. flattening series with and without untied attention
ROUTING_STATS = ("confidence", "load_cv", "maxvio", "entropy")


@torch.no_grad()
def held_out_routing(ctx: Context, run: Run) -> dict[str, float]:
    """Routing health on held-out tokens at ℓ = L_max, averaged over every (layer, pass) router call."""
    from elastic_pretrain.train.step import reduce_routing

    net = ctx.model(run.name)
    tokens = ctx.val_tokens()
    net.start_routing_probe()
    try:
        for start in range(0, tokens.shape[0], 8):
            net(tokens[start : start + 8, :-1], loops=net.cfg.max_loops)
    finally:
        probe = net.stop_routing_probe()
    stats = reduce_routing(probe)
    return {s: statistics.fmean(v[s] for v in stats.values()) for s in ROUTING_STATS}


def flattening(ctx: Context) -> Findings:
    rows = [
        "| job | flatten | attention | layers x experts x passes | parameters | expert parameters | "
        "FLOPs/token | loss | confidence | load CV | MaxVio | entropy | entropy / ln E |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    numbers: dict[str, Any] = {}
    for r in ctx.runs:
        m = r.job.model
        net = ctx.model(r.name)
        experts = sum(p.numel() for n, p in net.named_parameters() if ".experts." in n)
        loss = losses(ctx, r, [m.max_loops])[m.max_loops]
        routing = held_out_routing(ctx, r)
        routing["entropy_norm"] = routing["entropy"] / math.log(m.experts_built)  # 1 = uniform over the E experts
        numbers[r.name] = {
            "flatten": m.flatten,
            "attention": m.attention,
            "experts": m.experts_built,
            "parameters": parameters(ctx, r),
            "expert_parameters": experts,
            "flops_per_token": _flops(r, m.max_loops),
            "loss": loss,
            **routing,
        }
        rows.append(
            f"| {r.name} | {m.flatten} | {m.attention} | {m.core_layers_built} x {m.experts_built} x {m.max_loops} "
            f"| {parameters(ctx, r):,} | {experts:,} | {_flops(r, m.max_loops):,.0f} | {loss:.4f} | "
            + " | ".join(f"{routing[s]:.3f}" for s in (*ROUTING_STATS, "entropy_norm"))
            + " |"
        )
    reading = [f"Final held-out loss, lowest first: {_ranked({n: v['loss'] for n, v in numbers.items()})}."]
    for att in ("untied", "tied"):
        series = sorted((v["flatten"], n) for n, v in numbers.items() if v["attention"] == att or v["flatten"] == 1)
        if len(series) > 1:
            reading.append(
                f"{att} attention, flatten "
                + " → ".join(str(f) for f, _ in series)
                + ": loss "
                + " → ".join(f"{numbers[n]['loss']:.4f}" for _, n in series)
                + ", confidence "
                + " → ".join(f"{numbers[n]['confidence']:.3f}" for _, n in series)
                + " (uniform: "
                + " → ".join(f"{1 / numbers[n]['experts']:.3f}" for _, n in series)
                + "), entropy / ln E "
                + " → ".join(f"{numbers[n]['entropy_norm']:.3f}" for _, n in series)
                + ", load CV "
                + " → ".join(f"{numbers[n]['load_cv']:.3f}" for _, n in series)
                + "."
            )
    for v in numbers.values():
        twin = next(
            (
                m
                for m, w in numbers.items()
                if w["flatten"] == v["flatten"] and w["attention"] == "untied" and v["attention"] == "tied"
            ),
            None,
        )
        if twin:
            reading.append(
                f"flatten {v['flatten']}: tied attention ({v['parameters']:,} parameters) minus untied "
                f"({numbers[twin]['parameters']:,}): {v['loss'] - numbers[twin]['loss']:+.4f} nats."
            )

    def draw(axes: Any) -> None:
        names = list(numbers)
        axes[0].bar(range(len(names)), [numbers[n]["loss"] for n in names], color="tab:blue")
        axes[0].set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
        lo = min(numbers[n]["loss"] for n in names)
        axes[0].set_ylim(lo - 0.1, max(numbers[n]["loss"] for n in names) + 0.05)
        axes[0].set_ylabel("held-out loss at L_max (nats/token)")
        for n in names:
            axes[1].scatter(numbers[n]["load_cv"], numbers[n]["confidence"], marker="o" if "untied" in n else "s")
            axes[1].annotate(
                n,
                (numbers[n]["load_cv"], numbers[n]["confidence"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        axes[1].set_xlabel("load CV (0 = balanced)")
        axes[1].set_ylabel("routing confidence (mean max prob)")
        for ax in axes:
            ax.grid(alpha=0.3)

    return Findings(
        tables=["\n".join(rows)],
        reading=reading,
        numbers={"runs": numbers},
        plot=lambda path: _figure(path, draw, panels=2),
        method=[
            "Reference shape 4 core layers x 4 experts (width 64, top-2) x 1 loop; flatten f builds 4/f layers of "
            "4f experts run f times. Expert parameters (16 experts) and active expert compute (4 x top-2 per token) "
            "are equal for every f (the table shows both); untied attention keeps one attention block per (layer, "
            "pass), i.e. 4 for every f, tied attention has 4/f (fewer parameters, the same attention compute). "
            "FLOPs differ only by the router (2·D·E per call, E = 4f).",
            "Routing health is measured on the held-out tokens at ℓ = L_max with the final weights, averaged over "
            "every (layer, pass) router call: confidence = mean top-1 probability, load CV = std/mean of the tokens "
            "per expert (0 = balanced), MaxVio = max load / mean load − 1, entropy of the router distribution and "
            "entropy / ln E (1 = uniform). With more experts per layer the top-1 probability falls even at the same "
            "sharpness (uniform = 1/E), so compare confidence with 1/E and the normalised entropy.",
        ],
    )


# ---------------------------------------------------------------------------------------------------
# 4. route replay on/off: step time and loss
def _fwd_bwd(net: Any, inputs: torch.Tensor, labels: torch.Tensor, loops: int) -> Callable[[], None]:
    def run() -> None:
        net.zero_grad(set_to_none=True)
        out = net(inputs, labels=labels, loops=loops)
        out[loops].mean().backward()

    return run


def interleaved_times(fns: dict[Any, Callable[[], None]], repeats: int) -> dict[Any, list[float]]:
    """Seconds of each call of each function, called alternately in this process (after one warm-up each)."""
    for fn in fns.values():
        fn()
    samples: dict[Any, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def route_replay(ctx: Context) -> Findings:
    off, on = ctx.run("replay-off"), ctx.run("replay-on")
    max_loops = off.job.model.max_loops
    loss = {r.name: losses(ctx, r) for r in (off, on)}
    batch = ctx.val_tokens()[: off.job.train.micro_batch_size]
    inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    repeats = 2 if ctx.quick else 20
    ells = sorted({1, 2, max_loops})
    for r in (off, on):
        ctx.model(r.name).train()
    try:  # every (ℓ, model) in one interleaved loop: a change of load on the machine hits all of them alike
        fns = {(ell, r.name): _fwd_bwd(ctx.model(r.name), inputs, labels, ell) for ell in ells for r in (off, on)}
        flat = interleaved_times(fns, repeats)
    finally:
        for r in (off, on):
            ctx.model(r.name).zero_grad(set_to_none=True)
            ctx.model(r.name).eval()
    rows = [
        "| job | " + " | ".join(f"loss ℓ={ell}" for ell in range(1, max_loops + 1)) + " |",
        "|---|" + "---|" * max_loops,
    ]
    for r in (off, on):
        rows.append(f"| {r.name} | " + " | ".join(f"{loss[r.name][ell]:.4f}" for ell in range(1, max_loops + 1)) + " |")
    samples = {ell: {r.name: flat[(ell, r.name)] for r in (off, on)} for ell in ells}
    times = {ell: {k: statistics.median(v) for k, v in t.items()} for ell, t in samples.items()}
    # each replay-on call against the replay-off call just before it (same moment, same load)
    paired = {
        ell: statistics.median(a / b for a, b in zip(t[on.name], t[off.name], strict=True))
        for ell, t in samples.items()
    }
    trows = ["| measurement | replay-off | replay-on | on/off (median of paired ratios) |", "|---|---|---|---|"]
    for ell, t in times.items():
        trows.append(
            f"| fwd+bwd ℓ={ell}, {batch.shape[0]}x{inputs.shape[1]} tokens, median of {repeats} "
            f"| {t[off.name] * 1e3:.1f} ms | {t[on.name] * 1e3:.1f} ms | {paired[ell]:.3f} |"
        )
    trows.append(
        f"| training, s/step over the whole run (separate runs) | {off.seconds_per_step:.3f} s | "
        f"{on.seconds_per_step:.3f} s | {on.seconds_per_step / off.seconds_per_step:.3f} (ratio of means) |"
    )
    ratio = paired[max_loops]
    reading = [
        f"Step time at ℓ = {max_loops}, measured alternately in one process: replay-on / replay-off = {ratio:.3f} "
        f"({'faster' if ratio < 1 else 'slower'} with replay); at ℓ = 1, where no pass is replayed, {paired[1]:.3f} "
        "(the noise floor of this measurement).",
        "Held-out loss, replay-on minus replay-off: "
        + ", ".join(f"ℓ={ell} {loss[on.name][ell] - loss[off.name][ell]:+.4f}" for ell in range(1, max_loops + 1))
        + " nats.",
    ]
    ells = list(range(1, max_loops + 1))

    def draw(axes: Any) -> None:
        for r in (off, on):
            axes[0].plot(ells, [loss[r.name][e] for e in ells], marker="o", label=r.name)
        axes[0].set_xlabel("loop count ℓ")
        axes[0].set_ylabel("held-out loss (nats/token)")
        axes[0].legend(fontsize=8)
        xs = list(times)
        axes[1].plot(xs, [paired[e] for e in xs], marker="o")
        axes[1].axhline(1.0, color="grey", lw=0.8)
        axes[1].set_xlabel("loop count ℓ")
        axes[1].set_ylabel("fwd+bwd time, replay-on / replay-off")
        for ax in axes:
            ax.grid(alpha=0.3)

    return Findings(
        tables=["\n".join(rows), "\n".join(trows)],
        reading=reading,
        numbers={
            "loss_by_loops": loss,
            "fwd_bwd_seconds": {str(ell): t for ell, t in samples.items()},
            "fwd_bwd_paired_ratio": paired,
            "train_seconds_per_step": {r.name: r.seconds_per_step for r in (off, on)},
        },
        plot=lambda path: _figure(path, draw, panels=2),
        method=[
            "Step time: forward + backward of one micro-batch of held-out tokens with each run's final weights, "
            "the two models and the loop counts alternating in this process (1 thread); the ratio is the median over "
            "the repeats of (replay-on call / the replay-off call just before it), the number to read "
            "(absolute times depend on the machine's load). The training s/step comes from two "
            "separate runs and includes the optimizer; it is noisier.",
        ],
    )


# ---------------------------------------------------------------------------------------------------
# 5. last-loop vs per-loop KV cache
def kv_cache(ctx: Context) -> Findings:
    from elastic_pretrain.model.inference import KV_POLICIES, teacher_forced_loss

    # last-loop decoding goes token by token: fewer sequences than elsewhere (and --quick: 32 positions only)
    n, length = (2, 32) if ctx.quick else (16, ctx.runs[0].job.data.seq_len)
    tokens = ctx.val_tokens(n)[:, : length + 1]
    rows = [
        "| job | ℓ | KV bytes/token per-loop | KV bytes/token last-loop | loss per-loop | loss last-loop | "
        "last − per |",
        "|---|---|---|---|---|---|---|",
    ]
    numbers: dict[str, Any] = {}
    for r in ctx.runs:
        model = ctx.model(r.name)
        numbers[r.name] = {}
        top = r.job.model.max_loops
        for ell in [top] if ctx.quick else range(2, top + 1):
            tf = {p: teacher_forced_loss(model, tokens, loops=ell, kv_cache=p, batch_size=n) for p in KV_POLICIES}
            numbers[r.name][ell] = {
                p: {"loss": t.loss, "kv_bytes_per_token": t.kv_bytes_per_token} for p, t in tf.items()
            }
            per, last = tf["per-loop"], tf["last-loop"]
            rows.append(
                f"| {r.name} | {ell} | {per.kv_bytes_per_token:,.0f} | {last.kv_bytes_per_token:,.0f} | "
                f"{per.loss:.4f} | {last.loss:.4f} | {last.loss - per.loss:+.4f} |"
            )
    reading = []
    for name, by in numbers.items():
        top = max(by)
        per, last = by[top]["per-loop"], by[top]["last-loop"]
        reading.append(
            f"{name} at ℓ = {top}: the last-loop cache holds "
            f"{last['kv_bytes_per_token'] / per['kv_bytes_per_token']:.0%} of the per-loop bytes per token and "
            f"changes the teacher-forced loss by {last['loss'] - per['loss']:+.4f} nats "
            f"({_pct(last['loss'], per['loss'])})."
        )

    def draw(ax: Any) -> None:
        for name, by in numbers.items():
            ells = sorted(by)
            for p, style in (("per-loop", "-o"), ("last-loop", "--s")):
                ax.plot(ells, [by[e][p]["loss"] for e in ells], style, label=f"{name}, {p}")
        ax.set_xlabel("loop count ℓ")
        ax.set_ylabel("teacher-forced held-out loss (nats/token)")
        ax.set_xticks(sorted({e for by in numbers.values() for e in by}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    return Findings(
        tables=["\n".join(rows)],
        reading=reading,
        numbers={"teacher_forced": numbers, "sequences": n, "predicted_tokens": n * (tokens.shape[1] - 1)},
        held_out=f"the first {n} sequences of the validation split, {tokens.shape[1] - 1} positions each "
        f"({n * (tokens.shape[1] - 1):,} predicted tokens, files never trained on)",
        plot=lambda path: _figure(path, draw),
        method=[
            f"Teacher-forced loss of the first {n} held-out sequences ({n * (tokens.shape[1] - 1):,} predicted "
            "tokens; fewer than in the other experiments because last-loop decoding goes token by token) at each "
            "ℓ ≥ 2 (at ℓ = 1 the policies are the same). per-loop: every pass keeps its own keys/values (exactly "
            "the model's forward); last-loop: only the last pass's keys/values are cached and every pass of a "
            "later token attends to them (docs/evaluation.md). Bytes per token are those the cache holds.",
        ],
    )


# ---------------------------------------------------------------------------------------------------
# 6. seed noise: the same job with three seeds (how large a difference the other reports can resolve)
def seed_noise(ctx: Context) -> Findings:
    tokens = ctx.val_tokens()
    curves = [quality_curve(ctx.model(r.name), tokens, name=r.name) for r in ctx.runs]
    max_loops = ctx.runs[0].job.model.max_loops
    ells = list(range(1, max_loops + 1))
    by = {c.name: {int(p.loops): p.loss for p in c.points} for c in curves}
    aucs = {c.name: c.auc for c in curves}
    rows = [
        "| job | seed | " + " | ".join(f"loss ℓ={ell}" for ell in ells) + " | AUC |",
        "|---|---|" + "---|" * (len(ells) + 1),
    ]
    for r, c in zip(ctx.runs, curves, strict=True):
        rows.append(
            f"| {r.name} | {r.job.train.seed} | "
            + " | ".join(f"{by[c.name][e]:.4f}" for e in ells)
            + f" | {c.auc:.4f} |"
        )
    spread = {e: max(v[e] for v in by.values()) - min(v[e] for v in by.values()) for e in ells}
    std = {e: statistics.stdev(v[e] for v in by.values()) if len(by) > 1 else 0.0 for e in ells}
    auc_spread = max(aucs.values()) - min(aucs.values())
    rows.append("| max − min | | " + " | ".join(f"{spread[e]:.4f}" for e in ells) + f" | {auc_spread:.4f} |")
    rows.append("| std | | " + " | ".join(f"{std[e]:.4f}" for e in ells) + " | |")
    anchor = ctx.runs[0].job.schedule.loops or max_loops
    reading = [
        f"Spread (max − min) of the held-out loss across {len(by)} seeds: "
        + ", ".join(f"ℓ={e} {spread[e]:.4f}" for e in ells)
        + f" nats; AUC {auc_spread:.4f}.",
        f"The seeds agree most at ℓ = {min(spread, key=spread.__getitem__)} and least at ℓ = "
        f"{max(spread, key=spread.__getitem__)}; the jobs are trained at ℓ = {anchor} only.",
        "A difference between two one-seed jobs in the other reports is resolved only if it is well above this "
        "spread at the same ℓ (measured for this job only; other schedules may be noisier).",
    ]
    return Findings(
        tables=["\n".join(rows)],
        reading=reading,
        numbers={"loss_by_loops": by, "auc": aucs, "spread": spread, "std": std, "auc_spread": auc_spread},
        plot=lambda path: plot(curves, path, title="fixed-depth job, three seeds: held-out loss vs compute"),
        method=[
            "The seed sets the initialisation, the order of the training sequences and the depth draws "
            "(train/config.py), so this spread covers both initialisation and data-order noise.",
        ],
    )


# ---------------------------------------------------------------------------------------------------
# 7. adaptive depth (the iteration decider) vs fixed depth at matched mean passes
RANDOM_STOP = (0.1, 0.25, 0.5, 0.75)  # the control: each pass, stop with this probability regardless of the token


def random_stop(model: Any, tokens: torch.Tensor, q: float, *, seed: int = 0) -> dict[str, float]:
    """Teacher-forced (per-loop KV) loss, accuracy and mean passes when every token stops after each pass
    with probability ``q`` — adaptive depth without any information, at a compute set by ``q``."""
    from elastic_pretrain.eval.quality import relative_compute
    from elastic_pretrain.model.inference import teacher_forced_loss

    gen = torch.Generator().manual_seed(seed)
    tf = teacher_forced_loss(
        model, tokens, kv_cache="per-loop", stop=lambda h, e, j: torch.rand(h.shape[:2], generator=gen) < q
    )
    rel = relative_compute(model.cfg, tf.mean_passes, seq_len=tokens.shape[1] - 1)
    return {"q": q, "mean_passes": tf.mean_passes, "relative_compute": rel, "loss": tf.loss, "accuracy": tf.accuracy}


def decider(ctx: Context) -> Findings:
    from elastic_pretrain.eval.adaptive import DEFAULT_THRESHOLDS, adaptive_sweep
    from elastic_pretrain.eval.quality import _interp, compare
    from elastic_pretrain.experiments.runner import base_job

    run = next(r for r in ctx.runs if r.job.decider is not None)
    base = ctx.run(base_job(run.job_path) or ctx.runs[0].name)
    tokens = ctx.val_tokens()
    model = ctx.model(run.name)
    thresholds = (0.0, 0.5, 1.01) if ctx.quick else DEFAULT_THRESHOLDS
    if model.decider is None or run.job.decider is None:
        raise UserError(f"{run.run_dir}: the decider job's checkpoint holds no iteration decider")
    sweep = adaptive_sweep(model, model.decider.eval(), tokens, thresholds)
    control = [random_stop(model, tokens, q) for q in ((0.5,) if ctx.quick else RANDOM_STOP)]
    base_loss = losses(ctx, base)  # the base run's own checkpoint: the frozen backbone must match it
    drift = max(abs(p.loss - base_loss[p.loops]) for p in sweep.fixed)
    cmp = compare(list(sweep.curves()))
    top = model.cfg.max_loops
    width, hidden = model.cfg.hidden_size, run.job.decider.hidden_size
    decider_flops = 2 * (2 * width * hidden + hidden)  # fc1 on [h; e] and fc2, multiply-adds x 2
    fmax = _flops(run, top)
    # the sweep's ends are fixed depth itself (threshold 0: ℓ = L_max; above 1: ℓ = 1): compare the inside
    inner = [r for r in sweep.adaptive if 1.0 + 1e-6 < r.mean_passes < top - 1e-6]
    delta = {r.threshold: (r.loss - sweep.fixed_at(r.relative_compute)[0]) for r in sweep.adaptive}
    dacc = {r.threshold: (r.accuracy - sweep.fixed_at(r.relative_compute)[1]) for r in sweep.adaptive}
    for c in control:
        c["fixed_loss"], c["fixed_accuracy"] = sweep.fixed_at(c["relative_compute"])
    rows = [
        "| control: stop probability per pass | mean passes/token | relative compute | loss | accuracy "
        "| fixed-depth loss at matched compute | Δ loss | Δ accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows += [
        f"| {c['q']:g} | {c['mean_passes']:.3f} | {c['relative_compute']:.3f} | {c['loss']:.4f} | {c['accuracy']:.4f} "
        f"| {c['fixed_loss']:.4f} | {c['loss'] - c['fixed_loss']:+.4f} | {c['accuracy'] - c['fixed_accuracy']:+.4f} |"
        for c in control
    ]
    reading = [
        f"AUC (compute-averaged loss over relative compute [{cmp.lo:.3f}, {cmp.hi:.3f}]): adaptive "
        f"{cmp.aucs[1]:.4f} vs fixed depth {cmp.aucs[0]:.4f} ({cmp.relative[1]:+.2%}; lower is better)."
    ]
    if inner:
        better = [r for r in inner if delta[r.threshold] < 0]
        best = min(inner, key=lambda r: delta[r.threshold])
        worst = max(inner, key=lambda r: delta[r.threshold])
        reading.append(
            f"Between the ends ({len(inner)} thresholds with 1 < mean passes < {top}), adaptive minus fixed depth at "
            f"the same compute: loss {statistics.fmean(delta[r.threshold] for r in inner):+.4f} nats on average "
            f"(lower at {len(better)} of {len(inner)}; best {delta[best.threshold]:+.4f} at threshold "
            f"{best.threshold:g}, {best.mean_passes:.2f} passes; worst {delta[worst.threshold]:+.4f} at "
            f"{worst.threshold:g}, {worst.mean_passes:.2f} passes), accuracy "
            f"{statistics.fmean(dacc[r.threshold] for r in inner):+.4f} on average."
        )
    reading.append(
        "Random stopping (the control: no information about the token) minus fixed depth at the same compute, "
        "in nats: "
        + ", ".join(f"{c['loss'] - c['fixed_loss']:+.4f} at {c['mean_passes']:.2f} passes" for c in control)
        + (f"; mean {statistics.fmean(c['loss'] - c['fixed_loss'] for c in control):+.4f}" if control else "")
        + (
            f" (the decider's mean between the ends: {statistics.fmean(delta[r.threshold] for r in inner):+.4f})."
            if inner
            else "."
        )
    )
    one = sweep.fixed[0]
    above = [r for r in inner if r.loss > one.loss]
    if above:
        reading.append(
            f"{len(above)} of {len(inner)} adaptive points lose more than fixed ℓ = 1 ({one.loss:.4f}) although they "
            "run more passes: "
            + ", ".join(f"{r.loss:.4f} at {r.mean_passes:.2f} passes (threshold {r.threshold:g})" for r in above)
            + "; random stopping: "
            + ", ".join(f"{c['loss']:.4f} at {c['mean_passes']:.2f}" for c in control)
            + ". Tokens at different depths in one sequence (a stopped token's frozen K/V read by deeper ones) is "
            f"an execution {base.name} never trained under (one depth per micro-batch)."
        )
    # the control as a curve (its ends: every token at L_max, every token at ℓ = 1 — the sweep's ends)
    ends_pts = [(r.relative_compute, r.loss) for r in (sweep.adaptive[0], sweep.adaptive[-1])]
    rand = sorted([*ends_pts, *((c["relative_compute"], c["loss"]) for c in control)])
    vs_random = {
        r.threshold: r.loss - _interp([x for x, _ in rand], [y for _, y in rand], r.relative_compute) for r in inner
    }
    if inner:
        reading.append(
            "Decider minus random stopping at the same compute (the control's curve interpolated): "
            + ", ".join(f"{vs_random[r.threshold]:+.4f} at {r.mean_passes:.2f} passes" for r in inner)
            + f"; mean {statistics.fmean(vs_random.values()):+.4f} nats."
        )
    ends = delta[sweep.adaptive[0].threshold], delta[sweep.adaptive[-1].threshold]
    reading.append(
        f"Fixed depth ℓ = 1..{top} on the decider checkpoint: "
        + ", ".join(f"{p.loss:.4f}" for p in sweep.fixed)
        + f" (the base run {base.name}'s own checkpoint: within {drift:.1e} nats: the frozen backbone is the base "
        "model); the end points of the sweep equal fixed depth by construction (threshold 0 = ℓ = "
        f"{top}: {ends[0]:+.4f}; above 1 = ℓ = 1: {ends[1]:+.4f})."
    )

    distinct = [r for i, r in enumerate(sweep.adaptive) if i == 0 or r.mean_passes != sweep.adaptive[i - 1].mean_passes]

    def draw(axes: Any) -> None:
        series = (
            ("fixed depth", [(p.relative_compute, p.loss, p.accuracy) for p in sweep.fixed], "-o"),
            ("adaptive (decider)", [(r.relative_compute, r.loss, r.accuracy) for r in sweep.adaptive], "-s"),
            ("random stop (control)", [(c["relative_compute"], c["loss"], c["accuracy"]) for c in control], "x"),
        )
        for name, pts, style in series:
            pts = sorted(pts)
            for ax, k in zip(axes, (1, 2), strict=True):
                ax.plot([p[0] for p in pts], [p[k] for p in pts], style, label=name, ms=4)
        for r in distinct:  # one label per point (high thresholds all stop after one pass)
            axes[0].annotate(f"{r.threshold:g}", (r.relative_compute, r.loss), fontsize=6, xytext=(3, 3),
                             textcoords="offset points")  # fmt: skip
        for ax, label in zip(axes, ("held-out loss (nats/token)", "next-token accuracy"), strict=True):
            ax.set_xlabel("relative compute FLOPs(mean passes) / FLOPs(L_max)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)

    return Findings(
        tables=[sweep.markdown(), "\n".join(rows)],
        reading=reading,
        numbers={
            "fixed": [dataclasses.asdict(p) for p in sweep.fixed],
            "adaptive": [
                {**dataclasses.asdict(r), "delta_loss": delta[r.threshold], "delta_accuracy": dacc[r.threshold]}
                for r in sweep.adaptive
            ],
            "random_stop": control,
            "decider_minus_random": vs_random,
            "auc": dict(zip(cmp.names, cmp.aucs, strict=True)),
            "auc_vs_fixed": cmp.relative[1],
            "auc_range": [cmp.lo, cmp.hi],
            "base_loss_by_loops": base_loss,
            "backbone_drift": drift,
            "decider_flops_per_decision": decider_flops,
        },
        plot=lambda path: _figure(path, draw, panels=2),
        method=[
            f"The decider job post-trains a TaH2 iteration decider on {base.name}'s final checkpoint "
            f"(`decider.init_from: {base.name}.yaml`: the runner trains or reuses that job first and points the "
            "decider job at its run); the backbone is frozen, so the decider checkpoint holds the base model "
            f"unchanged. Its training sees the base's {run.tokens:,} tokens in the same order (the same train "
            "section); every micro-batch runs all passes with an exit at each and the BCE trains the decider only (the "
            "setup table's training FLOPs for it count the pretraining step, an overestimate).",
            "Teacher-forced on the held-out tokens with the per-loop KV cache (`eval/adaptive.py adaptive_sweep`, "
            "as `eval --adaptive`): after pass j a token stops when the decider's continue probability is below "
            "the threshold; a stopped token keeps its hidden state and its K/V of its last pass for the tokens "
            "that run on. Fixed depth runs every token ℓ passes. Relative compute = FLOPs per token at the mean "
            "passes / FLOPs at L_max (prelude, coda and output layer included). Not counted: the decider's own "
            f"{decider_flops:,} FLOPs per token and decision ({decider_flops / fmax:.1%} of FLOPs(L_max); up to "
            f"{top - 1} decisions per token) — counting them would move every adaptive point to more compute, "
            "against adaptive depth. Fixed depth is linearly interpolated between the ℓ at the adaptive point's "
            "compute.",
            "Control: the same adaptive execution with a random stop rule (each pass, each token stops with "
            "probability q, seed 0): what per-token depth costs without any information about the token. Every "
            "comparison here is within one checkpoint on the same held-out tokens (paired), so the seed spread "
            "of seed-noise.md does not apply to it directly.",
        ],
    )


# ---------------------------------------------------------------------------------------------------
EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment(
            name="exit-schedules",
            title="Exit schedules: telescopic, mixed depth and fixed exits vs fixed depth",
            question="Which way of training the exits gives the best loss at every loop count ℓ and the best "
            "quality-per-compute (AUC)? Four schedules on the same model, tokens and seed: fixed depth (ℓ = L_max "
            "only), mixed depth from scratch (a random ℓ per micro-batch), telescopic (full depth plus one random "
            "prefix exit, TLM) and fixed exits 1, 2, 4 (Matryoshka-style).",
            analyse=exit_schedules,
        ),
        Experiment(
            name="late-switch",
            title="Late switch vs mixed depth from scratch vs a non-looped model",
            question="Does switching from fixed to mixed depth late (at 75% of the tokens, zero-init loop-count "
            "heads; ELR) beat mixed depth from the first step, and how do both compare with a non-looped MoE of "
            "equal parameters and equal compute per token at full depth? Loss at ℓ = 1 and ℓ = L_max.",
            analyse=late_switch,
        ),
        Experiment(
            name="flattening",
            title="Flattening series (flatten = 1, 2, 4) with untied and tied attention",
            question="At equal expert parameters and equal active compute, does trading layers for passes "
            "(flattening, Foil) change the final loss, and how does routing confidence relate to load balance? "
            "With untied attention (one attention block per pass) and tied (one per layer).",
            analyse=flattening,
        ),
        Experiment(
            name="route-replay",
            title="Route replay on/off: step time and loss",
            question="Passes ≥ 1 reuse the expert choices of pass 0 (ELR route replay; gate weights stay live). "
            "What does it cost or save per step, and what does it do to the loss? The late-switch job with "
            "`model.route_replay` off and on.",
            analyse=route_replay,
        ),
        Experiment(
            name="kv-cache",
            title="Last-loop vs per-loop KV cache: bytes and loss",
            question="Caching only the last pass's keys/values of the core layers cuts their KV memory by a factor "
            "ℓ (the prelude and coda caches stay); how much held-out loss does it cost, for a fixed-depth model and "
            "for a late-switch (mixed-depth) model?",
            analyse=kv_cache,
        ),
        Experiment(
            name="seed-noise",
            title="Seed noise: the fixed-depth job with three seeds",
            question="How far apart do two runs of the same job land when only the seed differs? The yardstick for "
            "the differences in the other reports (each of which is one seed).",
            analyse=seed_noise,
            varies=("train.seed",),
        ),
        Experiment(
            name="decider",
            title="Adaptive depth (iteration decider) vs fixed depth at matched mean passes",
            question="A TaH2 iteration decider post-trained on the late-switch model (frozen backbone) stops each "
            "token after its own number of passes. At the same mean passes per token (the same compute), is the "
            "held-out loss and next-token accuracy better than running every token at one fixed depth? A threshold "
            "sweep of the decider against fixed depth ℓ = 1..4 interpolated at the same relative compute, with "
            "random per-token stopping as a control.",
            analyse=decider,
        ),
    )
}
EXPERIMENTS["samplers"] = __import__("elastic_pretrain.experiments.sampler", fromlist=["EXPERIMENT"]).EXPERIMENT
