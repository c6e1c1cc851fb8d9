"""decider: TaH2 iteration deciders (adaptive depth) — frozen backbone and joint post-training under per-token
depth — vs fixed depth at matched mean passes, with random per-token stopping as the control. The measuring
is in ``decider_measure.py``.

The claims (issue 32) score adaptive depth on the Pareto frontier of the operating points each decider reaches
(forced ends and dominated thresholds dropped), and every one presupposes that depth pays here: the base's
fixed depth at ℓ = L_max below ℓ = 1 on the same checkpoint (:data:`DEPTH_PAYS`). Both come from the stored
numbers (:func:`rescore`), so ``--from-json`` decides them for finished runs. On a corpus whose tokens carry
their true difficulty (depth-pays) the analysis also counts each decider's passes per difficulty and their rank
correlation with it (``decider_depth_pays.py`` reads those)."""

from __future__ import annotations

import dataclasses
from typing import Any

from elastic_pretrain.data.difficulty import load_difficulty
from elastic_pretrain.eval.curves import pareto_front
from elastic_pretrain.eval.difficulty import PassesByDifficulty, passes_by_difficulty
from elastic_pretrain.experiments.analyses.decider_measure import (
    base_curve,
    decider_runs,
    fixed_curve,
    frontier_scores,
    matched,
    measure,
    reachable,
    run_metrics,
)
from elastic_pretrain.experiments.measure import run_flops
from elastic_pretrain.experiments.present import figure, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings
from elastic_pretrain.experiments.stats import Claim, Metrics

TAH2 = "seeds/000 (TaH2)"
# the job names (arms) the claims read; UNIFORM is the control for PER_TOKEN: a backbone post-trained on the same
# tokens at every depth (`decider.backbone: joint`, `decider.lm_loss: every_exit`); BASE the run they post-train
FROZEN, PER_TOKEN, UNIFORM, BASE = "decider", "decider-per-token", "decider-uniform", "late-switch"
COVERAGE = "decider-per-token-coverage"  # the labels ablation: PER_TOKEN with the coverage cut (decider.coverage 0.9)
DIFFICULTY_THRESHOLD = 0.5  # the stop threshold the passes-per-difficulty table reads (the jobs' decider.threshold)


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


def _draw(numbers: dict[str, Any], axes: Any) -> None:
    """Fixed depth, every decider's sweep (its Pareto frontier joined by a line) and random stopping, from the
    stored numbers (the report's plot, and ``--from-json``'s); one colour per run."""
    deciders = numbers["deciders"]
    first = next(iter(deciders.values()))
    base = [(x, y, float("nan")) for x, y in fixed_curve(numbers["base_loss_by_loops"], first)]
    series = [(f"fixed depth ({numbers.get('base', BASE)})", base, "-o", "C0")]
    for i, (name, d) in enumerate(deciders.items(), start=1):
        top, colour = max(int(p["loops"]) for p in d["fixed"]), f"C{i}"
        pts = [(r["relative_compute"], r["loss"], r["accuracy"]) for r in d["adaptive"]]
        front = set(pareto_front([(r["relative_compute"], r["loss"]) for r in reachable(d["adaptive"], top)]))
        series += [
            (f"thresholds ({name})", pts, "s", colour),
            (f"Pareto frontier ({name})", [p for p in pts if (p[0], p[1]) in front], "-D", colour),
            (f"random stop ({name})", [(c["relative_compute"], c["loss"], c["accuracy"]) for c in d["random_stop"]],
             "x", colour),
        ]  # fmt: skip
        if d["backbone"] != "frozen":  # a post-trained backbone has its own fixed depth
            own = [(p["relative_compute"], p["loss"], p["accuracy"]) for p in d["fixed"]]
            series.append((f"fixed depth ({name})", own, "--o", colour))
    for name, pts, style, colour in series:
        pts = sorted(pts)
        for ax, k in zip(axes, (1, 2), strict=True):
            ax.plot([p[0] for p in pts], [p[k] for p in pts], style, label=name, ms=4, color=colour, mfc="none")
    for ax, label in zip(axes, ("held-out loss (nats/token)", "next-token accuracy"), strict=True):
        ax.set(xlabel="relative compute FLOPs(mean passes) / FLOPs(L_max)", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)


def replot(numbers: dict[str, Any], path: Any) -> None:
    figure(path, lambda axes: _draw(numbers, axes), panels=2)


def rescore(numbers: dict[str, Any], metrics: Metrics) -> Metrics:
    """One seed's metrics with the Pareto-frontier scores and the premise, from its stored numbers: per decider
    run :func:`decider_measure.frontier_scores` against its own fixed depth, the base's (``frontier_vs_base``),
    the control's (``frontier_vs_control``) and random stopping, and where the corpus labels difficulty the rank
    correlation of its passes with it (``passes_rho_answers``, ``passes_rho_all``); for the base run (stored as
    ``numbers["base"]``; late-switch in reports made before it was) its fixed-depth loss at ℓ = 1 and L_max and
    their difference (``depth_gain``, the premise)."""
    deciders, base_loss = numbers.get("deciders"), numbers.get("base_loss_by_loops")
    if not deciders or not base_loss:
        return metrics
    loss = {int(k): float(v) for k, v in base_loss.items()}
    top = max(loss)
    refs = {"base": fixed_curve(base_loss, next(iter(deciders.values())))}
    if UNIFORM in deciders:
        refs["control"] = [(float(p["relative_compute"]), float(p["loss"])) for p in deciders[UNIFORM]["fixed"]]
    base = {"loss@1": loss[1], "loss@max": loss[top], "depth_gain": loss[top] - loss[1]}
    base_name = str(numbers.get("base", BASE))
    out: Metrics = {base_name: {**metrics.get(base_name, {}), **base}}
    passes = numbers.get("passes_by_difficulty", {})
    for name, d in deciders.items():
        out[name] = {**metrics.get(name, {}), **frontier_scores(d, refs), **_difficulty_metrics(passes.get(name))}
    return out


def _difficulty_metrics(stored: dict[str, Any] | None) -> dict[str, float]:
    """A decider's rank correlations of passes with true difficulty (stored ``PassesByDifficulty.to_json``)."""
    if not stored:
        return {}
    return {"passes_rho_answers": float(stored["rho_answers"]), "passes_rho_all": float(stored["rho_all"])}


def _method(ms: list[dict[str, Any]], *, with_difficulty: bool = False) -> list[str]:
    m = ms[0]
    run, base, top, fl = m["run"], m["base"], m["top"], m["decider_flops"]
    arms = ", ".join(f"{x['run'].name} (`decider.backbone: {x['backbone']}`)" for x in ms)
    out = [
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
        f"Labels: TaH2's — 'continue' exactly when one more pass lowers the token's loss (`decider.coverage: 1`, "
        f"the default) — in every decider job but {COVERAGE}, the ablation with the coverage cut (`decider.coverage: "
        "0.9`: only the largest gains, covering 90% of the total); reports made before issue 32 trained every arm "
        "with the cut (their `Jobs differ` line and run configs say which).",
        "Served: the same sweep (fewer thresholds) and fixed depth under the last-loop KV cache, token by token "
        'against the cache `generate(loops="auto")` keeps (each token\'s K/V from the last pass it ran); '
        "`last_loop_frontier_vs_own_fixed` is the frontier score under that cache.",
        "Control: the same execution with a random stop rule (each pass, each token stops with probability q, "
        "seed 0). The per-seed quantities `minus_fixed`/`minus_random` are means over the thresholds strictly "
        "between the ends.",
        "The claims (issue 32) read the Pareto frontier of each decider's sweep: of the thresholds where it decides "
        "(1 < mean passes < L_max; threshold 0 and the thresholds where every token stops after one pass are fixed "
        "depth, not a decision) the ones no other threshold beats in both compute and loss; `frontier_vs_<ref>` "
        "is the mean over those points of adaptive minus the reference curve at the same compute (`base`: the "
        "base's fixed depth, `control`: the uniform control's, `own_fixed`: its own checkpoint's, `random`: random "
        "stopping), `acc_frontier_vs_own_fixed` the same on the accuracy frontier (points). The AUCs above "
        "(which include the forced and dominated points) stay in the tables for comparison. The premise row: the "
        f"base's fixed-depth loss at ℓ = L_max minus at ℓ = 1 (`{base.name}` `depth_gain`).",
    ]
    if with_difficulty:
        out.append(
            "Passes per true difficulty: every held-out prediction's passes under each decider's stop rule at "
            f"threshold {DIFFICULTY_THRESHOLD} (teacher-forced, per-loop KV), grouped by the difficulty of the token "
            "it predicts (the corpus's stored label: lookups the answer needs; 0 = an ordinary token); ρ is "
            "Spearman's rank correlation of passes with difficulty (ties at their mean rank) over the answer tokens "
            "(`passes_rho_answers`) and over every token (`passes_rho_all`)."
        )
    return out


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
        "last_loop": {
            "fixed": [dataclasses.asdict(p) for p in m["last_loop"].fixed],
            "adaptive": [dataclasses.asdict(r) for r in m["last_loop"].adaptive],
        },
        "decider_minus_random": m["vs_random"],
        "auc": dict(zip(cmp.names, cmp.aucs, strict=True)),
        "auc_range": [cmp.lo, cmp.hi],
        "backbone_drift": m["drift"],
        "decider_flops_per_decision": m["decider_flops"],
    }


def _passes_by_difficulty(ctx: Context, ms: list[dict[str, Any]]) -> dict[str, PassesByDifficulty]:
    """Each decider's passes per true difficulty at :data:`DIFFICULTY_THRESHOLD`; {} when the held-out split
    carries no difficulty (an ordinary corpus)."""
    tokens = ctx.val_tokens()
    difficulty = load_difficulty(ctx.runs[0].job.data, num_sequences=tokens.shape[0])
    if difficulty is None:
        return {}
    out = {}
    for m in ms:
        model = ctx.model(m["run"].name)
        assert model.decider is not None  # measure() refused a decider job without one
        stop = model.decider.stopper(DIFFICULTY_THRESHOLD)
        out[m["run"].name] = passes_by_difficulty(model, stop, tokens, difficulty, threshold=DIFFICULTY_THRESHOLD)
    return out


def _difficulty_table(passes: dict[str, PassesByDifficulty]) -> str:
    levels = sorted({k for p in passes.values() for k in p.mean_passes})
    first = next(iter(passes.values()))
    label = {0: "ordinary"}
    header = (
        "decider run",
        *(f"{label.get(k, f'd={k}')} ({first.count.get(k, 0):,})" for k in levels),
        "ρ answers",
        "ρ all tokens",
    )
    rows = [(name, *p.row(levels)) for name, p in passes.items()]
    return f"Mean passes per true difficulty at threshold {DIFFICULTY_THRESHOLD} (tokens per column):\n\n" + table(
        header, rows
    )


def analyse(ctx: Context) -> Findings:
    ms = [measure(ctx, r) for r in sorted(decider_runs(ctx), key=lambda r: r.name != FROZEN)]  # frozen first
    curves = {m["run"].name: m["sweep"].curves()[1] for m in ms}  # each named "adaptive (decider)": name by run
    curves = {n: dataclasses.replace(c, name=f"adaptive ({n})") for n, c in curves.items()}
    control = next((m["sweep"].curves()[0] for m in ms if m["run"].name == UNIFORM), None)
    control = None if control is None else dataclasses.replace(control, name=f"fixed depth ({UNIFORM})")
    cmp, across = matched(base_curve(ms[0]), curves, control)
    passes = _passes_by_difficulty(ctx, ms)
    numbers = {
        "deciders": {m["run"].name: _numbers(m) for m in ms},  # not "runs": the report's run table
        "base": ms[0]["base"].name,
        "base_loss_by_loops": ms[0]["base_loss"],
        "matched": {"range": [cmp.lo, cmp.hi], "auc": dict(zip(cmp.names, cmp.aucs, strict=True))},
    }
    if passes:
        numbers["passes_by_difficulty"] = {n: p.to_json() for n, p in passes.items()}
    metrics = rescore(numbers, {m["run"].name: {**run_metrics(m), **across[m["run"].name]} for m in ms})
    return Findings(
        tables=[
            *(f"**{m['run'].name}** ({m['backbone']} backbone)\n\n{m['sweep'].markdown()}" for m in ms),
            *(
                f"**{m['run'].name}** under the last-loop cache (what `generate` serves with)\n\n"
                f"{m['last_loop'].markdown()}"
                for m in ms
            ),
            _control_table(ms),
            *([_difficulty_table(passes)] if passes else []),
        ],
        reading=[
            *(line for m in ms for line in _reading(m)),
            f"At matched compute over [{cmp.lo:.3f}, {cmp.hi:.3f}], AUC of loss: "
            + ", ".join(f"{n} {a:.4f}" for n, a in zip(cmp.names, cmp.aucs, strict=True))
            + " (lower is better).",
            *(
                f"{n}: mean passes per true difficulty at threshold {p.threshold}: "
                + ", ".join(f"{'ordinary' if k == 0 else f'd={k}'} {v:.2f}" for k, v in p.mean_passes.items())
                + f"; Spearman ρ of passes with difficulty {p.rho_answers:+.3f} over the answers, {p.rho_all:+.3f} "
                "over every token."
                for n, p in passes.items()
            ),
        ],
        numbers=numbers,
        metrics=metrics,
        plot=lambda path: replot(numbers, path),
        method=_method(ms, with_difficulty=bool(passes)),
    )


def _of(arm: str, metric: str) -> Any:
    return lambda ms: ms[arm][metric]


def _minus(a: str, b: str, metric: str) -> Any:
    return lambda ms: ms[a][metric] - ms[b][metric]


FRONTIER = (
    "on the loss–compute Pareto frontier of the thresholds it decides (forced ends, where every token runs ℓ = 1 "
    "or L_max, and dominated thresholds dropped), the mean of adaptive minus"
)
_SLOPE = 'adaptive depth beats uniform depth at matched compute: "Extra compute goes where it moves the answer"'


def depth_pays(base: str) -> Claim:
    """The premise of every claim here: depth pays on ``base``, the run the deciders post-train."""
    return Claim(
        paper="adaptive depth presupposes that depth pays: TaH2's decider labels \"whether one more iteration would "
        'improve the prediction for that token", and "Extra compute goes where it moves the answer" needs compute that '
        "moves it",
        source=TAH2,
        magnitude="TaH2's looped backbones gain with depth (the baseline's slope: 1.79 points per doubling, AIME)",
        measure=f"{base} (the base every decider post-trains): fixed-depth loss at ℓ = L_max minus at ℓ = 1, same "
        "checkpoint (nats)",
        value=_of(base, "depth_gain"),
        expect="negative",
        kind="premise",
    )


def claims_for(base: str) -> tuple[Claim, ...]:
    """The premise on ``base`` and TaH2's claims, each gated by it (the experiments differ in their base)."""
    premise = depth_pays(base)
    return (
        premise,
        Claim(
            paper=_SLOPE + ' (frozen backbone, a variant); "53% steeper accuracy-compute slope"',
            source=TAH2,
            magnitude="slope 2.74 vs 1.79 on AIME",
            measure=f"frozen decider: {FRONTIER} the base's fixed-depth loss at the same compute (nats)",
            value=_of(FROZEN, "frontier_vs_base"),
            expect="negative",
            premise=premise,
        ),
        Claim(
            paper=_SLOPE + '; the decider is "post-trained jointly with the backbone through lookahead depth '
            'supervision"',
            source=TAH2,
            magnitude="+3.4 points over the baseline's peak accuracy at matched test-time compute (AIME)",
            measure=f"joint per-token decider: {FRONTIER} the fixed depth of a backbone post-trained on the same "
            f"tokens at every depth ({UNIFORM}) (nats)",
            value=_of(PER_TOKEN, "frontier_vs_control"),
            expect="negative",
            premise=premise,
        ),
        Claim(
            paper='training under per-token depth is what helps: the decider is "post-trained jointly with the '
            'backbone", which "makes loop depth a per-token decision"',
            source=TAH2,
            magnitude="not given (TaH2 reports only the joint model)",
            measure=f"joint per-token minus {UNIFORM} (the same extra tokens at every depth, its own decider): each "
            f"one's frontier minus {UNIFORM}'s fixed depth, as above (nats)",
            value=_minus(PER_TOKEN, UNIFORM, "frontier_vs_control"),
            expect="negative",
            premise=premise,
        ),
        Claim(
            paper="joint post-training beats a frozen backbone: TaH2's decider is \"post-trained jointly with the "
            'backbone" (confounded here: the joint backbone also sees the tokens a second time; the claim above '
            "controls for that)",
            source=TAH2,
            magnitude="not given (TaH2 reports only the joint model)",
            measure="joint per-token minus frozen decider: each one's frontier minus the base's fixed depth, as above "
            "(nats)",
            value=_minus(PER_TOKEN, FROZEN, "frontier_vs_base"),
            expect="negative",
            premise=premise,
        ),
        Claim(
            paper='the decider puts passes where they help: "The decider gets online labels saying whether one more '
            'iteration would improve the prediction for that token"',
            source=TAH2,
            magnitude="not given (vs random allocation)",
            measure=f"frozen decider: {FRONTIER} random stopping's loss at the same compute (nats)",
            value=_of(FROZEN, "frontier_vs_random"),
            expect="negative",
            premise=premise,
        ),
        Claim(
            paper=_SLOPE + ' — served: ELR keeps "only the last loop\'s KV cache" at inference, and `generate` '
            "runs adaptive depth against it",
            source=TAH2,
            magnitude="not given (TaH2 does not combine the decider with a last-loop cache)",
            measure=f"joint per-token decider under the last-loop cache: {FRONTIER} its own fixed depth under the "
            "same cache at the same compute (nats)",
            value=_of(PER_TOKEN, "last_loop_frontier_vs_own_fixed"),
            expect="negative",
            premise=premise,
        ),
        Claim(
            paper='the joint decider puts passes where they help: "Extra compute goes where it moves the answer"',
            source=TAH2,
            magnitude="not given (vs random allocation)",
            measure=f"joint per-token decider: {FRONTIER} random stopping's loss (on its own backbone) at the same "
            "compute (nats)",
            value=_of(PER_TOKEN, "frontier_vs_random"),
            expect="negative",
            premise=premise,
        ),
    )


EXPERIMENT = Experiment(
    name="decider",
    title="Adaptive depth (iteration deciders, frozen and joint per-token) vs fixed depth at matched mean passes",
    question="TaH2 iteration deciders post-trained on the late-switch model — one with the backbone frozen, one "
    "jointly with the backbone under per-token depth (TaH2's post-training) — stop each token after its own "
    "number of passes. At the same mean passes per token (the same compute), is the held-out loss better than "
    "running every token at one fixed depth, better than random per-token stopping, and is the joint decider "
    "better than the frozen one and than a backbone post-trained on the same tokens at every depth? Threshold "
    "sweeps against fixed depth ℓ = 1..4 at the same relative compute, scored on each decider's Pareto frontier; "
    "every claim presupposes that depth pays on the base (its own row).",
    analyse=analyse,
    rescore=rescore,
    replot=replot,
    claims=claims_for(BASE),
)
DEPTH_PAYS = EXPERIMENT.claims[0]
