"""flattening: Foil's series flatten = 1, 2, 4 of a looped MoE (loops 2) with untied and tied attention, against the
unflattened looped baseline (flatten1-tied); loss and routing health.

The untied series starts at ``flatten1-untied`` (issue 32 item 3): its 4 layers x 2 passes hold 8 attention blocks
like flatten 2 (2 x 4) and flatten 4 (1 x 8), so along 1 → 2 → 4 total parameters are equal (up to one pre-MLP
norm per layer), the condition of Foil's "at equal parameters and compute" (seeds/000). Against flatten1-tied the
untied arms carry 4 more attention blocks than the baseline."""

from __future__ import annotations

import math
from typing import Any

from elastic_pretrain.experiments.measure import ROUTING_STATS, held_out_routing, losses, parameters, run_flops
from elastic_pretrain.experiments.present import figure, ranked, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings
from elastic_pretrain.experiments.stats import Claim, paired

FOIL = "seeds/000 (Foil)"
SHOWN = (*ROUTING_STATS, "entropy_norm", "confidence_norm")
REFERENCE_EXPERTS = 4  # experts per layer at flatten 1: flatten f has 4f (the design; _measure checks it)


def normalised_confidence(confidence: float, experts: int) -> float:
    """Top-1 probability rescaled so that 0 is a uniform router (1/E) and 1 a one-hot one: comparable across
    expert counts, where the raw top-1 probability falls with E at the same sharpness."""
    return (confidence - 1 / experts) / (1 - 1 / experts)


def _confidence_gain(f: int) -> Any:
    """flatten{f}-untied minus flatten{f}-tied normalised confidence, from the stored raw confidences (E = 4f)."""
    e = REFERENCE_EXPERTS * f
    return lambda m: (
        normalised_confidence(m[f"flatten{f}-untied"]["confidence"], e)
        - normalised_confidence(m[f"flatten{f}-tied"]["confidence"], e)
    )


def _measure(ctx: Context) -> dict[str, dict[str, Any]]:
    numbers: dict[str, dict[str, Any]] = {}
    for r in ctx.runs:
        m = r.job.model
        net = ctx.model(r.name)
        routing = held_out_routing(ctx, r)
        if m.experts_built != REFERENCE_EXPERTS * m.flatten:
            raise AssertionError(f"{r.name}: {m.experts_built} experts, the design has {REFERENCE_EXPERTS} x flatten")
        routing["entropy_norm"] = routing["entropy"] / math.log(m.experts_built)  # 1 = uniform over the E experts
        routing["confidence_norm"] = normalised_confidence(routing["confidence"], m.experts_built)
        numbers[r.name] = {
            "flatten": m.flatten,
            "attention": m.attention,
            "shape": f"{m.core_layers_built} x {m.experts_built} x {m.max_loops}",
            "experts": m.experts_built,
            "parameters": parameters(ctx, r),
            "expert_parameters": sum(p.numel() for n, p in net.named_parameters() if ".experts." in n),
            "flops_per_token": run_flops(r, m.max_loops),
            "loss": losses(ctx, r, [m.max_loops])[m.max_loops],
            **routing,
        }
    return numbers


def _draw(numbers: dict[str, dict[str, Any]], axes: Any) -> None:
    names = list(numbers)
    axes[0].bar(range(len(names)), [numbers[n]["loss"] for n in names], color="tab:blue")
    axes[0].set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    lo, hi = min(numbers[n]["loss"] for n in names), max(numbers[n]["loss"] for n in names)
    axes[0].set_ylim(lo - 0.1, hi + 0.05)
    axes[0].set_ylabel("held-out loss at L_max (nats/token)")
    for n in names:
        xy = (numbers[n]["load_cv"], numbers[n]["confidence"])
        axes[1].scatter(*xy, marker="o" if "untied" in n else "s")
        axes[1].annotate(n, xy, fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[1].set_xlabel("load CV (0 = balanced)")
    axes[1].set_ylabel("routing confidence (mean max prob)")
    for ax in axes:
        ax.grid(alpha=0.3)


def _series(numbers: dict[str, dict[str, Any]], attention: str) -> list[str]:
    """The arms of one attention in flatten order; its f = 1 point is the baseline (flatten1-tied) only where the
    job set has no flatten1 arm of that attention (runs made before flatten1-untied existed)."""
    own = {v["flatten"]: n for n, v in numbers.items() if v["attention"] == attention}
    if 1 not in own and BASELINE in numbers:
        own[1] = BASELINE
    return [own[f] for f in sorted(own)]


def analyse(ctx: Context) -> Findings:
    numbers = _measure(ctx)
    header = (
        "job",
        "flatten",
        "attention",
        "layers x experts x passes",
        "parameters",
        "expert parameters",
        "FLOPs/token",
        "loss",
        "confidence",
        "load CV",
        "MaxVio",
        "entropy",
        "entropy / ln E",
        "confidence, 0 = 1/E, 1 = one-hot",
    )
    rows = [
        (
            n,
            v["flatten"],
            v["attention"],
            v["shape"],
            f"{v['parameters']:,}",
            f"{v['expert_parameters']:,}",
            f"{v['flops_per_token']:,.0f}",
            f"{v['loss']:.4f}",
            *(f"{v[s]:.3f}" for s in SHOWN),
        )
        for n, v in numbers.items()
    ]
    reading = [f"Final held-out loss, lowest first: {ranked({n: v['loss'] for n, v in numbers.items()})}."]
    for att in ("untied", "tied"):
        series = _series(numbers, att)
        if len(series) > 1:
            steps = {
                s: " → ".join(f"{numbers[n][s]:.3f}" for n in series)
                for s in ("loss", "confidence", "entropy_norm", "load_cv")
            }
            uniform = " → ".join(f"{1 / numbers[n]['experts']:.3f}" for n in series)
            flattens = " → ".join(str(numbers[n]["flatten"]) for n in series)
            reading.append(
                f"{att} attention, flatten {flattens}: "
                + "; ".join(f"{s} {v}" for s, v in steps.items())
                + f" (uniform confidence 1/E: {uniform})."
            )
    metrics = {n: {k: float(v[k]) for k in ("loss", *SHOWN)} for n, v in numbers.items()}
    return Findings(
        tables=[table(header, rows)],
        reading=reading,
        numbers={"jobs": numbers},
        metrics=metrics,
        plot=lambda path: figure(path, lambda axes: _draw(numbers, axes), panels=2),
        method=[
            "Reference shape 4 core layers x 4 experts (width 64, top-2) x 2 loops — Foil's unflattened looped "
            "baseline (flatten1-tied: every weight shared by both loops); flatten f builds 4/f layers of 4f experts "
            "run 2f times. Expert parameters (16 experts) and active expert compute (8 x top-2 per token) are equal "
            "for every f (the table shows both); untied attention keeps one attention block per (layer, pass), i.e. "
            "8 for every f — flatten1-untied included, so the untied series 1 → 2 → 4 holds total parameters equal "
            "(up to one pre-MLP norm per layer) — tied attention has 4/f (fewer parameters, the same attention "
            "compute). FLOPs differ only by the router (2·D·E per call, E = 4f).",
            "Routing health is measured on the held-out tokens at ℓ = L_max with the final weights, averaged over "
            "every (layer, pass) router call: confidence = mean top-1 probability, load CV = std/mean of the tokens "
            "per expert (0 = balanced), MaxVio = max load / mean load − 1, entropy of the router distribution and "
            "entropy / ln E (1 = uniform). With more experts per layer the top-1 probability falls even at the same "
            "sharpness (uniform = 1/E), so the claims compare normalised confidence, (top-1 − 1/E) / (1 − 1/E) (0 = "
            "uniform, 1 = one-hot), and the normalised entropy; untying is tested on routing health only at equal "
            "shape (flatten f untied against flatten f tied, the same E).",
        ],
    )


BASELINE = "flatten1-tied"  # Foil's "unflattened looped baseline": loops 2, every weight shared by both loops
EQUAL = "flatten1-untied"  # the untied series' f = 1: its total parameters equal flatten2/4-untied's


def _at_equal_parameters(arm: str, magnitude: str) -> Claim:
    return Claim(
        paper='"the most flattened Foil ends 0.012 nat below the baseline at equal parameters and compute" and '
        '"the loss improves monotonically with the degree of flattening" (the untied series from flatten 1)',
        source=FOIL,
        magnitude=magnitude,
        measure=f"{arm} minus {EQUAL} (unflattened, untied: equal total parameters) loss at L_max (nats)",
        value=paired(arm, EQUAL, "loss"),
        expect="negative",
    )


def _below_baseline(arm: str, magnitude: str) -> Claim:
    return Claim(
        paper='"every Foil variant has lower pretraining loss than the unflattened looped baseline"',
        source=FOIL,
        magnitude=magnitude,
        measure=f"{arm} minus {BASELINE} (the looped baseline, loops 2, flatten 1) loss at L_max (nats)",
        value=paired(arm, BASELINE, "loss"),
        expect="negative",
    )


EXPERIMENT = Experiment(
    name="flattening",
    title="Flattening series (flatten = 1, 2, 4 of a looped MoE) with untied and tied attention",
    question="Against the unflattened looped baseline (4 layers x 4 experts x 2 loops, everything shared by the "
    "loops), at equal expert parameters and equal active compute, does trading layers for passes (flattening, "
    "Foil) lower the final loss — against that baseline and, at equal total parameters too, along the untied series "
    "from flatten1-untied — and does untying attention (one attention block per pass) make routing more "
    "confident and more balanced at equal shape?",
    analyse=analyse,
    claims=(
        _below_baseline("flatten2-untied", "lower at 20B tokens (no number given for flatten 2)"),
        _below_baseline("flatten4-untied", "−0.012 nat at 100B tokens (most flattened)"),
        Claim(
            paper='"the loss improves monotonically with the degree of flattening"',
            source=FOIL,
            magnitude="monotone at 100B tokens; −0.012 nat at the most flattened vs the baseline",
            measure="flatten4-untied minus flatten2-untied loss at L_max (nats)",
            value=paired("flatten4-untied", "flatten2-untied", "loss"),
            expect="negative",
        ),
        _at_equal_parameters("flatten2-untied", "monotone at 100B tokens (no number given for flatten 2)"),
        _at_equal_parameters("flatten4-untied", "−0.012 nat at 100B tokens (most flattened)"),
        *(
            Claim(
                paper='"Untie the attention. Each pass gets its own attention parameters while the experts and routers '
                'stay shared" (the design, as the loss gain\'s source: "that\'s where the loss gains live")',
                source=FOIL,
                magnitude="not given for untying alone (untied has one more attention block per extra pass)",
                measure=f"flatten{f}-untied minus flatten{f}-tied loss at L_max (nats)",
                value=paired(f"flatten{f}-untied", f"flatten{f}-tied", "loss"),
                expect="negative",
            )
            for f in (2, 4)
        ),
        *(
            Claim(
                paper='"Untying attention also yields more balanced and more confident routing at equal shape" '
                "(confidence)",
                source=FOIL,
                magnitude="not given",
                measure=f"flatten{f}-untied minus flatten{f}-tied routing confidence normalised by 1/E "
                f"((top-1 − 1/E) / (1 − 1/E), E = {REFERENCE_EXPERTS * f})",
                value=_confidence_gain(f),
                expect="positive",
            )
            for f in (2, 4)
        ),
        *(
            Claim(
                paper='"Untying attention also yields more balanced and more confident routing at equal shape" '
                "(balance)",
                source=FOIL,
                magnitude="not given",
                measure=f"flatten{f}-untied minus flatten{f}-tied load CV (lower = more balanced)",
                value=paired(f"flatten{f}-untied", f"flatten{f}-tied", "load_cv"),
                expect="negative",
            )
            for f in (2, 4)
        ),
    ),
)
