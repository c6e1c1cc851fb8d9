"""The schedule controller: phases, the switch, every sampler, determinism and resumability."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from elastic_pretrain.config import ConfigError
from elastic_pretrain.schedule import DepthPlan, ScheduleConfig, ScheduleController

TOTAL = 1000


def ctl(**kw) -> ScheduleController:
    return ScheduleController(ScheduleConfig(**kw), max_loops=4, total_tokens=TOTAL, seed=3)


def test_switch_at_fraction_of_tokens():
    c = ctl(sampler="independent_rank", switch_at=0.75, fixed_loops=4)
    assert c.phase == "fixed"
    assert not c.update(step=7, tokens_seen=740)
    assert c.plan(step=7, micro=0, replica=0) == DepthPlan(4, (4,))
    assert c.update(step=8, tokens_seen=750)
    assert c.mixed and c.switch_step == 8
    assert not c.update(step=9, tokens_seen=760)  # switches once


def test_switch_at_zero_and_one():
    assert ctl(sampler="per_step", switch_at=0.0).mixed
    never = ctl(sampler="fixed", switch_at=1.0)
    assert not never.update(step=10**6, tokens_seen=10 * TOTAL) and not never.mixed


def test_late_switch_from_one_loop():
    """ELR's recipe: the fixed phase runs ℓ = 1 (fixed_loops), mixed depth after the switch; the passes
    the fixed phase never ran are the ones init_unused_passes sets at the switch."""
    c = ctl(sampler="independent_rank", switch_at=0.75, fixed_loops=1)
    assert {c.plan(step=s, micro=m, replica=r) for s in range(7) for m in range(2) for r in range(3)} == {
        DepthPlan(1, (1,))
    }
    assert c.update(step=8, tokens_seen=750) and c.unused_passes() == range(1, 4)
    assert {c.plan(step=s, micro=0, replica=0).loops for s in range(8, 60)} == {1, 2, 3, 4}
    # an explicit anchor depth for the fixed phase: only the passes above it are left unused
    anchored = ctl(sampler="independent_rank", switch_at=0.75, loops=3, fixed_loops=3)
    assert anchored.plan(step=0, micro=0, replica=0) == DepthPlan(3, (3,))
    assert anchored.update(step=8, tokens_seen=750) and anchored.unused_passes() == range(3, 4)
    assert ctl(sampler="independent_rank", switch_at=0.0, fixed_loops=1).unused_passes() == range(0)


@pytest.mark.parametrize("sampler", ["independent_rank", "per_step"])
def test_a_late_switch_to_mixed_depth_defaults_to_elrs_one_loop_phase(sampler):
    """Issue 32: an unset fixed_loops fell back to the anchor (L_max), so a job called ELR pretrained at 4
    loops. A late switch to a mixed sampler resolves it to 1 (ELR's schedule); the other cases keep the anchor."""
    late = ScheduleConfig(sampler=sampler, switch_at=0.75)
    assert late.fixed_loops == 1
    c = ScheduleController(late, max_loops=4, total_tokens=TOTAL, seed=3)
    assert {c.plan(step=s, micro=0, replica=r) for s in range(7) for r in range(3)} == {DepthPlan(1, (1,))}
    assert ScheduleConfig(sampler=sampler, switch_at=0.0).fixed_loops is None  # mixed from scratch: no fixed phase
    assert ScheduleConfig(sampler="telescopic", switch_at=0.75).fixed_loops is None  # TLM: the anchor
    assert ScheduleConfig(sampler=sampler, switch_at=0.75, fixed_loops=4).fixed_loops == 4  # explicit wins


def test_the_recipes_called_elr_train_the_fixed_phase_at_one_loop():
    """Every shipped run recipe that switches late to a mixed sampler (tiny-cpu, gpu-{1,2,16}node) trains ELR's
    fixed phase at ℓ = 1, as resolved from the file."""
    from pathlib import Path

    from elastic_pretrain.job_loader import load_job

    root = Path(__file__).resolve().parents[2] / "jobs"
    for name in ("tiny-cpu", "gpu-1node", "gpu-2node", "gpu-16node"):
        sched = load_job(root / f"{name}.yaml").schedule
        assert sched.sampler == "independent_rank" and 0 < sched.switch_at < 1, name
        assert sched.fixed_loops == 1, name


def test_per_step_with_the_one_loop_override():
    """ELR's sampling ablation: synchronized per-step draws, and a replica forced to ℓ = 1 with probability
    one_loop_fraction (the others keep the step's shared ℓ)."""
    c = ctl(sampler="per_step", switch_at=0.0, one_loop_fraction=0.3)
    plans = {(s, r): c.plan(step=s, micro=0, replica=r).loops for s in range(400) for r in range(4)}
    share = sum(v == 1 for v in plans.values()) / len(plans)
    assert 0.40 < share < 0.50  # 0.3 + 0.7/4 = 0.475
    for s in range(400):  # at most two depths in a step: the shared draw and the override's ℓ = 1
        assert len({plans[s, r] for r in range(4)} - {1}) <= 1
    assert any(len({plans[s, r] for r in range(4)}) > 1 for s in range(400))  # the override splits steps
    plain = ctl(sampler="per_step", switch_at=0.0)  # without the override: every replica in step
    assert all(len({plain.plan(step=s, micro=0, replica=r).loops for r in range(4)}) == 1 for s in range(100))


def test_fixed_sampler_and_configured_depth():
    c = ctl(sampler="fixed", switch_at=0.0, loops=3)
    assert {c.plan(step=s, micro=m, replica=r) for s in range(5) for m in range(2) for r in range(3)} == {
        DepthPlan(3, (3,))
    }


def test_independent_rank_is_deterministic_per_replica_and_honours_the_one_loop_override():
    c = ctl(sampler="independent_rank", switch_at=0.0, one_loop_fraction=0.15)
    draws = [c.plan(step=s, micro=m, replica=r).loops for s in range(300) for m in range(2) for r in range(4)]
    assert draws == [c.plan(step=s, micro=m, replica=r).loops for s in range(300) for m in range(2) for r in range(4)]
    counts = Counter(draws)
    # P(ℓ=1) = 0.15 + 0.85/4 = 0.3625, others 0.2125 each; 2400 draws
    assert 0.32 < counts[1] / len(draws) < 0.41
    assert all(0.17 < counts[k] / len(draws) < 0.26 for k in (2, 3, 4))
    # replicas differ within a step (that is the point), all TP/PP ranks of a replica agree by construction
    assert len({c.plan(step=5, micro=0, replica=r).loops for r in range(16)}) > 1


def test_independent_rank_weights():
    c = ctl(sampler="independent_rank", switch_at=0.0, weights=[0, 0, 1, 3])
    counts = Counter(c.plan(step=s, micro=0, replica=0).loops for s in range(800))
    assert set(counts) == {3, 4} and 0.68 < counts[4] / 800 < 0.82


def test_per_step_gives_one_depth_to_every_replica_and_micro_batch():
    c = ctl(sampler="per_step", switch_at=0.0)
    for s in range(20):
        assert len({c.plan(step=s, micro=m, replica=r).loops for m in range(3) for r in range(4)}) == 1
    assert len({c.plan(step=s, micro=0, replica=0).loops for s in range(50)}) > 1


def test_telescopic_anchor_plus_random_prefix():
    c = ctl(sampler="telescopic", switch_at=0.0)
    plans = [c.plan(step=s, micro=m, replica=0) for s in range(200) for m in range(2)]
    assert all(p.loops == 4 and p.exits[-1] == 4 and len(p.exits) == 2 and p.exits[0] < 4 for p in plans)
    assert {p.exits[0] for p in plans} == {1, 2, 3}


def test_telescopic_density_concentrated_on_listed_depths():
    c = ctl(sampler="telescopic", switch_at=0.0, telescopic_depths=[1, 2], telescopic_weights=[1, 9])
    exits = Counter(c.plan(step=s, micro=0, replica=0).exits[0] for s in range(500))
    assert set(exits) == {1, 2} and exits[2] > 4 * exits[1]


def test_fixed_exits_supervises_only_listed_exits():
    c = ctl(sampler="fixed_exits", switch_at=0.0, exits=[4, 1, 2])
    assert c.plan(step=0, micro=0, replica=0) == DepthPlan(4, (1, 2, 4))


def test_state_dict_round_trip_draws_the_same():
    a = ctl(sampler="independent_rank", switch_at=0.5)
    a.update(step=5, tokens_seen=600)
    b = ctl(sampler="independent_rank", switch_at=0.5)
    b.load_state_dict(a.state_dict())
    assert b.mixed and b.switch_step == 5
    plans_a = [a.plan(step=9, micro=m, replica=1) for m in range(4)]
    assert plans_a == [b.plan(step=9, micro=m, replica=1) for m in range(4)]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"switch_at": 1.5}, "switch_at: 1.5 must be in [0, 1]"),
        ({"sampler": "fixed_exits"}, "exits: fixed_exits needs"),
        ({"weights": [1, 1]}, "give 4 weights"),
        ({"loops": 5}, "schedule.loops=5 is outside [1, 4]"),
        ({"telescopic_depths": [1], "telescopic_weights": [1, 2]}, "one weight per entry"),
        ({"fixed_loops": 0}, "schedule.fixed_loops=0 is outside [1, 4]"),
        ({"sampler": "telescopic"}, "telescopic never runs with switch_at: 1.0 .* set schedule.switch_at"),
        ({"sampler": "fixed_exits", "exits": [1, 4], "switch_at": 1.0}, "fixed_exits never runs with switch_at"),
        ({"sampler": "independent_rank"}, "independent_rank never runs with switch_at: 1.0"),
    ],
)
def test_bad_schedules_are_clear_errors(kw, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ctl(**kw)


# --- step plans: the EP group's ℓ computed locally, orders, draws per EP group (issue 19) ---------------


def _layout(group, key=None):
    from elastic_pretrain.schedule import ExpertLayout

    return ExpertLayout(group=tuple(group), key=key or {r: r for r in group})


def test_step_plans_carry_the_expert_groups_max_computed_locally():
    c = ctl(sampler="independent_rank", switch_at=0.0)
    group = _layout([0, 1, 2])
    for step in range(10):
        for r in group.group:
            plans = c.step_plans(step=step, micro_batches=4, replica=r, layout=group)
            assert [i for i, _ in plans] == [0, 1, 2, 3]  # order: draw
            for i, p in plans:
                assert dataclasses.replace(p, group_loops=None) == c.plan(step=step, micro=i, replica=r)
                assert p.group_loops == max(c.plan(step=step, micro=i, replica=q).loops for q in group.group)
    # a replica alone in its group never runs a ghost pass
    assert all(p.group_loops == p.loops for _, p in c.step_plans(step=3, micro_batches=4, replica=5))


def test_deep_first_reorders_the_same_draws():
    draw = ctl(sampler="independent_rank", switch_at=0.0)
    deep = ctl(sampler="independent_rank", switch_at=0.0, order="deep_first")
    group = _layout([0, 1])
    ghosts = {"draw": 0, "deep_first": 0}
    for step in range(20):
        for r in (0, 1):
            a = draw.step_plans(step=step, micro_batches=4, replica=r, layout=group)
            b = deep.step_plans(step=step, micro_batches=4, replica=r, layout=group)
            # same (micro-batch, ℓ) pairs — the same data at the same depth, so the same gradient sum
            assert sorted((i, p.loops) for i, p in a) == sorted((i, p.loops) for i, p in b)
            assert [p.loops for _, p in b] == sorted((p.loops for _, p in b), reverse=True)
            ghosts["draw"] += sum(p.group_loops - p.loops for _, p in a)
            ghosts["deep_first"] += sum(p.group_loops - p.loops for _, p in b)
            # both members agree on every position's group ℓ
        other = deep.step_plans(step=step, micro_batches=4, replica=1, layout=group)
        mine = deep.step_plans(step=step, micro_batches=4, replica=0, layout=group)
        assert [p.group_loops for _, p in mine] == [p.group_loops for _, p in other]
    assert ghosts["deep_first"] < ghosts["draw"]


def test_expert_group_draws_agree_inside_a_group_and_mix_across_groups():
    c = ctl(sampler="independent_rank", switch_at=0.0, depth_group="expert_group")
    key = {0: 0, 1: 0, 2: 2, 3: 2}
    across = set()
    for step in range(10):
        plans = {
            r: c.step_plans(step=step, micro_batches=4, replica=r, layout=_layout([key[r], key[r] + 1], key))
            for r in range(4)
        }
        assert plans[0] == plans[1] and plans[2] == plans[3]
        assert all(p.group_loops == p.loops for r in plans for _, p in plans[r])  # no ghost passes
        across |= {(p0.loops, p2.loops) for (_, p0), (_, p2) in zip(plans[0], plans[2])}
        assert len({p.loops for _, p in plans[0]} | {p.loops for _, p in plans[2]}) >= 1
    assert any(a != b for a, b in across)  # different groups still mix ℓ within one update
    # with replica-level draws (ELR) the two members of a group differ
    elr = ctl(sampler="independent_rank", switch_at=0.0)
    assert any(elr.plan(step=s, micro=0, replica=0) != elr.plan(step=s, micro=0, replica=1) for s in range(10))


def test_depth_group_needs_independent_rank():
    with pytest.raises(ConfigError, match="applies to sampler independent_rank only"):
        ScheduleConfig(sampler="telescopic", depth_group="expert_group")


@pytest.mark.parametrize("sampler", ["telescopic", "fixed_exits"])
def test_shared_prefix_exits_with_loop_conditioning_are_refused(sampler):
    """Training reads a truncated exit out of a deeper run (its passes conditioned on the deeper ℓ);
    evaluation conditions ℓ on itself. The two cannot agree, so the job is refused, in one line."""
    cfg = ScheduleConfig(sampler=sampler, switch_at=0.0, exits=[1, 4])
    with pytest.raises(ConfigError, match=r"set model\.loop_conditioning: false") as err:
        cfg.validate_for(4, loop_conditioning=True)
    assert "\n" not in str(err.value)
    cfg.validate_for(4, loop_conditioning=False)
    ScheduleConfig(sampler="independent_rank", switch_at=0.0).validate_for(4, loop_conditioning=True)
