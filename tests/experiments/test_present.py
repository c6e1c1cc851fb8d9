"""The claim table and the seed-noise table every report shows, from synthetic per-seed metrics."""

from __future__ import annotations

import pytest

from elastic_pretrain.experiments.present import claim_table, noise_table, table
from elastic_pretrain.experiments.stats import Claim, evaluate, paired

BY_SEED = {
    1: {"fixed": {"loss@1": 2.50, "loss@4": 2.00}, "mixed": {"loss@1": 2.30, "loss@4": 2.02}},
    2: {"fixed": {"loss@1": 2.70, "loss@4": 2.01}, "mixed": {"loss@1": 2.41, "loss@4": 2.01}},
    3: {"fixed": {"loss@1": 2.60, "loss@4": 2.02}, "mixed": {"loss@1": 2.35, "loss@4": 2.05}},
}


def _claim(metric: str) -> Claim:
    return Claim(
        paper='"mixed | wins"',
        source="seeds/003 (ELR)",
        magnitude="−0.01 nat",
        measure=f"mixed minus fixed {metric}",
        value=paired("mixed", "fixed", metric),
        expect="negative",
    )


def test_claim_table_states_claim_measurement_and_verdict_with_its_reason() -> None:
    results = [evaluate(_claim("loss@1"), BY_SEED), evaluate(_claim("loss@4"), BY_SEED)]
    text = claim_table(results)
    lines = text.splitlines()
    assert lines[0] == "| the paper's claim (direction, magnitude) | what we measured | resolved? |"
    # loss@1: −0.20, −0.29, −0.25: the interval excludes 0; loss@4: +0.02, 0.00, +0.03: it includes 0
    assert "mixed minus fixed loss@1: -0.2467 [" in lines[2] and "**yes** — the 95% interval excludes 0" in lines[2]
    assert "**not resolved at this scale** — the 95% interval includes 0" in lines[3]
    assert lines[2].startswith('| "mixed \\| wins" (seeds/003 (ELR); expected: negative, −0.01 nat) |')
    assert "two-sided 95% Student-t interval" in text
    assert "No claim" in claim_table([])


def test_noise_table_gives_every_arm_its_seed_std() -> None:
    text = noise_table(BY_SEED)
    row = next(line for line in text.splitlines() if line.startswith("| mixed | loss@1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "2.3533" and float(cells[3]) == pytest.approx(0.0551, abs=1e-4)
    assert cells[5] == "2.3000 2.4100 2.3500"
    assert len([line for line in text.splitlines() if line.startswith("| fixed |")]) == 2
    assert "per seed (1, 2, 3)" in text.splitlines()[0]


def test_table() -> None:
    assert table(("a", "b"), [(1, "x")]) == "| a | b |\n|---|---|\n| 1 | x |"
