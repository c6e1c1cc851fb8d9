"""Premises and labels (issue 32 item 2): a claim with a premise (a share of an improvement; an adaptive-depth claim
that presupposes depth pays) is decided only when the premise resolves yes, and otherwise reads exactly "not
resolved — premise absent"; a claim on another metric than the paper's reads "not comparable" where it would agree
or disagree with the paper's number; an accounting identity is an "implementation check". And the audit: which
claim of which experiment is gated by which premise."""

from __future__ import annotations

import dataclasses

from elastic_pretrain.experiments.analyses import late_switch
from elastic_pretrain.experiments.present import claim_table
from elastic_pretrain.experiments.registry import EXPERIMENTS
from elastic_pretrain.experiments.stats import PREMISE_ABSENT, Claim, Metrics, evaluate, paired

GAIN = Claim(paper="p", source="s", magnitude="m", measure="deep minus base", value=paired("deep", "base", "x"),
             expect="negative", kind="premise")  # fmt: skip
SHARE = Claim(paper="p", source="s", magnitude="m", measure="share", value=lambda m: m["deep"]["y"],
              expect="equal", margin=0.1, premise=GAIN)  # fmt: skip
ADAPTIVE = Claim(paper="p", source="s", magnitude="m", measure="adaptive minus fixed", value=lambda m: m["deep"]["y"],
                 expect="negative", premise=GAIN)  # fmt: skip


def seeds(gains: list[float], shares: list[float]) -> dict[int, Metrics]:
    return {i: {"base": {"x": 0.0}, "deep": {"x": g, "y": s}} for i, (g, s) in enumerate(zip(gains, shares))}


def test_share_is_decided_when_the_premise_holds() -> None:
    r = evaluate(SHARE, seeds([-0.10, -0.11, -0.12], [0.01, 0.0, -0.01]))
    assert r.verdict == "yes" and r.premise is not None and r.premise.verdict == "yes"


def test_a_claim_whose_premise_is_absent_is_never_contradicted() -> None:
    # the adaptive claim's own interval excludes 0 the wrong way (+0.5 at every seed: it would read "contradicted"),
    # but deep is worse than base: depth does not pay, so there is nothing for adaptive depth to win
    r = evaluate(ADAPTIVE, seeds([0.10, 0.11, 0.12], [0.5, 0.52, 0.51]))
    assert r.verdict == "not resolved — premise absent" == PREMISE_ABSENT
    assert "premise" in r.reason and "deep minus base" in r.reason and ", no)" in r.reason
    assert r.interval is not None and r.interval.lo > 0.4  # the claim's own numbers are still reported
    # the premise row: depth does not pay here, a fact about these runs ("no"), not a contradiction of a paper
    assert r.premise is not None and r.premise.verdict == "no" and "does not hold here" in r.premise.reason
    # the same with the premise established: now it is contradicted
    assert evaluate(ADAPTIVE, seeds([-0.10, -0.11, -0.12], [0.5, 0.52, 0.51])).verdict == "contradicted"


def test_share_is_gated_when_the_premise_is_contradicted_or_unresolved() -> None:
    r = evaluate(SHARE, seeds([0.10, 0.11, 0.12], [-0.7, -0.72, -0.71]))
    assert r.verdict == PREMISE_ABSENT and r.interval is not None and r.interval.hi < -0.1
    r = evaluate(SHARE, seeds([-0.1, 0.1, 0.0], [0.0, 0.0, 0.0]))
    assert r.verdict == PREMISE_ABSENT and "not resolved at this scale" in r.reason


def test_a_premise_the_numbers_lack_gates_the_claim_and_says_so() -> None:
    # a report written before the premise was measured: the claim's own values exist, the premise's do not
    by_seed = {i: {"deep": {"y": 0.5 + i / 100}} for i in range(3)}
    r = evaluate(ADAPTIVE, by_seed)
    assert r.verdict == PREMISE_ABSENT and "deep minus base: not measured: no 'x'" in r.reason and len(r.values) == 3
    # neither measured: still the premise that decides the wording
    r = evaluate(ADAPTIVE, {i: {} for i in range(3)})
    assert r.verdict == PREMISE_ABSENT and r.values == () and r.interval is None


def test_another_metric_than_the_papers_reads_not_comparable() -> None:
    band = Claim(paper="p", source="s", magnitude="0–3% lower benchmark scores", measure="accuracy drop",
                 value=lambda m: m["a"]["d"], expect="equal", margin=0.015, comparable=False)  # fmt: skip
    inside = {i: {"a": {"d": 0.001 * i}} for i in range(3)}
    outside = {i: {"a": {"d": 0.09 + 0.001 * i}} for i in range(3)}
    unclear = {i: {"a": {"d": v}} for i, v in enumerate((-0.1, 0.0, 0.1))}
    assert evaluate(band, inside).verdict == "not comparable"  # would be "yes"
    r = evaluate(band, outside)  # would be "contradicted"
    assert r.verdict == "not comparable" and "another metric than the paper's" in r.reason
    assert evaluate(band, unclear).verdict == "not resolved at this scale"  # no agreement claimed: stays
    gated = evaluate(dataclasses.replace(band, premise=GAIN), {i: {**m, **seeds([0.1] * 3, [0] * 3)[i]}
                                                                for i, m in outside.items()})  # fmt: skip
    assert gated.verdict == PREMISE_ABSENT and gated.reason.endswith("besides (not comparable)")


def test_an_accounting_identity_is_an_implementation_check() -> None:
    check = Claim(paper="p", source="s", magnitude="m", measure="bytes x ℓ / per-loop bytes − 1",
                  value=lambda m: m["a"]["err"], expect="equal", margin=1e-9, kind="implementation check")  # fmt: skip
    exact = evaluate(check, {i: {"a": {"err": 0.0}} for i in range(3)})
    leaky = evaluate(check, {i: {"a": {"err": 0.5}} for i in range(3)})
    assert exact.verdict == "yes" and leaky.verdict == "no" and leaky.reason.startswith("the check fails")
    table = claim_table([exact, evaluate(GAIN, seeds([-0.1, -0.11, -0.12], [0, 0, 0]))])
    assert "**yes** (implementation check, not evidence for the paper) — " in table
    assert "| **premise** — p (s; expected: negative, m) |" in table
    assert "**not resolved — premise absent**" in table and "**not comparable**" in table  # the note explains both


# The audit (issue 32 item 2): every claim that presupposes depth pays, by experiment, and its premise's measure.
GATED = {
    "decider": 7,  # every adaptive-depth claim: the base's fixed depth at L_max below ℓ = 1
    "decider-depth-pays": 9,  # decider's 7 on the depth-pays base, and passes tracking true difficulty (2)
    "decider-depths": 4,  # per L_max, and the growth claim on L_max = 2 and the deepest
    "samplers": 3,  # all but the one-loop tax (measured against the one-loop baseline whatever depth gives)
    "samplers-ep2": 4,
    "exit-schedules": 4,  # the areas, the holes, the dial's price; "matching at full capacity" needs no holes
    "exit-schedules-depth-pays": 4,  # the same on the depth-pays corpus
    "kv-cache": 5,  # the size of the cost (one per arm) and the trained mode's shrinkage (a gap to shrink)
    "kv-cache-depth-pays": 4,  # the same on its two arms
    "late-switch": 10,  # the shares retained and the five-loop comparisons (loops must pay), tied and untied
    "late-switch-depth-pays": 8,  # the same for the 75% switch only
    "late-switch-depth-pays-long": 8,  # the same arms at 6,000 steps
    "flattening": 0,
    "route-replay": 0,
    "seed-noise": 0,
    "depth-premise": 0,  # its rows are the premise itself (kind "premise"), on the depth-pays corpus
    "depth-premise-long": 0,  # the same, the bare core at 3,000 steps
}


def test_every_claim_that_presupposes_depth_pays_is_gated() -> None:
    assert set(GATED) == set(EXPERIMENTS)
    for name, experiment in EXPERIMENTS.items():
        gated = [c for c in experiment.claims if c.premise is not None]
        assert len(gated) == GATED[name], (name, [c.measure for c in gated])
        for c in gated:  # a premise is itself a row of the table, or at least a premise
            assert c.premise is not None and (c.premise.kind == "premise" or c.premise in experiment.claims)
    depth = "at ℓ = L_max minus at ℓ = 1"
    for name in ("decider", "decider-depth-pays", "samplers", "samplers-ep2"):
        premises = {c.premise.measure for c in EXPERIMENTS[name].claims if c.premise is not None}
        assert len(premises) == 1 and depth in premises.pop(), name
    tlm = {c.premise.measure for c in EXPERIMENTS["exit-schedules"].claims if c.premise is not None}
    assert tlm == {"sparse-exits: ln(highest perplexity at an exit it never supervises / perplexity at full depth) "
                   "minus ln 5"}  # fmt: skip
    shares = [c for c in late_switch.EXPERIMENT.claims if "retained" in c.measure]
    untied = [c for c in shares if not c.measure.startswith("tied-")]
    assert len(untied) == 3 and all(c.premise is late_switch.LOOPS_HELP for c in untied)
    assert [c.premise for c in shares if c not in untied] == [late_switch.LOOPS_HELP_TIED]  # ELR as published
    assert {late_switch.LOOPS_HELP, late_switch.LOOPS_HELP_TIED} <= set(late_switch.EXPERIMENT.claims)


def test_labels_of_the_registered_claims() -> None:
    kinds = {(name, c.kind) for name, e in EXPERIMENTS.items() for c in e.claims}
    checks = [(n, c.measure) for n, e in EXPERIMENTS.items() for c in e.claims if c.kind == "implementation check"]
    # compute replayed and the heads arms' twins (tied, untied) per late switch; bytes = 1/ℓ
    late = ("late-switch", "late-switch-depth-pays", "late-switch-depth-pays-long")
    assert [n for n, _ in checks] == [*(n for n in late for _ in range(4)), "kv-cache", "kv-cache-depth-pays"]
    assert [m.split(":")[0] for n, m in checks if "steps whose logged training loss" in m] == [
        "tied-switch-0.75 vs tied-switch-0.75-noheads", "switch-0.75 vs switch-0.75-noheads"] * 3  # fmt: skip
    incomparable = [c.measure for c in EXPERIMENTS["kv-cache"].claims if not c.comparable]
    assert len(incomparable) == 3 and all("next-token accuracy" in m for m in incomparable)
    assert ("decider", "premise") in kinds and ("exit-schedules", "premise") in kinds
