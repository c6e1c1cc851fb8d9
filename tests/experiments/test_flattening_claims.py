"""Foil's "more confident routing at equal shape", tested on confidence normalised by 1/E (issue 32 item 3): the
raw top-1 probability falls with the number of experts at the same sharpness, so the claims rescale it."""

from __future__ import annotations

import pytest

from elastic_pretrain.experiments.analyses.flattening import EXPERIMENT, normalised_confidence


def test_normalised_confidence_is_zero_for_a_uniform_router_and_one_for_a_one_hot_one() -> None:
    for e in (4, 8, 16):
        assert normalised_confidence(1 / e, e) == pytest.approx(0.0, abs=1e-12)
        assert normalised_confidence(1.0, e) == pytest.approx(1.0)
    # the same raw top-1 probability is sharper among more experts
    assert normalised_confidence(0.3, 16) > normalised_confidence(0.3, 8)


def test_the_untying_claims_compare_normalised_confidence_and_balance_at_equal_shape() -> None:
    routing = ("tied routing confidence", "load CV")
    claims = {c.measure: c for c in EXPERIMENT.claims if any(w in c.measure for w in routing)}
    assert len(claims) == 4  # confidence and load CV, at flatten 2 and 4
    conf4 = next(c for m, c in claims.items() if m.startswith("flatten4-untied") and "confidence" in m)
    assert "E = 16" in conf4.measure and conf4.expect == "positive"
    metrics = {"flatten4-untied": {"confidence": 0.25}, "flatten4-tied": {"confidence": 0.125}}
    # (0.25 - 1/16) / (15/16) - (0.125 - 1/16) / (15/16) = 0.125 * 16/15: a raw difference would read 0.125
    assert conf4.value(metrics) == pytest.approx(0.125 * 16 / 15, rel=1e-12)
    cv2 = next(c for m, c in claims.items() if m.startswith("flatten2-untied") and "load CV" in m)
    assert cv2.value({"flatten2-untied": {"load_cv": 0.1}, "flatten2-tied": {"load_cv": 0.3}}) == pytest.approx(-0.2)
