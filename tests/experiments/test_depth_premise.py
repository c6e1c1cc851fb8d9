"""depth-premise decides the premise per shape (issue 32): the bare looped core, whose ℓ = 1 cannot look anything
up, and the core wrapped in a prelude and a coda; the premise other claims gate on is the bare core's."""

from __future__ import annotations

from elastic_pretrain.experiments.analyses.depth_premise import BARE, EXPERIMENT, PREMISE, WRAPPED
from elastic_pretrain.experiments.stats import evaluate


def _arm(loss: float, acc: float) -> dict[str, float]:
    return {"loss[all]": loss, "loss[answers]": loss + 0.4, "loss[d>=2]": loss + 0.5, "acc[answers]": acc}


def test_each_shape_has_its_own_premise_rows_and_the_gate_is_the_bare_core() -> None:
    measures = [c.measure for c in EXPERIMENT.claims]
    assert len(measures) == 8 and all(c.kind == "premise" for c in EXPERIMENT.claims)
    assert sum(m.startswith(BARE.what) for m in measures) == sum(m.startswith(WRAPPED.what) for m in measures) == 4
    assert PREMISE is EXPERIMENT.claims[0] and "bare-max" in PREMISE.measure and "bare-1" in PREMISE.measure
    # bare: deeper is better at every seed; wrapped: deeper is worse at every seed
    by_seed = {
        s: {"bare-1": _arm(0.38 + e, 0.60), "bare-max": _arm(0.34 + e, 0.74 + e),
            "fixed-1": _arm(0.33 + e, 0.75), "fixed-max": _arm(0.41 + e, 0.60 - e)}
        for s, e in ((1, 0.0), (2, 0.004), (3, -0.003))
    }  # fmt: skip
    verdicts = {c.measure: evaluate(c, by_seed).verdict for c in EXPERIMENT.claims}
    assert all(v == "yes" for m, v in verdicts.items() if m.startswith(BARE.what))
    assert all(v == "no" for m, v in verdicts.items() if m.startswith(WRAPPED.what))  # a premise never "contradicted"
    # runs stored before the bare arms existed: their rows are not measured, the wrapped rows still decided
    old = {s: {k: v for k, v in arms.items() if not k.startswith("bare")} for s, arms in by_seed.items()}
    assert {evaluate(c, old).verdict for c in EXPERIMENT.claims[:4]} == {"not measured"}
