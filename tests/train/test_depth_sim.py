"""Depth efficiency from the samplers' own draws (train/depth_sim.py): the targets of issue 19 at 2, 4 and 64 ranks."""

from __future__ import annotations

import pytest

from elastic_pretrain.config import ConfigError
from elastic_pretrain.schedule import ScheduleConfig
from elastic_pretrain.train.depth_sim import layouts, simulate

ELR = {"sampler": "independent_rank", "switch_at": 0.0}


def eff(ranks: int, ep: int, micro: int = 4, steps: int = 30, **kw):
    return simulate(
        ScheduleConfig(**{**ELR, **kw}), max_loops=4, replicas=ranks, ep_size=ep, micro_batches=micro, steps=steps
    )


def test_independent_rank_idles_more_as_the_expert_group_grows():
    """The issue's measurement, from the sampler: 2 ranks ≈ 0.8, 16 ≈ 0.6."""
    two, sixteen = eff(2, 2).mean, eff(16, 16, steps=10).mean
    assert two < 0.9 and sixteen < 0.7 and sixteen < two


@pytest.mark.parametrize(("ranks", "ep"), [(2, 2), (4, 2), (4, 4), (64, 8), (64, 64)])
def test_expert_group_draws_reach_the_target(ranks, ep):
    e = eff(ranks, ep, steps=5 if ep == 64 else 20, depth_group="expert_group")
    assert e.mean >= 0.95 and e.worst_step >= 0.95  # (exactly 1: nobody in a group is shallower)


def test_deep_first_never_loses_and_helps_on_average():
    for ranks in (2, 4, 8):
        draw, deep = eff(ranks, ranks), eff(ranks, ranks, order="deep_first")
        assert deep.mean > draw.mean
        assert deep.step_balance == pytest.approx(draw.step_balance)  # same draws: same totals per replica


def test_step_balance_sees_what_depth_efficiency_does_not():
    """EP groups drawing their own ℓ execute different totals: efficiency 1, but the step-end all-reduce waits."""
    e = eff(8, 2, depth_group="expert_group")
    assert e.mean == 1.0 and e.step_balance < 0.95


def test_layout_must_divide():
    with pytest.raises(ConfigError, match="must divide"):
        layouts(6, 4)
    assert layouts(4, 2)[3].group == (2, 3) and layouts(4, 2)[3].key == {0: 0, 1: 0, 2: 2, 3: 2}


def test_progress_note_and_run_summary():
    from elastic_pretrain.train.trainer import depth_note, depth_summary

    assert depth_note({}) == ""
    assert depth_note({"depth_efficiency": 0.7444, "ghost_time_s": 0.123}) == " depth eff 0.744 ghost 0.12s"
    assert depth_note({"depth_efficiency": 1.0, "depth_balance": 0.9751, "ghost_time_s": 0.0}) == (
        " depth eff 1.000 bal 0.975 ghost 0.00s"
    )
    history = [
        {"step": 1},
        {"step": 2, "depth_efficiency": 1.0, "ghost_time_s": 0.0},
        {"step": 3, "depth_efficiency": 0.5, "ghost_time_s": 0.25},
    ]
    assert depth_summary(history) == {"depth_efficiency": 0.75, "ghost_time_s": 0.25}
    assert depth_summary([{"step": 1}]) == {}
