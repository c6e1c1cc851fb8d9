"""decider-depths: TaH2's L_max sweep — the joint per-token decider (``decider.backbone: per_token``) post-trained on
bases of L_max = 2, 4, 8 (``jobs/experiments/decider-depths/``), and TaH2's measure at each: accuracy (and loss)
gained per doubling of decode compute, adaptive vs fixed depth. Each decider run is measured as in ``decider``
(``decider_measure.measure``: threshold sweep, fixed depth ℓ = 1..L_max, random stopping).

The claims (issue 32) score adaptive depth on the Pareto frontier of the thresholds each decider decides, against
the fixed depth of the control ``uniform-L<k>``: the same base post-trained on the same tokens at every depth
(``decider``'s decider-uniform). The decider's backbone sees its base's tokens a second time, so against the base
itself the frontier gains what any post-training gains (−0.38 to −0.43 nat at this scale, the control's size):
a claim that would read "yes" for the extra tokens alone. Each presupposes that depth pays on that base (fixed
depth at ℓ = L_max below ℓ = 1, :func:`depth_pays`). Reports written before the sweeps, the bases' losses or the
controls were stored lack the numbers for them (their claims read "not measured" or "premise absent"); a rerun
stores them (:func:`rescore`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from elastic_pretrain.errors import UserError
from elastic_pretrain.eval.adaptive import accuracy_per_doubling
from elastic_pretrain.experiments.analyses.decider_measure import (
    decider_runs,
    fixed_curve,
    frontier_scores,
    measure,
    run_metrics,
)
from elastic_pretrain.experiments.measure import run_flops
from elastic_pretrain.experiments.present import figure, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings
from elastic_pretrain.experiments.stats import Claim, Metrics

TAH2 = "seeds/000 (TaH2)"
DEPTHS = (2, 4, 8)  # L_max of the job set's arms: decider-L<k>.yaml on base-L<k>.yaml


def arm(depth: int) -> str:
    return f"decider-L{depth}"


def control(depth: int) -> str:
    """The matched-token control of :func:`arm` (module docstring)."""
    return f"uniform-L{depth}"


def slopes(m: dict[str, Any]) -> dict[str, float]:
    """TaH2's measure on one decider run's sweep: per doubling of decode compute (least-squares slope against
    log2 of relative compute, ``eval/adaptive.py: accuracy_per_doubling``), accuracy (points: × 100) and loss
    (nats; negative = gained) of fixed depth ℓ = 1..L_max and of the adaptive threshold sweep, and their
    differences (adaptive minus fixed)."""
    sweep = m["sweep"]
    fixed_x = [p.relative_compute for p in sweep.fixed]
    ada_x = [r.relative_compute for r in sweep.adaptive]
    acc_fixed, acc_ada = (100 * s for s in sweep.slopes())
    loss_fixed = accuracy_per_doubling(fixed_x, [p.loss for p in sweep.fixed])
    loss_ada = accuracy_per_doubling(ada_x, [r.loss for r in sweep.adaptive])
    out = {
        "acc_per_doubling_fixed": acc_fixed,
        "acc_per_doubling_adaptive": acc_ada,
        "acc_per_doubling_gain": acc_ada - acc_fixed,
        "loss_per_doubling_fixed": loss_fixed,
        "loss_per_doubling_adaptive": loss_ada,
        "loss_per_doubling_gain": loss_ada - loss_fixed,
    }
    ctrl = m.get("control_fixed")
    if ctrl:  # the control's fixed depth: uniform depth that learnt from the same tokens (module docstring)
        ctrl_x = [p.relative_compute for p in ctrl]
        acc_ctrl = 100 * accuracy_per_doubling(ctrl_x, [p.accuracy for p in ctrl])
        loss_ctrl = accuracy_per_doubling(ctrl_x, [p.loss for p in ctrl])
        out.update({
            "acc_per_doubling_control": acc_ctrl,
            "acc_per_doubling_gain_vs_control": acc_ada - acc_ctrl,
            "loss_per_doubling_control": loss_ctrl,
            "loss_per_doubling_gain_vs_control": loss_ada - loss_ctrl,
        })  # fmt: skip
    return out


def depth_metrics(m: dict[str, Any]) -> dict[str, float]:
    """One decider run's per-seed metrics: TaH2's slopes, the ``decider`` AUC/random-stop metrics, the
    fixed-depth loss at L_max (does uniform depth plateau as L_max grows?), and (:func:`scores`) the premise
    and the Pareto-frontier scores."""
    top = m["top"]
    out = {**slopes(m), **run_metrics(m), "l_max": float(top), "fixed_loss_at_l_max": m["sweep"].fixed[-1].loss,
           "adaptive_best_loss": min(r.loss for r in m["sweep"].adaptive)}  # fmt: skip
    return {**out, **scores(sweep_numbers(m))}


def sweep_numbers(m: dict[str, Any]) -> dict[str, Any]:
    """What :func:`scores` reads, as the report stores it: the sweep, fixed depth and random stopping of the
    decider run, its base's fixed-depth loss per ℓ and (when the set has it) its control's fixed depth."""
    sweep = m["sweep"]
    out = {
        "fixed": [dataclasses.asdict(p) for p in sweep.fixed],
        "adaptive": [dataclasses.asdict(r) for r in sweep.adaptive],
        "random_stop": m["control"],
        "base_loss": dict(m["base_loss"]),
    }
    if m.get("control_fixed"):
        out["control_fixed"] = [dataclasses.asdict(p) for p in m["control_fixed"]]
    return out


def scores(run: dict[str, Any]) -> dict[str, float]:
    """From one decider run's stored sweep (:func:`sweep_numbers`): its base's fixed-depth loss at ℓ = 1 and
    L_max and their difference (``base_depth_gain``, the premise), the same of its control (``control_depth_gain``)
    when stored, and the frontier scores (``decider_measure.frontier_scores``: ``frontier_vs_base`` against the
    base's fixed depth, ``frontier_vs_control`` against the control's, which the claims read)."""
    base = {int(k): float(v) for k, v in run["base_loss"].items()}
    top = max(base)
    out = {"base_loss@1": base[1], "base_loss@max": base[top], "base_depth_gain": base[top] - base[1]}
    refs = {"base": fixed_curve(base, run)}
    if run.get("control_fixed"):
        ctrl = {int(p["loops"]): float(p["loss"]) for p in run["control_fixed"]}
        out.update(
            {"control_loss@1": ctrl[1], "control_loss@max": ctrl[top], "control_depth_gain": ctrl[top] - ctrl[1]}
        )
        refs["control"] = fixed_curve(ctrl, run)
    return {**out, **frontier_scores(run, refs)}


def rescore(numbers: dict[str, Any], metrics: Metrics) -> Metrics:
    """One seed's metrics with :func:`scores` recomputed from the stored sweeps (reports that stored none keep
    theirs: their frontier and premise are not measured)."""
    depths = numbers.get("depths") or {}
    return {
        name: {**m, **(scores(depths[name]) if "adaptive" in depths.get(name, {}) else {})}
        for name, m in metrics.items()
    }


def _deepest(metrics: Metrics) -> str:
    """The deepest arm beyond L_max = 2 (KeyError, "not measured", without one)."""
    deeper = [d for d in DEPTHS[1:] if arm(d) in metrics]
    if not deeper:
        raise KeyError(arm(DEPTHS[-1]))
    return arm(deeper[-1])


def _gain_growth(metrics: Metrics) -> float:
    """Adaptive minus the control's fixed depth on the frontier at the deepest L_max of the set minus that at
    L_max = 2 (KeyError, "not measured", without L_max = 2 and a deeper arm, or without their controls)."""
    return metrics[_deepest(metrics)]["frontier_vs_control"] - metrics[arm(DEPTHS[0])]["frontier_vs_control"]


def _both_pay(metrics: Metrics) -> float:
    """The larger of the base's depth gain at L_max = 2 and at the deepest L_max: negative when depth pays at both."""
    return max(metrics[arm(DEPTHS[0])]["base_depth_gain"], metrics[_deepest(metrics)]["base_depth_gain"])


def _depth_table(ms: list[dict[str, Any]], per: dict[str, dict[str, float]]) -> str:
    header = ("L_max", "decider run", "base run", "FLOPs/token at L_max", "fixed loss at L_max",
              "best adaptive loss", "accuracy/doubling fixed (points)", "adaptive", "Δ", "control (points)",
              "Δ vs control", "loss/doubling fixed (nats)", "adaptive", "Δ", "control (nats)", "Δ vs control",
              "AUC adaptive − fixed (nats)", "minus random (nats)")  # fmt: skip
    rows = []
    for m in ms:
        v = per[m["run"].name]
        rand = v.get("minus_random", math.nan)
        keys = ("acc_per_doubling_control", "acc_per_doubling_gain_vs_control", "loss_per_doubling_control",
                "loss_per_doubling_gain_vs_control")  # fmt: skip
        ctrl = [v.get(k, math.nan) for k in keys]
        rows.append((m["top"], m["run"].name, m["base"].name, f"{run_flops(m['run'], m['top']):,.0f}",
                     f"{v['fixed_loss_at_l_max']:.4f}", f"{v['adaptive_best_loss']:.4f}",
                     f"{v['acc_per_doubling_fixed']:+.2f}", f"{v['acc_per_doubling_adaptive']:+.2f}",
                     f"{v['acc_per_doubling_gain']:+.2f}", f"{ctrl[0]:+.2f}", f"{ctrl[1]:+.2f}",
                     f"{v['loss_per_doubling_fixed']:+.4f}", f"{v['loss_per_doubling_adaptive']:+.4f}",
                     f"{v['loss_per_doubling_gain']:+.4f}", f"{ctrl[2]:+.4f}", f"{ctrl[3]:+.4f}",
                     f"{v['auc_vs_fixed']:+.4f}", f"{rand:+.4f}"))  # fmt: skip
    return table(header, rows)


def _draw(ms: list[dict[str, Any]], axes: Any) -> None:
    """Accuracy and loss against decode FLOPs per token (log2 axis: a doubling is one step), per L_max."""
    for m in ms:
        full = run_flops(m["run"], m["top"])
        fixed = sorted((p.relative_compute * full, p.loss, p.accuracy) for p in m["sweep"].fixed)
        ada = sorted((r.relative_compute * full, r.loss, r.accuracy) for r in m["sweep"].adaptive)
        for ax, k in zip(axes, (2, 1), strict=True):
            line = ax.plot([p[0] for p in fixed], [p[k] for p in fixed], "--o", ms=3, label=f"fixed L_max={m['top']}")
            ax.plot([p[0] for p in ada], [p[k] for p in ada], "-s", ms=3, color=line[0].get_color(),
                    label=f"adaptive L_max={m['top']}")  # fmt: skip
    for ax, label in zip(axes, ("next-token accuracy", "held-out loss (nats/token)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="decode FLOPs per token (log2)", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)


def _reading(ms: list[dict[str, Any]], per: dict[str, dict[str, float]]) -> list[str]:
    out = []
    for m in ms:
        v = per[m["run"].name]
        out.append(
            f"L_max = {m['top']} ({m['run'].name}): accuracy per doubling of decode compute "
            f"{v['acc_per_doubling_adaptive']:+.2f} points adaptive vs {v['acc_per_doubling_fixed']:+.2f} fixed depth "
            f"(Δ {v['acc_per_doubling_gain']:+.2f}); loss per doubling {v['loss_per_doubling_adaptive']:+.4f} vs "
            f"{v['loss_per_doubling_fixed']:+.4f} nats; adaptive minus fixed-depth AUC {v['auc_vs_fixed']:+.4f} nats; "
            f"fixed depth at L_max {v['fixed_loss_at_l_max']:.4f}."
            + (
                f" Against the control ({control(m['top'])}, uniform depth on the same tokens): accuracy per doubling "
                f"{v['acc_per_doubling_control']:+.2f} points, the decider's frontier {v['frontier_vs_control']:+.4f} "
                f"nats at the same compute (against the base: {v['frontier_vs_base']:+.4f})."
                if "acc_per_doubling_control" in v and "frontier_vs_control" in v
                else ""
            )
        )
    if len(ms) > 1:
        first, last = per[ms[0]["run"].name], per[ms[-1]["run"].name]
        out.append(
            f"From L_max = {ms[0]['top']} to {ms[-1]['top']}: fixed-depth loss at L_max "
            f"{first['fixed_loss_at_l_max']:.4f} → {last['fixed_loss_at_l_max']:.4f}, best adaptive loss "
            f"{first['adaptive_best_loss']:.4f} → {last['adaptive_best_loss']:.4f}, adaptive minus fixed AUC "
            f"{first['auc_vs_fixed']:+.4f} → {last['auc_vs_fixed']:+.4f} nats."
        )
    return out


def _method(ms: list[dict[str, Any]]) -> list[str]:
    return [
        "Each base-L<k> job is the `decider` set's late-switch base with model.loops = k/2 (flatten 2: L_max = k "
        "passes of one core layer of 8 experts; one attention per pass); each decider-L<k> job post-trains TaH2's "
        "decider jointly with that base under per-token depth (`decider.backbone: per_token`, the `decider` set's "
        f"decider-per-token.yaml), on the base's {ms[0]['run'].tokens:,} tokens in the same order.",
        "Each decider checkpoint is measured as in the `decider` experiment (teacher-forced, per-loop KV: a threshold "
        "sweep, fixed depth ℓ = 1..L_max on the same checkpoint, random stopping). TaH2's measure, \"the "
        'accuracy-compute slope ... as test-time decoding FLOPs double": the least-squares slope of next-token '
        "accuracy (points) and of loss (nats) against log2 of decode compute, for fixed depth (ℓ = 1..L_max) and "
        "for the adaptive sweep (its ends are ℓ = 1 and ℓ = L_max), and adaptive minus fixed.",
        "Each uniform-L<k> job is the control: the `decider` set's decider-uniform.yaml on base-L<k> (the same "
        "tokens in the same order, the backbone post-trained at every depth, `decider.lm_loss: every_exit`). Its "
        "fixed depth ℓ = 1..L_max is what the claims compare adaptive depth with: the decider's backbone saw the "
        "base's tokens a second time, and against the base itself the frontier would gain what any post-training "
        "gains. The tables' 'fixed' slope is the decider's own backbone forced to ℓ, which per-token post-training "
        "leaves worse at full depth than at ℓ = 1; 'control' is the control's.",
        "The decider's own FLOPs are not counted (as in `decider`). L_max = 8 is the largest depth in the set; a "
        "set without it decides the depth-growth claim on its deepest arm.",
    ]


def control_fixed(ctx: Context, depth: int) -> tuple[Any, ...] | None:
    """Fixed depth ℓ = 1..L_max (loss and accuracy, teacher-forced, per-loop KV as the decider's sweep) of the
    control run ``uniform-L<depth>``; None when the set has no such job."""
    from elastic_pretrain.eval.adaptive import adaptive_sweep

    if control(depth) not in {r.name for r in ctx.runs}:
        return None
    model = ctx.model(control(depth))
    if model.decider is None:
        raise UserError(f"{ctx.run(control(depth)).run_dir}: the control's checkpoint holds no iteration decider")
    return adaptive_sweep(model, model.decider, ctx.val_tokens(), ()).fixed


def analyse(ctx: Context) -> Findings:
    controls = {control(d) for d in DEPTHS}
    ms = sorted((measure(ctx, r) for r in decider_runs(ctx) if r.name not in controls), key=lambda m: m["top"])
    for m in ms:
        m["control_fixed"] = control_fixed(ctx, m["top"])
    per = {m["run"].name: depth_metrics(m) for m in ms}
    return Findings(
        tables=[
            _depth_table(ms, per),
            *(f"**{m['run'].name}** (L_max = {m['top']})\n\n{m['sweep'].markdown()}" for m in ms),
        ],
        reading=_reading(ms, per),
        numbers={
            "depths": {
                m["run"].name: {"l_max": m["top"], "base": m["base"].name, **per[m["run"].name], **sweep_numbers(m)}
                for m in ms
            }
        },
        metrics=per,
        plot=lambda path: figure(path, lambda axes: _draw(ms, axes), panels=2),
        method=_method(ms),
    )


def depth_pays(depth: int) -> Claim:
    """The premise at one L_max: the base's fixed depth at ℓ = L_max below ℓ = 1 (same checkpoint)."""
    return Claim(
        paper=f'adaptive depth presupposes that depth pays (L_max = {depth}): "As the maximum allowed iteration '
        'depth grows, existing looped models mostly plateau" — after gaining',
        source=TAH2,
        magnitude="TaH2's looped backbones gain with depth",
        measure=f"base-L{depth}: fixed-depth loss at ℓ = {depth} minus at ℓ = 1, same checkpoint (nats)",
        value=lambda ms: ms[arm(depth)]["base_depth_gain"],
        expect="negative",
        kind="premise",
    )


PREMISES = {d: depth_pays(d) for d in DEPTHS}  # rows of the table and the premises of the claims at each L_max
FRONTIER = (
    "on the loss–compute Pareto frontier of the thresholds the decider decides (forced ends and dominated "
    "thresholds dropped), the mean of adaptive minus the fixed-depth loss at the same compute of uniform-L{k}, "
    "its base post-trained on the same tokens at every depth (nats)"
)


def _slope_claim(depth: int) -> Claim:
    return Claim(
        paper='"TaH2 improves the accuracy-compute slope by 53% over the non-looped baseline"; '
        f'"every doubling of test-time compute buys roughly half again as much accuracy" (L_max = {depth})',
        source=TAH2,
        magnitude="slope 2.74 vs 1.79 points per doubling on AIME",
        measure=f"L_max = {depth}: {FRONTIER.format(k=depth)}",
        value=lambda ms: ms[arm(depth)]["frontier_vs_control"],
        expect="negative",
        premise=PREMISES[depth],
    )


BOTH_PAY = Claim(
    paper="adaptive depth presupposes that depth pays at L_max = 2 and at the deepest L_max",
    source=TAH2,
    magnitude="TaH2's looped backbones gain with depth",
    measure="the larger of the base's fixed-depth loss at ℓ = L_max minus at ℓ = 1 at L_max = 2 and at the deepest "
    "L_max (nats)",
    value=_both_pay,
    expect="negative",
    kind="premise",
)
EXPERIMENT = Experiment(
    name="decider-depths",
    title="TaH2's L_max sweep: the joint per-token decider at L_max 2, 4, 8, accuracy per doubling of decode compute",
    question="TaH2 post-trains its decider jointly with looped backbones of growing maximum depth. Here the joint "
    "per-token decider is post-trained on ELR late-switch bases of L_max = 2, 4 and 8 (same width, data and "
    "tokens). At each L_max: does adaptive depth buy more accuracy (less loss) per doubling of decode compute than "
    "fixed depth, and does its advantage over fixed depth grow with L_max while fixed depth plateaus? The claims "
    "read each decider's Pareto frontier against the fixed depth of a control post-trained on the same tokens at "
    "every depth (uniform-L<k>), and presuppose that depth pays on each base (their rows).",
    analyse=analyse,
    rescore=rescore,
    claims=(
        *(c for d in DEPTHS for c in (PREMISES[d], _slope_claim(d))),
        BOTH_PAY,
        Claim(
            paper='"As the maximum allowed iteration depth grows, existing looped models mostly plateau. TaH2 keeps '
            'gaining"',
            source=TAH2,
            magnitude="+2.8 points over the baseline at depth 2, +3.9 at depth 8 (AIME)",
            measure="adaptive minus the control's fixed depth on the Pareto frontier (as above) at the deepest L_max "
            "minus the same at L_max = 2 (nats)",
            value=_gain_growth,
            expect="negative",
            premise=BOTH_PAY,
        ),
    ),
)
