"""Depth efficiency of a sampler at any scale, from the sampler's own draws (no processes, no model).

Replays :meth:`ScheduleController.step_plans` for every replica of a data-parallel layout whose
expert-parallel groups are ``ep_size`` consecutive replicas (megatron's order with TP = ETP = 1), and
counts useful passes (ℓ) against executed ones (the EP group's maximum, ghosts included): the same
``depth_efficiency`` a training run reports. ``bench/bench_depth_efficiency.py`` prints it per sampler
for 2..64 ranks; ``tests/train/test_depth_sim.py`` holds the targets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from elastic_pretrain.config import ConfigError
from elastic_pretrain.schedule import DepthPlan, ExpertLayout, ScheduleConfig, ScheduleController


@dataclasses.dataclass(frozen=True)
class Efficiency:
    mean: float  # useful / executed passes over all steps
    worst_step: float  # the lowest per-step efficiency
    # mean over steps of (mean executed passes per replica) / (max over replicas): what the step-end
    # gradient reduction waits for when replicas (or EP groups) executed different totals — not idle
    # *passes*, so depth_efficiency does not see it
    step_balance: float


class _Replay(ScheduleController):
    """The controller with its draws memoised: every replica of a simulated EP group replays its peers'."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._memo: dict[tuple[int, int, int], DepthPlan] = {}

    def plan(self, *, step: int, micro: int, replica: int) -> DepthPlan:
        k = (step, micro, replica)
        if k not in self._memo:
            self._memo[k] = super().plan(step=step, micro=micro, replica=replica)
        return self._memo[k]


def layouts(replicas: int, ep_size: int) -> list[ExpertLayout]:
    """Each replica's :class:`ExpertLayout` when EP groups are ``ep_size`` consecutive replicas."""
    if ep_size < 1 or replicas % ep_size:
        raise ConfigError(f"ep_size={ep_size} must divide replicas={replicas}")
    key = {r: r - r % ep_size for r in range(replicas)}
    return [ExpertLayout(group=tuple(range(key[r], key[r] + ep_size)), key=key) for r in range(replicas)]


def simulate(
    cfg: ScheduleConfig, *, max_loops: int, replicas: int, ep_size: int, micro_batches: int, steps: int, seed: int = 0
) -> Efficiency:
    """Depth efficiency of ``cfg``'s mixed phase over ``steps`` steps (the switch is ignored: mixed from step 0)."""
    ctl = _Replay(dataclasses.replace(cfg, switch_at=0.0), max_loops=max_loops, total_tokens=1, seed=seed)
    useful = executed = 0
    worst, balance = 1.0, 0.0
    for step in range(steps):
        per_replica = []
        u = 0
        for r, layout in enumerate(layouts(replicas, ep_size)):
            if ctl.balanced:  # compute-balanced: replicas take different numbers of the global batch's slots
                plans = ctl.balanced_plans(
                    step=step, micro_batches=micro_batches, replica=r, replicas=replicas, layout=layout
                )
            else:
                plans = ctl.step_plans(step=step, micro_batches=micro_batches, replica=r, layout=layout)
            u += sum(p.loops for _, p in plans)
            per_replica.append(sum(p.group_loops or p.loops for _, p in plans))
        e = sum(per_replica)
        useful, executed = useful + u, executed + e
        worst = min(worst, u / e)
        balance += e / len(per_replica) / max(per_replica)
    return Efficiency(mean=useful / executed, worst_step=worst, step_balance=balance / steps)
