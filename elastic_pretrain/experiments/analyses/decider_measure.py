"""decider, measured: one decider run's threshold sweep, random-stopping control and per-run paired differences
(:func:`measure`), the compute-matched comparison of every decider run against the base model's fixed depth
over one common compute range (:func:`matched`), and the Pareto-frontier scores the claims read
(:func:`frontier_scores`), computed from the stored numbers of a run so that ``--from-json`` recomputes them."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from elastic_pretrain.errors import UserError
from elastic_pretrain.experiments.measure import losses
from elastic_pretrain.experiments.runner import Context, Run, base_job

RANDOM_STOP = (0.1, 0.25, 0.5, 0.75)  # the control: each pass, stop with this probability regardless of the token
LAST_LOOP_THRESHOLDS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.8, 1.01)  # the last-loop sweep runs token by token: fewer


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


def decider_runs(ctx: Context) -> list[Run]:
    runs = [r for r in ctx.runs if r.job.decider is not None]
    if not runs:
        raise UserError(f"experiment {ctx.experiment.name}: no decider job in this set (decider.init_from: <job>.yaml)")
    return runs


def measure(ctx: Context, run: Run) -> dict[str, Any]:
    """The sweep, the control and every paired difference of one decider run, on its checkpoint and the
    same held-out tokens as every other run."""
    from elastic_pretrain.eval.adaptive import DEFAULT_THRESHOLDS, adaptive_sweep
    from elastic_pretrain.eval.curves import compare

    base = ctx.run(base_job(run.job_path) or ctx.runs[0].name)
    tokens, model = ctx.val_tokens(), ctx.model(run.name)
    if model.decider is None or run.job.decider is None:
        raise UserError(f"{run.run_dir}: the decider job's checkpoint holds no iteration decider")
    sweep = adaptive_sweep(model, model.decider.eval(), tokens, (0.0, 0.5, 1.01) if ctx.quick else DEFAULT_THRESHOLDS)
    # the cache generate serves with (issue 32 item 3): token by token, so fewer thresholds
    last = adaptive_sweep(model, model.decider, tokens, (0.0, 0.5, 1.01) if ctx.quick else LAST_LOOP_THRESHOLDS,
                          kv_cache="last-loop")  # fmt: skip
    control = [random_stop(model, tokens, q) for q in ((0.5,) if ctx.quick else RANDOM_STOP)]
    for c in control:
        c["fixed_loss"], c["fixed_accuracy"] = sweep.fixed_at(c["relative_compute"])
    top = model.cfg.max_loops
    # the sweep's ends are fixed depth itself (threshold 0: ℓ = L_max; above 1: ℓ = 1): compare the inside
    inner = [r for r in sweep.adaptive if 1.0 + 1e-6 < r.mean_passes < top - 1e-6]
    ends = [(r.relative_compute, r.loss) for r in (sweep.adaptive[0], sweep.adaptive[-1])]
    rand = [*ends, *((c["relative_compute"], c["loss"]) for c in control)]
    base_loss = losses(ctx, base)  # the base run's own checkpoint: a frozen backbone must match it
    return {
        "run": run,
        "backbone": run.job.decider.backbone,
        "base": base,
        "sweep": sweep,
        "last_loop": last,
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


def run_metrics(m: dict[str, Any]) -> dict[str, float]:
    """One decider run's per-seed metrics against its own checkpoint's fixed depth and random stopping."""
    cmp, inner = m["cmp"], [r.threshold for r in m["inner"]]
    out = {"auc_vs_fixed": cmp.aucs[1] - cmp.aucs[0]}
    if inner:
        out["minus_fixed"] = statistics.fmean(m["delta"][t] for t in inner)
        out["minus_random"] = statistics.fmean(m["vs_random"][t] for t in inner)
    return out


def matched(
    base_curve: Any, adaptive: dict[str, Any], control: Any | None = None
) -> tuple[Any, dict[str, dict[str, float]]]:
    """Every decider run's adaptive curve, the base model's fixed-depth curve and (``control``) the fixed-depth
    curve of a backbone post-trained on the same tokens at uniform depth: AUC of loss over relative compute on
    the range they all cover. Per run ``auc_matched`` (comparable between runs), ``auc_vs_base`` = that minus
    the base's fixed depth (what adaptive depth replaces when the backbone is frozen) and, with a control,
    ``auc_vs_control`` = that minus the control's fixed depth (a post-trained backbone against one that saw the
    same extra tokens without per-token depth)."""
    from elastic_pretrain.eval.curves import compare

    names = list(adaptive)
    fixed = [base_curve] if control is None else [base_curve, control]
    cmp = compare([*fixed, *(adaptive[n] for n in names)])
    out = {
        n: {"auc_matched": a, "auc_vs_base": a - cmp.aucs[0]}
        for n, a in zip(names, cmp.aucs[len(fixed) :], strict=True)
    }
    if control is not None:
        for n in names:
            out[n]["auc_vs_control"] = out[n]["auc_matched"] - cmp.aucs[1]
    return cmp, out


def base_curve(m: dict[str, Any]) -> Any:
    """Fixed depth ℓ = 1..L_max of the base run's own checkpoint, at the relative compute of each ℓ."""
    from elastic_pretrain.eval.curves import CurvePoint, QualityCurve

    pts = tuple(CurvePoint(p.loops, p.relative_compute, m["base_loss"][p.loops]) for p in m["sweep"].fixed)
    return QualityCurve(name=f"fixed depth ({m['base'].name})", points=pts)


# ---------------------------------------------------------------------------------------------------
# Pareto-frontier scores (issue 32): adaptive depth judged on the operating points a user would choose
Curve = list[tuple[float, float]]


def reachable(adaptive: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """The sweep's points the decider decides: 1 < mean passes < L_max. Threshold 0 forces every token to
    L_max and a threshold above 1 forces ℓ = 1 (as does any threshold where the decider stops every token after
    one pass): those are fixed depth, not a decision, and an AUC over them credits fixed depth to the decider."""
    return [r for r in adaptive if 1.0 + 1e-6 < float(r["mean_passes"]) < top - 1e-6]


def frontier_scores(run: dict[str, Any], refs: dict[str, Curve]) -> dict[str, float]:
    """One decider run's scores from its stored numbers (``fixed``, ``adaptive``, ``random_stop``: the
    analysis's ``numbers["deciders"][run]``): on the loss–compute Pareto frontier of its reachable points
    (:func:`reachable`, dominated points dropped: ``eval/curves.py pareto_front``), the mean of adaptive minus
    each reference curve at the same compute (``frontier_vs_<ref>``, nats; its own checkpoint's fixed depth as
    ``own_fixed``, random stopping with the sweep's ends as ``random``); the same on the accuracy frontier
    against its own fixed depth (``acc_frontier_vs_own_fixed``, points); its own fixed depth's loss at L_max
    minus at ℓ = 1 (``own_depth_gain``). No reachable point (every threshold forced): no frontier scores."""
    from elastic_pretrain.eval.curves import frontier_gap, pareto_front

    fixed = {int(p["loops"]): p for p in run["fixed"]}
    top = max(fixed)
    ada = run["adaptive"]
    ends = [(float(r["relative_compute"]), float(r["loss"])) for r in (ada[0], ada[-1])]  # ℓ = L_max, ℓ = 1
    curves = {
        "own_fixed": [(float(p["relative_compute"]), float(p["loss"])) for p in fixed.values()],
        "random": [*ends, *((float(c["relative_compute"]), float(c["loss"])) for c in run["random_stop"])],
        **refs,
    }
    pts = [(float(r["relative_compute"]), float(r["loss"])) for r in reachable(ada, top)]
    out = {"own_depth_gain": float(fixed[top]["loss"]) - float(fixed[1]["loss"]), "frontier_points": 0.0}
    if not pts:
        return out
    out["frontier_points"] = float(len(pareto_front(pts)))
    out.update({f"frontier_vs_{name}": frontier_gap(pts, curve) for name, curve in curves.items()})
    acc = [(float(r["relative_compute"]), -float(r["accuracy"])) for r in reachable(ada, top)]
    own_acc = [(float(p["relative_compute"]), -float(p["accuracy"])) for p in fixed.values()]
    out["acc_frontier_vs_own_fixed"] = -100.0 * frontier_gap(acc, own_acc)  # points, higher is better
    out.update(last_loop_scores(run))
    return out


def last_loop_scores(run: dict[str, Any]) -> dict[str, float]:
    """Under the last-loop cache (``run["last_loop"]``, stored since issue 32; absent before): the frontier of the
    reachable thresholds minus the same checkpoint's fixed depth under the same cache (``last_loop_frontier_vs_
    own_fixed``, nats) and its fixed depth's loss at L_max minus at ℓ = 1 (``last_loop_depth_gain``)."""
    from elastic_pretrain.eval.curves import frontier_gap

    sweep = run.get("last_loop")
    if not sweep:
        return {}
    fixed = {int(p["loops"]): p for p in sweep["fixed"]}
    top = max(fixed)
    out = {"last_loop_depth_gain": float(fixed[top]["loss"]) - float(fixed[1]["loss"])}
    pts = [(float(r["relative_compute"]), float(r["loss"])) for r in reachable(sweep["adaptive"], top)]
    if pts:
        own = [(float(p["relative_compute"]), float(p["loss"])) for p in fixed.values()]
        out["last_loop_frontier_vs_own_fixed"] = frontier_gap(pts, own)
    return out


def fixed_curve(losses_by_loops: dict[Any, Any], run: dict[str, Any]) -> Curve:
    """A base run's fixed depth (``{ℓ: loss}``, keys int or, from JSON, str) at the relative compute of each ℓ
    on ``run``'s sweep (same model shape)."""
    rel = {int(p["loops"]): float(p["relative_compute"]) for p in run["fixed"]}
    return [(rel[int(k)], float(v)) for k, v in losses_by_loops.items() if int(k) in rel]
