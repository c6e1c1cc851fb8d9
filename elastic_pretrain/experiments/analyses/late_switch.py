"""late-switch as ELR designs it: a non-recurrent baseline matched at ℓ = 1, mixed depth from scratch, and
switches from one loop at 25/50/75% of the tokens with and without the loop-count conditioning heads.

The baseline is the looped model trained at ℓ = 1 (one core pass's parameters and compute), and the arms are
paired with it and with each other by seed. ELR's loops are weight-tied, so the ``tied-*`` arms are ELR as
published; the untied arms (Foil's per-pass attention, three of four blocks untrained until the switch) are
the Foil×ELR extension, labelled so (issue 32 item 3).
docs/experiments.md, the late-switch paragraphs at the top.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from elastic_pretrain.eval.curves import CurvePoint
from elastic_pretrain.experiments.measure import (
    losses,
    parameters,
    run_flops,
    steps_apart_before_switch,
    training_compute,
)
from elastic_pretrain.experiments.present import QualityCurve, plot_curves, ranked, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings, Run
from elastic_pretrain.experiments.stats import Claim, Metrics, paired

ELR = "seeds/003 (ELR)"
BASE, SCRATCH = "baseline", "mixed-scratch"
TIED = "tied-"  # prefix of the arms with model.attention: tied (ELR as published), each paired with its tied-* refs
SWITCHES = ("0.25", "0.50", "0.75")
RETAINED = {"0.25": 0.97, "0.50": 0.90, "0.75": 0.84}  # ELR: share of the five-loop improvement kept
ONE_LOOP_BAND = 0.01  # nats: "matches" at ℓ = 1 (ELR's 0.5B: 1.6774 vs 1.6852, 0.008 apart)
SHARE_BAND = 0.10  # ±10 percentage points around ELR's retained share
ADDED_BAND = 0.05  # ±5 points around ELR's added-compute ratio 20% / 79%
NOHEADS = "-noheads"
SWITCH_PREFIXES = ("switch-", TIED + "switch-")
APART = "steps apart before the switch"  # an arm with heads vs its -noheads twin (measure.steps_apart_before_switch)


def references(arm: str) -> tuple[str, str]:
    """The (baseline, mixed-scratch) an arm is measured against: the tied ones for a ``tied-*`` arm."""
    prefix = TIED if arm.startswith(TIED) else ""
    return prefix + BASE, prefix + SCRATCH


def share_retained(arm: str) -> Callable[[Metrics], float]:
    """(baseline@1 − arm@L_max) / (baseline@1 − mixed-scratch@L_max): the share of the L_max improvement kept
    (the arm's own references: :func:`references`)."""
    base, scratch = references(arm)

    def value(m: Metrics) -> float:
        gain = m[base]["loss@1"] - m[scratch]["loss@max"]
        return (m[base]["loss@1"] - m[arm]["loss@max"]) / gain if gain else math.nan

    return value


def minus(fn: Callable[[Metrics], float], target: float) -> Callable[[Metrics], float]:
    return lambda m: fn(m) - target


def added_compute_ratio(m: Metrics) -> float:
    """switch-0.75's added training compute over the baseline, as a share of mixed-scratch's (ELR: ~20/79)."""
    added = m[SCRATCH]["compute"] - 1.0
    return (m["switch-0.75"]["compute"] - 1.0) / added if added else math.nan


def _row(ctx: Context, r: Run, metrics: Metrics, compute: tuple[float, float]) -> tuple[str, ...]:
    """One arm's row of the table, against its own references (:func:`references`)."""
    m, (base, scratch) = metrics[r.name], references(r.name)
    is_base = r.name == base
    share = math.nan if is_base or scratch not in metrics else share_retained(r.name)(metrics)
    no_gain = scratch in metrics and metrics[base]["loss@1"] <= metrics[scratch]["loss@max"]  # no share to keep
    return (
        r.name,
        r.job.model.attention,
        "–" if is_base else f"{r.job.schedule.switch_at:g}",
        "on" if r.job.model.loop_conditioning else "off",
        f"{m['loss@1']:.4f}",
        f"{m['loss@1'] - metrics[base]['loss@1']:+.4f}",
        "–" if is_base else f"{m['loss@max']:.4f}",
        "–" if math.isnan(share) else "– (no gain)" if no_gain else f"{share:.0%}",
        f"{compute[0]:.2f}",
        f"{compute[1]:.3e}",
        f"{m['compute']:.2f}x",
        f"{parameters(ctx, r):,}",
    )


def analyse(ctx: Context) -> Findings:
    base = ctx.run(BASE)
    bases = {BASE, TIED + BASE}  # trained at ℓ = 1 only: evaluated there
    looped = [r for r in ctx.runs if r.name not in bases]
    top = base.job.model.max_loops
    fmax = run_flops(base, top)
    loss = {r.name: losses(ctx, r, [1] if r.name in bases else None) for r in ctx.runs}
    compute = {r.name: training_compute(r) for r in ctx.runs}  # (mean passes, training FLOPs)
    base_flops = compute[BASE][1]
    metrics: Metrics = {
        r.name: {
            "loss@1": loss[r.name][1],
            "loss@max": loss[r.name][1 if r.name in bases else r.job.model.max_loops],
            "compute": compute[r.name][1] / base_flops,
        }
        for r in ctx.runs
    }
    for r in ctx.runs:  # an arm with heads against its no-heads twin: the pairing the heads rows read
        if r.name.startswith(SWITCH_PREFIXES) and not r.name.endswith(NOHEADS) and r.name + NOHEADS in ctx.by_name:
            metrics[r.name][APART] = steps_apart_before_switch(r, ctx.run(r.name + NOHEADS))
    rows = [_row(ctx, r, metrics, compute[r.name]) for r in ctx.runs]
    header = ("job", "attention", "switch at", "heads", "loss ℓ=1", "ℓ=1 minus its baseline", f"loss ℓ={top}",
              "L_max improvement retained", "mean passes", "training FLOPs", "vs baseline", "parameters")  # fmt: skip
    curves = [
        QualityCurve(
            name=r.name,
            points=tuple(
                CurvePoint(loops=e, relative_compute=run_flops(r, e) / fmax, loss=v) for e, v in loss[r.name].items()
            ),
            flops_max=fmax,
        )
        for r in ctx.runs
    ]
    deep = {r.name: metrics[r.name]["loss@max"] for r in looped}
    reading = [
        f"Loss at ℓ = {top}, lowest first: {ranked(deep)}.",
        "Loss at ℓ = 1, lowest first: " + ranked({r.name: metrics[r.name]["loss@1"] for r in ctx.runs}) + ".",
        "Training compute relative to the baseline (same tokens): "
        + ", ".join(f"{r.name} {metrics[r.name]['compute']:.2f}x" for r in looped)
        + ".",
    ]
    return Findings(
        tables=[table(header, rows)],
        reading=reading,
        numbers={
            "loss_by_loops": loss,
            "training_compute": {k: {"mean_passes": p, "flops": f} for k, (p, f) in compute.items()},
            "flops_per_token": {r.name: {e: run_flops(r, e) for e in loss[r.name]} for r in ctx.runs},
        },
        metrics=metrics,
        plot=lambda path: plot_curves(curves, path, title=f"held-out loss vs FLOPs/token (relative to ℓ = {top})"),
        method=[
            "Baseline: the looped model trained at ℓ = 1 for the whole run (`sampler: fixed`, `fixed_loops: 1`), "
            "never switched and without conditioning heads: prelude, pass 0's attention and the 8-expert MoE "
            "layer, coda — one core pass's parameters and compute on the same tokens. ELR's loops are weight-tied, "
            'so its non-recurrent baseline "matched in parameters, data, and training horizon" is its one-loop '
            "model; here passes 1..3 have their own (flattened) attention, which the baseline never runs. The "
            "`-noheads` arms' one-loop phase is this run's first steps (same initialisation, tokens and ℓ); arms with "
            "heads share the tokens, ℓ and every other parameter's initial value (the heads draw from a forked RNG), "
            "and — the heads being off and kept out of the optimizer step until the switch (train/idle.py) — train "
            "their twin's path to the last bit until then: the twin rows count the fixed-phase steps whose logged "
            "training loss differs (runs trained before that fix parted by float rounding within ~30 steps).",
            "Attention: the `tied-*` arms (`model.attention: tied`, one attention run by every pass) are ELR as "
            "published, whose loops are weight-tied; each is measured against `tied-baseline` and "
            "`tied-mixed-scratch` (the tied model draws fewer attention blocks, so its other initial values differ "
            "from the untied arms'). The untied arms give each pass its own attention (Foil, seeds/000: \"Each pass "
            'gets its own attention parameters while the experts and routers stay shared"), so the one-loop phase '
            "leaves passes 1..3's attention untrained until the switch copies pass 0's into them: their claims are "
            "the Foil×ELR extension, not ELR's recipe, and say so in their source.",
            "L_max improvement retained = (baseline at ℓ = 1 − arm at ℓ = L_max) / (baseline at ℓ = 1 − "
            "mixed-scratch at ℓ = L_max). ELR's 97/90/84% are for switches without conditioning (with it, the 75% "
            "switch beats mixed-scratch), so those claims read the `-noheads` arms; mixed-scratch has the heads.",
            "Training compute = 3 x forward FLOPs summed over the training tokens at each micro-batch's depth, "
            "replayed from the seed (experiments/measure.py training_compute), divided by the baseline's.",
        ],
    )


@dataclasses.dataclass(frozen=True)
class Reading:
    """Which arms a block of claims reads and how its source names them (module docstring)."""

    prefix: str  # of the arms' job names: "tied-" (ELR as published) or "" (the Foil×ELR extension)
    source: str

    def arm(self, name: str) -> str:
        return self.prefix + name


PUBLISHED = Reading(TIED, f"{ELR} as published: weight-tied loops, the tied-* arms (model.attention: tied)")
EXTENSION = Reading(
    "", f"{ELR} on Foil's untied per-pass attention (seeds/000): the Foil×ELR extension, not ELR's recipe"
)


def _one_loop(r: Reading, arm: str) -> Claim:
    arm, base = r.arm(arm), r.arm(BASE)
    return Claim(
        paper='No one-loop tax: "a single checkpoint now matches a non-recurrent baseline trained on the same '
        'data at one loop"',
        source=r.source,
        magnitude=f"one-loop loss 1.6774 vs baseline 1.6852 (0.5B); counted as matching within ±{ONE_LOOP_BAND} nat",
        measure=f"{arm} minus {base} at ℓ = 1 (nats)",
        value=paired(arm, base, "loss@1"),
        expect="equal",
        margin=ONE_LOOP_BAND,
    )


def _loops_help(r: Reading) -> Claim:
    scratch, base = r.arm(SCRATCH), r.arm(BASE)
    return Claim(
        paper='Loops pay at full depth: "four loops adding 7.25 and 4.75 points"; the premise of every "share of '
        'the five-loop improvement over the baseline" and of the five-loop comparisons below',
        source=r.source,
        magnitude="0.5B: five-loop loss 1.6273 (mixed depth from scratch) vs baseline 1.6852 (−0.058 nat)",
        measure=f"{scratch} at ℓ = L_max minus {base} at ℓ = 1 (nats)",
        value=lambda m: m[scratch]["loss@max"] - m[base]["loss@1"],
        expect="negative",
    )


LOOPS_HELP = _loops_help(EXTENSION)  # the premise of the untied arms' quality claims
LOOPS_HELP_TIED = _loops_help(PUBLISHED)  # and of the tied arms': each attention's loops must pay on their own


def _twins(r: Reading) -> Claim:
    """The heads rows compare an arm with heads and its no-heads twin: before the switch the heads are off, so
    the two must train the same path (train/idle.py keeps the idle heads out of the optimizer step)."""
    heads = r.arm("switch-0.75")
    return Claim(
        paper='"conditioning heads initialized to zero at the switch": off before it, so the arm with heads is its '
        "no-heads twin until then — the pairing the heads rows read",
        source=r.source,
        magnitude="0 steps apart",
        measure=f"{heads} vs {heads}{NOHEADS}: fixed-phase steps whose logged training loss differs (history.jsonl)",
        value=lambda m: m[heads][APART],
        expect="equal",
        kind="implementation check",
    )


TWINS, TWINS_TIED = _twins(EXTENSION), _twins(PUBLISHED)


def _retained(r: Reading, frac: str, premise: Claim) -> Claim:
    arm = r.arm(f"switch-{frac}-noheads")
    return Claim(
        paper=f'"switching after 25%, 50%, and 75% of tokens retained 97%, 90%, and 84% of the five-loop '
        f'improvement over the baseline" (here: {float(frac):.0%})',
        source=r.source,
        magnitude=f"{RETAINED[frac]:.0%} retained; counted as matching within ±{SHARE_BAND:.0%}",
        measure=f"{arm}: share of {r.arm(SCRATCH)}'s ℓ = L_max improvement over {r.arm(BASE)} retained, minus "
        f"{RETAINED[frac]:.2f}",
        value=minus(share_retained(arm), RETAINED[frac]),
        expect="equal",
        margin=SHARE_BAND,
        premise=premise,  # a share of an improvement the looped model does not make is meaningless
    )


def _five_loop(r: Reading, premise: Claim) -> tuple[Claim, ...]:
    """The 75% switch at L_max against mixed-scratch, with and without heads, and the heads' share."""
    heads, noheads, scratch = r.arm("switch-0.75"), r.arm("switch-0.75-noheads"), r.arm(SCRATCH)
    beats = (
        '"conditioning heads initialized to zero at the switch make that late schedule beat mixed-depth training '
        'from scratch"'
    )
    return (
        Claim(
            paper='"at the 75% switch the five-loop loss rose by 0.009" (without conditioning, vs mixed depth '
            "from scratch)",
            source=r.source,
            magnitude="+0.009 nat at five loops",
            measure=f"{noheads} minus {scratch} at ℓ = L_max (nats)",
            value=paired(noheads, scratch, "loss@max"),
            expect="positive",
            premise=premise,  # a five-loop quality the late switch costs presupposes loops that add quality
        ),
        Claim(
            paper=beats,
            source=r.source,
            magnitude="five-loop loss 1.6147 vs 1.6273 (−0.0126 nat)",
            measure=f"{heads} minus {scratch} at ℓ = L_max (nats)",
            value=paired(heads, scratch, "loss@max"),
            expect="negative",
            premise=premise,  # where loops add nothing, more one-loop steps win at every ℓ for that reason alone
        ),
        Claim(
            paper=beats + " (the heads' share: with vs without them at the 75% switch)",
            source=r.source,
            magnitude="1.6147 with vs ≈1.6363 without (1.6273 + 0.009): ≈ −0.022 nat, implied",
            measure=f"{heads} minus {noheads} at ℓ = L_max (nats)",
            value=paired(heads, noheads, "loss@max"),
            expect="negative",
            premise=premise,  # heads that condition on the loop count help only where the loop count matters
        ),
    )


EXPERIMENT = Experiment(
    name="late-switch",
    title="Late switch from one loop vs mixed depth from scratch vs the non-recurrent baseline (ELR)",
    question="ELR's design: a non-recurrent baseline matched at ℓ = 1 (the model's one core pass, same tokens), "
    "mixed depth from scratch, and switches from one loop to mixed depth at 25/50/75% of the tokens with and "
    "without zero-init loop-count conditioning heads. ELR as published ties its loops' weights: the `tied-*` arms "
    "(tied attention; the 75% switch with and without heads, their own baseline and mixed-scratch); the untied "
    "arms (Foil's per-pass attention) are the Foil×ELR extension. The one-loop gap to the baseline, the share of the "
    "L_max improvement retained, and training compute relative to the baseline. How to read the numbers "
    "(hand-written, kept across reruns): [late-switch-notes.md](late-switch-notes.md).",
    analyse=analyse,
    claims=(
        # ELR as published (tied attention)
        *(_one_loop(PUBLISHED, a) for a in (SCRATCH, "switch-0.75")),
        LOOPS_HELP_TIED,
        _retained(PUBLISHED, "0.75", LOOPS_HELP_TIED),
        *_five_loop(PUBLISHED, LOOPS_HELP_TIED),
        # the Foil×ELR extension (untied per-pass attention)
        *(_one_loop(EXTENSION, a) for a in (SCRATCH, "switch-0.25", "switch-0.50", "switch-0.75")),
        LOOPS_HELP,
        *(_retained(EXTENSION, f, LOOPS_HELP) for f in SWITCHES),
        *_five_loop(EXTENSION, LOOPS_HELP),
        Claim(
            paper="\"Mixed-depth training from scratch costs an estimated 1.62 times the baseline's training "
            'compute, while switching only in the final quarter costs about 1.16 times"',
            source=EXTENSION.source,
            magnitude="1.16x vs 1.62x the baseline (−0.46)",
            measure="switch-0.75 minus mixed-scratch training FLOPs, each relative to the baseline's (replayed "
            "from the schedule: an identity of the recipe)",
            value=paired("switch-0.75", SCRATCH, "compute"),
            expect="negative",
            kind="implementation check",
        ),
        Claim(
            paper='"the 75% switch lowers the estimated added training compute from about 79% to about 20%"',
            source=EXTENSION.source,
            magnitude=f"20% / 79% = 0.25 of the added compute; counted as matching within ±{ADDED_BAND}",
            measure="switch-0.75's added training compute over the baseline as a share of mixed-scratch's, minus 0.25 "
            "(replayed from the schedule: an identity of the recipe)",
            value=minus(added_compute_ratio, 0.25),
            expect="equal",
            margin=ADDED_BAND,
            kind="implementation check",
        ),
        TWINS_TIED,
        TWINS,
    ),
)
