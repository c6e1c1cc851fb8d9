"""late-switch-depth-pays: ELR's late switch (``late_switch.py``'s analysis and claims) on the depth-pays corpus,
where more passes lower the loss, so "the share of the L_max improvement retained" is a share of something.

The 75% switch only (ELR's recommended schedule), with and without heads, tied (ELR as published) and untied
(the Foil×ELR extension), each with its own baseline and mixed-scratch; ``mixed-scratch`` is decider-depth-pays's
base (shared run). Beside late-switch's table: loss and accuracy on the answer tokens at ℓ = 1 and ℓ = L_max."""

from __future__ import annotations

import dataclasses

from elastic_pretrain.data.difficulty import load_difficulty
from elastic_pretrain.eval.difficulty import by_difficulty
from elastic_pretrain.experiments.analyses import late_switch as ls
from elastic_pretrain.experiments.analyses.depth_premise import arm_metrics
from elastic_pretrain.experiments.present import table
from elastic_pretrain.experiments.runner import Context, Findings

SWITCH = "0.75"
ANSWER_KEYS = ("loss[answers]", "acc[answers]", f"loss[d>={2}]", f"acc[d>={2}]")


def analyse(ctx: Context) -> Findings:
    """late-switch's findings plus each arm's answer-token loss and accuracy at ℓ = 1 and ℓ = L_max."""
    found = ls.analyse(ctx)
    tokens = ctx.val_tokens()
    labels = load_difficulty(ctx.runs[0].job.data, num_sequences=tokens.shape[0])
    if labels is None:
        raise ValueError(f"{ctx.runs[0].job.data.validation}: no per-token difficulty; use data: depth-pays")
    bases = {ls.BASE, ls.TIED + ls.BASE}
    metrics = {k: dict(v) for k, v in found.metrics.items()}
    answers: dict[str, dict[int, dict[str, float]]] = {}
    rows = []
    for r in ctx.runs:
        top = 1 if r.name in bases else r.job.model.max_loops
        tab = by_difficulty(ctx.model(r.name), tokens, labels, sorted({1, top}))
        per = {ell: {k: arm_metrics(tab, ell)[k] for k in ANSWER_KEYS} for ell in sorted({1, top})}
        answers[r.name] = per
        for ell, where in ((1, "@1"), (top, "@max")):
            for k in ANSWER_KEYS:
                metrics[r.name][k + where] = per[ell][k]
        rows.append(
            (
                r.name,
                f"{per[1]['loss[answers]']:.4f}",
                f"{per[1]['acc[answers]']:.1%}",
                "–" if r.name in bases else f"{per[top]['loss[answers]']:.4f}",
                "–" if r.name in bases else f"{per[top]['acc[answers]']:.1%}",
                "–" if r.name in bases else f"{per[top]['acc[d>=2]']:.1%}",
            )
        )
    top = ctx.run(ls.BASE).job.model.max_loops
    header = ("job", "answers loss ℓ=1", "answers acc ℓ=1", f"answers loss ℓ={top}", f"answers acc ℓ={top}",
              f"acc ℓ={top}, answers needing ≥ 2 lookups")  # fmt: skip
    deep = {r.name: metrics[r.name]["acc[answers]@max"] for r in ctx.runs if r.name not in bases}
    at_one = ", ".join(f"{b} {metrics[b]['acc[answers]@1']:.1%}" for b in sorted(bases))
    reading = [
        *found.reading,
        f"Answer-token accuracy at ℓ = {top}: "
        + ", ".join(f"{k} {v:.1%}" for k, v in sorted(deep.items(), key=lambda kv: -kv[1]))
        + f" (the baselines at ℓ = 1: {at_one}).",
    ]
    return dataclasses.replace(
        found,
        tables=[*found.tables, table(header, rows)],
        reading=reading,
        numbers={**found.numbers, "answers": answers},
        metrics=metrics,
        method=[
            *found.method,
            "Answer tokens: the held-out tokens the corpus marks as needing at least one lookup (difficulty ≥ 1, "
            "stored beside the tokens by `prepare-data depth-pays`); loss and next-token accuracy there, per arm at "
            "ℓ = 1 and at ℓ = L_max (eval/difficulty.py by_difficulty). Descriptive: the claims read all tokens, "
            "as ELR reports held-out loss.",
        ],
    )


CLAIMS = (
    # ELR as published (tied attention)
    *(ls._one_loop(ls.PUBLISHED, a) for a in (ls.SCRATCH, f"switch-{SWITCH}")),
    ls.LOOPS_HELP_TIED,
    ls._retained(ls.PUBLISHED, SWITCH, ls.LOOPS_HELP_TIED),
    *ls._five_loop(ls.PUBLISHED, ls.LOOPS_HELP_TIED),
    # the Foil×ELR extension (untied per-pass attention)
    *(ls._one_loop(ls.EXTENSION, a) for a in (ls.SCRATCH, f"switch-{SWITCH}")),
    ls.LOOPS_HELP,
    ls._retained(ls.EXTENSION, SWITCH, ls.LOOPS_HELP),
    *ls._five_loop(ls.EXTENSION, ls.LOOPS_HELP),
    *(c for c in ls.EXPERIMENT.claims if c.kind == "implementation check"),
)

EXPERIMENT = dataclasses.replace(
    ls.EXPERIMENT,
    name="late-switch-depth-pays",
    title="ELR's 75% late switch on the depth-pays corpus: tied (as published) and untied (Foil×ELR)",
    question="The bare looped core on the depth-pays corpus (where ℓ = 4 beats ℓ = 1: depth-premise-long), "
    "3,000 steps: ELR's non-recurrent baseline matched at ℓ = 1, mixed depth from scratch, and the switch from one "
    "loop to mixed depth at 75% of the tokens with and without zero-init loop-count conditioning heads, once with "
    "weight-tied loops (`tied-*`: ELR as published) and once with Foil's per-pass attention (the Foil×ELR "
    "extension). The one-loop gap to the baseline, the share of the L_max improvement retained, the five-loop "
    "comparisons, and training compute relative to the baseline.",
    analyse=analyse,
    claims=CLAIMS,
)
