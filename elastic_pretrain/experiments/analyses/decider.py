"""decider: a TaH2 iteration decider (adaptive depth) vs fixed depth at matched mean passes, with random
per-token stopping as the control."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch

from elastic_pretrain.errors import UserError
from elastic_pretrain.experiments.measure import losses, run_flops
from elastic_pretrain.experiments.present import figure, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings, base_job
from elastic_pretrain.experiments.stats import Claim

TAH2 = "seeds/000 (TaH2)"
RANDOM_STOP = (0.1, 0.25, 0.5, 0.75)  # the control: each pass, stop with this probability regardless of the token


def random_stop(model: Any, tokens: torch.Tensor, q: float, *, seed: int = 0) -> dict[str, float]:
    """Teacher-forced (per-loop KV) loss, accuracy and mean passes when every token stops after each pass
    with probability ``q`` — adaptive depth without any information, at a compute set by ``q``."""
    from elastic_pretrain.model.flops import relative_compute
    from elastic_pretrain.model.inference import teacher_forced_loss

    gen = torch.Generator().manual_seed(seed)
    tf = teacher_forced_loss(
        model, tokens, kv_cache="per-loop", stop=lambda h, e, j: torch.rand(h.shape[:2], generator=gen) < q
    )
    rel = relative_compute(model.cfg, tf.mean_passes, seq_len=tokens.shape[1] - 1)
    return {"q": q, "mean_passes": tf.mean_passes, "relative_compute": rel, "loss": tf.loss, "accuracy": tf.accuracy}


def _interp_curve(points: list[tuple[float, float]], x: float) -> float:
    from elastic_pretrain.eval.curves import interp

    pts = sorted(points)
    return interp([p for p, _ in pts], [v for _, v in pts], x)


def _measure(ctx: Context) -> dict[str, Any]:
    """The sweep, the control and every paired difference, on one checkpoint and the same tokens."""
    from elastic_pretrain.eval.adaptive import DEFAULT_THRESHOLDS, adaptive_sweep
    from elastic_pretrain.eval.curves import compare

    run = next(r for r in ctx.runs if r.job.decider is not None)
    base = ctx.run(base_job(run.job_path) or ctx.runs[0].name)
    tokens, model = ctx.val_tokens(), ctx.model(run.name)
    if model.decider is None or run.job.decider is None:
        raise UserError(f"{run.run_dir}: the decider job's checkpoint holds no iteration decider")
    sweep = adaptive_sweep(model, model.decider.eval(), tokens, (0.0, 0.5, 1.01) if ctx.quick else DEFAULT_THRESHOLDS)
    control = [random_stop(model, tokens, q) for q in ((0.5,) if ctx.quick else RANDOM_STOP)]
    for c in control:
        c["fixed_loss"], c["fixed_accuracy"] = sweep.fixed_at(c["relative_compute"])
    top = model.cfg.max_loops
    # the sweep's ends are fixed depth itself (threshold 0: ℓ = L_max; above 1: ℓ = 1): compare the inside
    inner = [r for r in sweep.adaptive if 1.0 + 1e-6 < r.mean_passes < top - 1e-6]
    ends = [(r.relative_compute, r.loss) for r in (sweep.adaptive[0], sweep.adaptive[-1])]
    rand = [*ends, *((c["relative_compute"], c["loss"]) for c in control)]
    base_loss = losses(ctx, base)  # the base run's own checkpoint: the frozen backbone must match it
    return {
        "run": run,
        "base": base,
        "sweep": sweep,
        "control": control,
        "inner": inner,
        "top": top,
        "cmp": compare(list(sweep.curves())),
        "base_loss": base_loss,
        "drift": max(abs(p.loss - base_loss[p.loops]) for p in sweep.fixed),
        "delta": {r.threshold: r.loss - sweep.fixed_at(r.relative_compute)[0] for r in sweep.adaptive},
        "dacc": {r.threshold: r.accuracy - sweep.fixed_at(r.relative_compute)[1] for r in sweep.adaptive},
        "vs_random": {r.threshold: r.loss - _interp_curve(rand, r.relative_compute) for r in inner},
        "decider_flops": 2 * (2 * model.cfg.hidden_size * run.job.decider.hidden_size + run.job.decider.hidden_size),
    }


def _reading(m: dict[str, Any]) -> list[str]:
    cmp, inner, delta, control = m["cmp"], m["inner"], m["delta"], m["control"]
    out = [
        f"AUC (compute-averaged loss over relative compute [{cmp.lo:.3f}, {cmp.hi:.3f}]): adaptive "
        f"{cmp.aucs[1]:.4f} vs fixed depth {cmp.aucs[0]:.4f} ({cmp.relative[1]:+.2%}; lower is better)."
    ]
    if inner:
        out.append(
            f"Between the ends ({len(inner)} thresholds with 1 < mean passes < {m['top']}), adaptive minus fixed "
            f"depth at the same compute: "
            + ", ".join(f"{delta[r.threshold]:+.4f} at {r.mean_passes:.2f} passes" for r in inner)
            + "; minus random stopping: "
            + ", ".join(f"{m['vs_random'][r.threshold]:+.4f}" for r in inner)
            + " nats."
        )
    out.append(
        "Random stopping (no information about the token) minus fixed depth at the same compute: "
        + ", ".join(f"{c['loss'] - c['fixed_loss']:+.4f} at {c['mean_passes']:.2f} passes" for c in control)
        + " nats."
    )
    sweep = m["sweep"]
    out.append(
        f"Fixed depth ℓ = 1..{m['top']} on the decider checkpoint: "
        + ", ".join(f"{p.loss:.4f}" for p in sweep.fixed)
        + f" (the base run {m['base'].name}'s own checkpoint: within {m['drift']:.1e} nats: the frozen backbone is "
        "the base model); the end points of the sweep equal fixed depth by construction."
    )
    return out


def _draw(m: dict[str, Any], axes: Any) -> None:
    sweep, control = m["sweep"], m["control"]
    series = (
        ("fixed depth", [(p.relative_compute, p.loss, p.accuracy) for p in sweep.fixed], "-o"),
        ("adaptive (decider)", [(r.relative_compute, r.loss, r.accuracy) for r in sweep.adaptive], "-s"),
        ("random stop (control)", [(c["relative_compute"], c["loss"], c["accuracy"]) for c in control], "x"),
    )
    for name, pts, style in series:
        pts = sorted(pts)
        for ax, k in zip(axes, (1, 2), strict=True):
            ax.plot([p[0] for p in pts], [p[k] for p in pts], style, label=name, ms=4)
    for i, r in enumerate(sweep.adaptive):  # one label per distinct point (high thresholds all stop after one pass)
        if i == 0 or r.mean_passes != sweep.adaptive[i - 1].mean_passes:
            axes[0].annotate(
                f"{r.threshold:g}", (r.relative_compute, r.loss), fontsize=6, xytext=(3, 3), textcoords="offset points"
            )
    for ax, label in zip(axes, ("held-out loss (nats/token)", "next-token accuracy"), strict=True):
        ax.set(xlabel="relative compute FLOPs(mean passes) / FLOPs(L_max)", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def _method(m: dict[str, Any]) -> list[str]:
    run, base, top, fl = m["run"], m["base"], m["top"], m["decider_flops"]
    return [
        f"The decider job post-trains a TaH2 iteration decider on {base.name}'s final checkpoint of the same seed "
        f"(`decider.init_from: {base.name}.yaml`); the backbone is frozen. Its training sees the base's "
        f"{run.tokens:,} tokens in the same order; every micro-batch runs all passes with an exit at each and the "
        "BCE trains the decider only.",
        "Teacher-forced on the held-out tokens with the per-loop KV cache (`eval/adaptive.py adaptive_sweep`, as "
        "`eval --adaptive`): after pass j a token stops when the decider's continue probability is below the "
        "threshold. Relative compute = FLOPs per token at the mean passes / FLOPs at L_max. Not counted: the "
        f"decider's own {fl:,} FLOPs per token and decision ({fl / run_flops(run, top):.1%} of FLOPs(L_max)), "
        "which favours adaptive depth. Fixed depth is linearly interpolated at the adaptive point's compute.",
        "Control: the same execution with a random stop rule (each pass, each token stops with probability q, "
        "seed 0). The claims' per-seed quantities are means over the thresholds strictly between the ends.",
    ]


def analyse(ctx: Context) -> Findings:
    m = _measure(ctx)
    sweep, control, delta, dacc, cmp = m["sweep"], m["control"], m["delta"], m["dacc"], m["cmp"]
    rows = [
        (
            f"{c['q']:g}",
            f"{c['mean_passes']:.3f}",
            f"{c['relative_compute']:.3f}",
            f"{c['loss']:.4f}",
            f"{c['accuracy']:.4f}",
            f"{c['fixed_loss']:.4f}",
            f"{c['loss'] - c['fixed_loss']:+.4f}",
            f"{c['accuracy'] - c['fixed_accuracy']:+.4f}",
        )
        for c in control
    ]
    header = (
        "control: stop probability per pass",
        "mean passes/token",
        "relative compute",
        "loss",
        "accuracy",
        "fixed-depth loss at matched compute",
        "Δ loss",
        "Δ accuracy",
    )
    inner = [r.threshold for r in m["inner"]]
    metric = {"auc_vs_fixed": cmp.aucs[1] - cmp.aucs[0]}
    if inner:
        metric["minus_fixed"] = statistics.fmean(delta[t] for t in inner)
        metric["minus_random"] = statistics.fmean(m["vs_random"][t] for t in inner)
    return Findings(
        tables=[sweep.markdown(), table(header, rows)],
        reading=_reading(m),
        numbers={
            "fixed": [dataclasses.asdict(p) for p in sweep.fixed],
            "adaptive": [
                {**dataclasses.asdict(r), "delta_loss": delta[r.threshold], "delta_accuracy": dacc[r.threshold]}
                for r in sweep.adaptive
            ],
            "random_stop": control,
            "decider_minus_random": m["vs_random"],
            "auc": dict(zip(cmp.names, cmp.aucs, strict=True)),
            "auc_range": [cmp.lo, cmp.hi],
            "base_loss_by_loops": m["base_loss"],
            "backbone_drift": m["drift"],
            "decider_flops_per_decision": m["decider_flops"],
        },
        metrics={m["run"].name: metric},
        plot=lambda path: figure(path, lambda axes: _draw(m, axes), panels=2),
        method=_method(m),
    )


def _of_decider(metric: str) -> Any:
    return lambda ms: ms["decider"][metric]


EXPERIMENT = Experiment(
    name="decider",
    title="Adaptive depth (iteration decider) vs fixed depth at matched mean passes",
    question="A TaH2 iteration decider post-trained on the late-switch model (frozen backbone) stops each "
    "token after its own number of passes. At the same mean passes per token (the same compute), is the "
    "held-out loss better than running every token at one fixed depth? A threshold sweep against fixed depth "
    "ℓ = 1..4 interpolated at the same relative compute, with random per-token stopping as a control.",
    analyse=analyse,
    claims=(
        Claim(
            paper='adaptive depth beats uniform depth at matched compute: "Extra compute goes where it moves the '
            'answer"; "53% steeper accuracy-compute slope"',
            source=TAH2,
            magnitude="slope 2.74 vs 1.79 on AIME",
            measure="adaptive minus fixed-depth AUC of loss over relative compute (nats)",
            value=_of_decider("auc_vs_fixed"),
            expect="negative",
        ),
        Claim(
            paper='the decider puts passes where they help: "The decider gets online labels saying whether one more '
            'iteration would improve the prediction for that token"',
            source=TAH2,
            magnitude="not given (vs random allocation)",
            measure="decider minus random stopping loss at the same compute, mean over the inner thresholds (nats)",
            value=_of_decider("minus_random"),
            expect="negative",
        ),
    ),
)
