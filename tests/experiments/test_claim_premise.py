"""A claim with a premise (e.g. a share of an improvement) is decided only when the premise resolves yes."""

from __future__ import annotations

from elastic_pretrain.experiments.analyses import late_switch
from elastic_pretrain.experiments.stats import Claim, Metrics, evaluate, paired

GAIN = Claim(paper="p", source="s", magnitude="m", measure="deep minus base", value=paired("deep", "base", "x"),
             expect="negative")  # fmt: skip
SHARE = Claim(paper="p", source="s", magnitude="m", measure="share", value=lambda m: m["deep"]["y"],
              expect="equal", margin=0.1, premise=GAIN)  # fmt: skip


def seeds(gains: list[float], shares: list[float]) -> dict[int, Metrics]:
    return {i: {"base": {"x": 0.0}, "deep": {"x": g, "y": s}} for i, (g, s) in enumerate(zip(gains, shares))}


def test_share_is_decided_when_the_premise_holds() -> None:
    r = evaluate(SHARE, seeds([-0.10, -0.11, -0.12], [0.01, 0.0, -0.01]))
    assert r.verdict == "yes"


def test_share_is_not_resolved_when_the_premise_is_contradicted() -> None:
    # the share's own interval lies well outside the band (it would read "contradicted"), but the deep
    # model is worse than the base: there is no improvement whose share could be compared with the paper's
    r = evaluate(SHARE, seeds([0.10, 0.11, 0.12], [-0.7, -0.72, -0.71]))
    assert r.verdict == "not resolved at this scale"
    assert "premise" in r.reason and "deep minus base" in r.reason and "contradicted" in r.reason
    assert r.interval is not None and r.interval.hi < -0.1  # the share's own numbers are still reported


def test_share_is_not_resolved_when_the_premise_is_unresolved() -> None:
    r = evaluate(SHARE, seeds([-0.1, 0.1, 0.0], [0.0, 0.0, 0.0]))
    assert r.verdict == "not resolved at this scale" and "not resolved" in r.reason


def test_late_switch_shares_presuppose_that_loops_help() -> None:
    shares = [c for c in late_switch.EXPERIMENT.claims if "retained" in c.measure]
    assert len(shares) == 3 and all(c.premise is late_switch.LOOPS_HELP for c in shares)
    assert late_switch.LOOPS_HELP in late_switch.EXPERIMENT.claims
