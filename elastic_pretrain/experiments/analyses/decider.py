"""decider: TaH2 iteration deciders (adaptive depth) — frozen backbone and joint post-training under per-token
depth — vs fixed depth at matched mean passes, with random per-token stopping as the control. The measuring
is in ``decider_measure.py``."""

from __future__ import annotations

import dataclasses
from typing import Any

from elastic_pretrain.experiments.analyses.decider_measure import (
    base_curve,
    decider_runs,
    matched,
    measure,
    run_metrics,
)
from elastic_pretrain.experiments.measure import run_flops
from elastic_pretrain.experiments.present import figure, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings
from elastic_pretrain.experiments.stats import Claim, paired

TAH2 = "seeds/000 (TaH2)"
# the job names (arms) the claims read; UNIFORM is the control for PER_TOKEN: a backbone post-trained on the same
# tokens at every depth (`decider.backbone: joint`, `decider.lm_loss: every_exit`)
FROZEN, PER_TOKEN, UNIFORM = "decider", "decider-per-token", "decider-uniform"


def _reading(m: dict[str, Any]) -> list[str]:
    cmp, inner, delta, control, name = m["cmp"], m["inner"], m["delta"], m["control"], m["run"].name
    out = [
        f"{name} ({m['backbone']} backbone): AUC (compute-averaged loss over relative compute [{cmp.lo:.3f}, "
        f"{cmp.hi:.3f}]): adaptive {cmp.aucs[1]:.4f} vs its own fixed depth {cmp.aucs[0]:.4f} "
        f"({cmp.relative[1]:+.2%}; lower is better)."
    ]
    if inner:
        out.append(
            f"{name}: between the ends ({len(inner)} thresholds with 1 < mean passes < {m['top']}), adaptive minus "
            "fixed depth at the same compute: "
            + ", ".join(f"{delta[r.threshold]:+.4f} at {r.mean_passes:.2f} passes" for r in inner)
            + "; minus random stopping: "
            + ", ".join(f"{m['vs_random'][r.threshold]:+.4f}" for r in inner)
            + " nats."
        )
    out.append(
        f"{name}: random stopping (no information about the token) minus fixed depth at the same compute: "
        + ", ".join(f"{c['loss'] - c['fixed_loss']:+.4f} at {c['mean_passes']:.2f} passes" for c in control)
        + " nats."
    )
    backbone = (
        "the frozen backbone is the base model"
        if m["backbone"] == "frozen"
        else "the backbone was post-trained, so it differs from the base"
    )
    out.append(
        f"{name}: fixed depth ℓ = 1..{m['top']} on its checkpoint: "
        + ", ".join(f"{p.loss:.4f}" for p in m["sweep"].fixed)
        + f" (the base run {m['base'].name}'s own checkpoint: within {m['drift']:.1e} nats: {backbone}); the end "
        "points of the sweep equal fixed depth by construction."
    )
    return out


def _draw(ms: list[dict[str, Any]], axes: Any) -> None:
    first = ms[0]
    base = [(p.relative_compute, first["base_loss"][p.loops], float("nan")) for p in first["sweep"].fixed]
    series = [(f"fixed depth ({first['base'].name})", base, "-o")]
    for m in ms:
        name = m["run"].name
        series.append(
            (f"adaptive ({name})", [(r.relative_compute, r.loss, r.accuracy) for r in m["sweep"].adaptive], "-s")
        )
        series.append(
            (f"random stop ({name})", [(c["relative_compute"], c["loss"], c["accuracy"]) for c in m["control"]], "x")
        )
        if m["backbone"] != "frozen":  # a post-trained backbone has its own fixed depth
            own = [(p.relative_compute, p.loss, p.accuracy) for p in m["sweep"].fixed]
            series.append((f"fixed depth ({name})", own, "--o"))
    for name, pts, style in series:
        pts = sorted(pts)
        for ax, k in zip(axes, (1, 2), strict=True):
            ax.plot([p[0] for p in pts], [p[k] for p in pts], style, label=name, ms=4)
    for ax, label in zip(axes, ("held-out loss (nats/token)", "next-token accuracy"), strict=True):
        ax.set(xlabel="relative compute FLOPs(mean passes) / FLOPs(L_max)", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)


def _method(ms: list[dict[str, Any]]) -> list[str]:
    m = ms[0]
    run, base, top, fl = m["run"], m["base"], m["top"], m["decider_flops"]
    arms = ", ".join(f"{x['run'].name} (`decider.backbone: {x['backbone']}`)" for x in ms)
    return [
        f"Each decider job post-trains a TaH2 iteration decider on {base.name}'s final checkpoint of the same seed "
        f"(`decider.init_from: {base.name}.yaml`): {arms}. Each sees the base's {run.tokens:,} tokens in the same "
        "order. `frozen`: every micro-batch runs all passes with an exit at each and the BCE trains the decider "
        "only. `per_token` (TaH2's joint post-training, docs/evaluation.md): tokens stop per the decider, the LM "
        "loss is taken at each token's exit, the labels are nested; the backbone trains on those extra tokens too. "
        "`joint` with `lm_loss: every_exit` (the control for per-token training): every token runs every pass, the "
        "LM loss is the mean CE after passes 1..L_max, so the backbone sees the same extra tokens at every depth.",
        "Teacher-forced on the held-out tokens with the per-loop KV cache (`eval/adaptive.py adaptive_sweep`, as "
        "`eval --adaptive`): after pass j a token stops when the decider's continue probability is below the "
        "threshold. Relative compute = FLOPs per token at the mean passes / FLOPs at L_max. Not counted: the "
        f"decider's own {fl:,} FLOPs per token and decision ({fl / run_flops(run, top):.1%} of FLOPs(L_max)), "
        "which favours adaptive depth. Fixed depth is linearly interpolated at the adaptive point's compute.",
        "Matched compute across arms: the AUC of each decider's adaptive curve, of the base run's fixed depth and of "
        f"{UNIFORM}'s own fixed depth over the relative-compute range they all cover (`auc_matched`; `auc_vs_base` "
        f"= minus the base's; `auc_vs_control` = minus {UNIFORM}'s fixed depth, a backbone that saw the same extra "
        "tokens without per-token depth).",
        "Control: the same execution with a random stop rule (each pass, each token stops with probability q, "
        "seed 0). The per-seed quantities `minus_fixed`/`minus_random` are means over the thresholds strictly "
        "between the ends.",
    ]


def _control_table(ms: list[dict[str, Any]]) -> str:
    header = (
        "decider run",
        "control: stop probability per pass",
        "mean passes/token",
        "relative compute",
        "loss",
        "accuracy",
        "fixed-depth loss at matched compute",
        "Δ loss",
        "Δ accuracy",
    )
    rows = [
        (
            m["run"].name,
            f"{c['q']:g}",
            f"{c['mean_passes']:.3f}",
            f"{c['relative_compute']:.3f}",
            f"{c['loss']:.4f}",
            f"{c['accuracy']:.4f}",
            f"{c['fixed_loss']:.4f}",
            f"{c['loss'] - c['fixed_loss']:+.4f}",
            f"{c['accuracy'] - c['fixed_accuracy']:+.4f}",
        )
        for m in ms
        for c in m["control"]
    ]
    return table(header, rows)


def _numbers(m: dict[str, Any]) -> dict[str, Any]:
    sweep, delta, dacc, cmp = m["sweep"], m["delta"], m["dacc"], m["cmp"]
    return {
        "backbone": m["backbone"],
        "fixed": [dataclasses.asdict(p) for p in sweep.fixed],
        "adaptive": [
            {**dataclasses.asdict(r), "delta_loss": delta[r.threshold], "delta_accuracy": dacc[r.threshold]}
            for r in sweep.adaptive
        ],
        "random_stop": m["control"],
        "decider_minus_random": m["vs_random"],
        "auc": dict(zip(cmp.names, cmp.aucs, strict=True)),
        "auc_range": [cmp.lo, cmp.hi],
        "backbone_drift": m["drift"],
        "decider_flops_per_decision": m["decider_flops"],
    }


def analyse(ctx: Context) -> Findings:
    ms = [measure(ctx, r) for r in sorted(decider_runs(ctx), key=lambda r: r.name != FROZEN)]  # frozen first
    curves = {m["run"].name: m["sweep"].curves()[1] for m in ms}  # each named "adaptive (decider)": name by run
    curves = {n: dataclasses.replace(c, name=f"adaptive ({n})") for n, c in curves.items()}
    control = next((m["sweep"].curves()[0] for m in ms if m["run"].name == UNIFORM), None)
    control = None if control is None else dataclasses.replace(control, name=f"fixed depth ({UNIFORM})")
    cmp, across = matched(base_curve(ms[0]), curves, control)
    metrics = {m["run"].name: {**run_metrics(m), **across[m["run"].name]} for m in ms}
    return Findings(
        tables=[
            *(f"**{m['run'].name}** ({m['backbone']} backbone)\n\n{m['sweep'].markdown()}" for m in ms),
            _control_table(ms),
        ],
        reading=[
            *(line for m in ms for line in _reading(m)),
            f"At matched compute over [{cmp.lo:.3f}, {cmp.hi:.3f}], AUC of loss: "
            + ", ".join(f"{n} {a:.4f}" for n, a in zip(cmp.names, cmp.aucs, strict=True))
            + " (lower is better).",
        ],
        numbers={
            "deciders": {m["run"].name: _numbers(m) for m in ms},  # not "runs": the report's run table
            "base_loss_by_loops": ms[0]["base_loss"],
            "matched": {"range": [cmp.lo, cmp.hi], "auc": dict(zip(cmp.names, cmp.aucs, strict=True))},
        },
        metrics=metrics,
        plot=lambda path: figure(path, lambda axes: _draw(ms, axes), panels=2),
        method=_method(ms),
    )


def _of(arm: str, metric: str) -> Any:
    return lambda ms: ms[arm][metric]


_SLOPE = 'adaptive depth beats uniform depth at matched compute: "Extra compute goes where it moves the answer"'
EXPERIMENT = Experiment(
    name="decider",
    title="Adaptive depth (iteration deciders, frozen and joint per-token) vs fixed depth at matched mean passes",
    question="TaH2 iteration deciders post-trained on the late-switch model — one with the backbone frozen, one "
    "jointly with the backbone under per-token depth (TaH2's post-training) — stop each token after its own "
    "number of passes. At the same mean passes per token (the same compute), is the held-out loss better than "
    "running every token at one fixed depth, better than random per-token stopping, and is the joint decider "
    "better than the frozen one and than a backbone post-trained on the same tokens at every depth? Threshold "
    "sweeps against fixed depth ℓ = 1..4 at the same relative compute.",
    analyse=analyse,
    claims=(
        Claim(
            paper=_SLOPE + ' (frozen backbone, a variant); "53% steeper accuracy-compute slope"',
            source=TAH2,
            magnitude="slope 2.74 vs 1.79 on AIME",
            measure="frozen decider: adaptive minus fixed-depth AUC of loss over relative compute (nats)",
            value=_of(FROZEN, "auc_vs_fixed"),
            expect="negative",
        ),
        Claim(
            paper=_SLOPE + '; the decider is "post-trained jointly with the backbone through lookahead depth '
            'supervision"',
            source=TAH2,
            magnitude="+3.4 points over the baseline's peak accuracy at matched test-time compute (AIME)",
            measure="joint per-token decider: adaptive minus the fixed depth of a backbone post-trained on the same "
            f"tokens at every depth ({UNIFORM}), AUC of loss over the common compute range (nats)",
            value=_of(PER_TOKEN, "auc_vs_control"),
            expect="negative",
        ),
        Claim(
            paper="training under per-token depth is what helps: the decider is \"post-trained jointly with the "
            'backbone", which "makes loop depth a per-token decision"',
            source=TAH2,
            magnitude="not given (TaH2 reports only the joint model)",
            measure=f"joint per-token minus {UNIFORM} (the same extra tokens at every depth, its own decider): "
            "adaptive AUC of loss over the common compute range (nats)",
            value=paired(PER_TOKEN, UNIFORM, "auc_matched"),
            expect="negative",
        ),
        Claim(
            paper="joint post-training beats a frozen backbone: TaH2's decider is \"post-trained jointly with the "
            'backbone" (confounded here: the joint backbone also sees the tokens a second time; the claim above '
            "controls for that)",
            source=TAH2,
            magnitude="not given (TaH2 reports only the joint model)",
            measure="joint per-token minus frozen decider: adaptive AUC of loss over the common compute range (nats)",
            value=paired(PER_TOKEN, FROZEN, "auc_matched"),
            expect="negative",
        ),
        Claim(
            paper='the decider puts passes where they help: "The decider gets online labels saying whether one more '
            'iteration would improve the prediction for that token"',
            source=TAH2,
            magnitude="not given (vs random allocation)",
            measure="frozen decider minus random stopping loss at the same compute, mean over the inner thresholds "
            "(nats)",
            value=_of(FROZEN, "minus_random"),
            expect="negative",
        ),
        Claim(
            paper='the joint decider puts passes where they help: "Extra compute goes where it moves the answer"',
            source=TAH2,
            magnitude="not given (vs random allocation)",
            measure="joint per-token decider minus random stopping (on its own backbone) loss at the same compute, "
            "mean over the inner thresholds (nats)",
            value=_of(PER_TOKEN, "minus_random"),
            expect="negative",
        ),
    ),
)
