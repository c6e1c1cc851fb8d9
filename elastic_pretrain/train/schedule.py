"""The schedule controller: the one object that owns depth during training.

Phase ``fixed`` (every micro-batch at ``schedule.fixed_loops``: 1 in ELR's recipe, default the anchor
``schedule.loops``) until ``switch_at`` of the run's tokens,
then ``mixed``, where the configured sampler picks each micro-batch's loop count ℓ and the exits
that are supervised. Draws are pure functions of (seed, step, micro-batch, replica), so a resumed
run draws exactly what an uninterrupted run would, and all TP/PP ranks of one replica agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from elastic_pretrain.config import ConfigError, field

Sampler = Literal["fixed", "independent_rank", "per_step", "telescopic", "fixed_exits"]
UnusedPassInit = Literal["copy_pass0", "as_initialised"]


@dataclasses.dataclass(kw_only=True)
class ScheduleConfig:
    """Depth during training (ELR fixed→mixed switch; TLM telescopic; Matryoshka fixed exits)."""

    sampler: Sampler = field("fixed", doc="How ℓ is chosen in the mixed phase (see docs/elastic-depth.md).")
    loops: int | None = field(None, doc="The anchor depth (sampler fixed, telescopic); None = L_max.")
    fixed_loops: int | None = field(
        None, doc="ℓ of the fixed phase before switch_at (ELR's late switch: 1); None = the anchor (loops)."
    )
    init_unused_passes: UnusedPassInit = field(
        "copy_pass0",
        doc="At the switch, the attention of passes the fixed phase never ran (j >= fixed_loops): copy_pass0 "
        "copies pass 0's trained attention into them; as_initialised keeps their initialisation (the ablation).",
    )
    switch_at: float = field(
        1.0, doc="Fraction of the run's tokens after which the mixed phase starts (0: from scratch, 1: never)."
    )
    weights: list[float] = field(
        factory=list, doc="independent_rank/per_step: weight of ℓ = 1..L_max (empty = uniform)."
    )
    one_loop_fraction: float = field(
        0.0,
        doc="independent_rank/per_step: probability that a replica's micro-batch is forced to ℓ = 1 (ELR's "
        "one-loop override; under per_step the other replicas keep the step's shared ℓ).",
    )
    telescopic_depths: list[int] = field(
        factory=list, doc="telescopic: prefix depths the random exit is drawn from (empty = uniform over 1..ℓ-1)."
    )
    telescopic_weights: list[float] = field(
        factory=list, doc="telescopic: sampling density over telescopic_depths (empty = uniform)."
    )
    exits: list[int] = field(factory=list, doc="fixed_exits: the only supervised exits (Matryoshka baseline).")

    def __post_init__(self) -> None:
        if not 0.0 <= self.switch_at <= 1.0:
            raise ConfigError(f"switch_at: {self.switch_at} must be in [0, 1] (0 = mixed from scratch, 1 = never)")
        if not 0.0 <= self.one_loop_fraction <= 1.0:
            raise ConfigError(f"one_loop_fraction: {self.one_loop_fraction} must be in [0, 1]")
        if any(w < 0 for w in self.weights + self.telescopic_weights) or (self.weights and sum(self.weights) <= 0):
            raise ConfigError("weights: must be non-negative with a positive sum")
        if self.telescopic_weights and len(self.telescopic_weights) != len(self.telescopic_depths):
            raise ConfigError("telescopic_weights: give one weight per entry of telescopic_depths")
        if self.sampler == "fixed_exits" and not self.exits:
            raise ConfigError("exits: fixed_exits needs the list of supervised exits, e.g. exits: [1, 2, 4]")
        if self.sampler != "fixed" and self.switch_at == 1.0:
            raise ConfigError(
                f"schedule.sampler: {self.sampler} never runs with switch_at: 1.0 (the whole run stays at fixed depth):"
                " set schedule.switch_at (0 = from the start, e.g. 0.75 = ELR's late switch) or sampler: fixed"
            )

    def validate_for(self, max_loops: int, *, loop_conditioning: bool = False) -> None:
        """Checks that need the model's L_max (and whether it has loop-count conditioning heads)."""
        for name in ("loops", "fixed_loops"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= max_loops:
                raise ConfigError(f"schedule.{name}={value} is outside [1, {max_loops}]: pick a value in that range")
        if loop_conditioning and self.sampler in ("telescopic", "fixed_exits"):
            # one run supervises several exits, so every pass is conditioned on the deepest one; evaluation
            # (and serving) conditions a run of ℓ passes on ℓ itself: the truncated exits would disagree
            raise ConfigError(
                f"schedule.sampler: {self.sampler} reads shallower exits out of one deeper run, whose passes the "
                "loop-conditioning heads condition on the deeper ℓ (evaluation conditions ℓ on itself): "
                "set model.loop_conditioning: false"
            )
        if self.weights and len(self.weights) != max_loops:
            raise ConfigError(f"schedule.weights: give {max_loops} weights (one per ℓ = 1..{max_loops})")
        bad = [d for d in self.telescopic_depths + self.exits if not 1 <= d <= max_loops]
        if bad:
            raise ConfigError(f"schedule: exit/depth {bad[0]} is outside [1, {max_loops}]")


@dataclasses.dataclass(frozen=True)
class DepthPlan:
    """What one micro-batch of one replica runs: ℓ passes, supervised at ``exits`` (ℓ included)."""

    loops: int
    exits: tuple[int, ...]


class ScheduleController:
    """Owns depth: phase, switch, per-micro-batch plans. Checkpointable via ``state_dict``."""

    def __init__(self, cfg: ScheduleConfig, *, max_loops: int, total_tokens: int, seed: int) -> None:
        cfg.validate_for(max_loops)
        self.cfg = cfg
        self.max_loops = max_loops
        self.anchor = cfg.loops or max_loops
        self.fixed_loops = cfg.fixed_loops or self.anchor
        self.total_tokens = total_tokens
        self.seed = seed
        self.phase: Literal["fixed", "mixed"] = "mixed" if cfg.switch_at == 0.0 else "fixed"
        self.switch_step: int | None = 0 if self.phase == "mixed" else None

    # --- phase ------------------------------------------------------------------------------
    def update(self, *, step: int, tokens_seen: int) -> bool:
        """Advance the phase before ``step``; True exactly at the step where the switch happens."""
        if self.phase == "fixed" and self.cfg.switch_at < 1.0 and tokens_seen >= self.cfg.switch_at * self.total_tokens:
            self.phase, self.switch_step = "mixed", step
            return True
        return False

    @property
    def mixed(self) -> bool:
        return self.phase == "mixed"

    # --- plans --------------------------------------------------------------------------------
    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *key])

    def _weights(self) -> np.ndarray:
        w = np.asarray(self.cfg.weights or [1.0] * self.max_loops, dtype=np.float64)
        return w / w.sum()

    def plan(self, *, step: int, micro: int, replica: int) -> DepthPlan:
        if not self.mixed:
            return DepthPlan(self.fixed_loops, (self.fixed_loops,))
        sampler = self.cfg.sampler
        if sampler == "fixed":
            return DepthPlan(self.anchor, (self.anchor,))
        if sampler == "per_step":  # one ℓ for every rank and micro-batch of the step (baseline) ...
            if self._rng(step, micro, replica, 4).random() < self.cfg.one_loop_fraction:
                return DepthPlan(1, (1,))  # ... but for the replicas the one-loop override picks (ELR's ablation)
            ell = 1 + int(self._rng(step, 1).choice(self.max_loops, p=self._weights()))
            return DepthPlan(ell, (ell,))
        if sampler == "independent_rank":
            rng = self._rng(step, micro, replica, 2)
            if rng.random() < self.cfg.one_loop_fraction:
                return DepthPlan(1, (1,))
            ell = 1 + int(rng.choice(self.max_loops, p=self._weights()))
            return DepthPlan(ell, (ell,))
        if sampler == "telescopic":
            return DepthPlan(self.anchor, (self._telescopic_exit(step, micro, replica), self.anchor))
        exits = tuple(sorted(set(self.cfg.exits)))  # fixed_exits
        return DepthPlan(max(exits), exits)

    def _telescopic_exit(self, step: int, micro: int, replica: int) -> int:
        """A random prefix depth < anchor (TLM): uniform, or from the configured density."""
        rng = self._rng(step, micro, replica, 3)
        depths = [d for d in (self.cfg.telescopic_depths or range(1, self.anchor)) if d < self.anchor]
        if not depths:
            return self.anchor
        if self.cfg.telescopic_weights:
            w = np.asarray([self.cfg.telescopic_weights[self.cfg.telescopic_depths.index(d)] for d in depths])
            return int(rng.choice(depths, p=w / w.sum()))
        return int(rng.choice(depths))

    def unused_passes(self) -> range:
        """Passes the fixed phase never ran (their attention is what ``init_unused_passes`` sets at the switch)."""
        return range(self.fixed_loops, self.max_loops) if self.switch_step != 0 else range(0)

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "switch_step": self.switch_step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phase = state["phase"]
        self.switch_step = state["switch_step"]
        self.seed = int(state["seed"])
