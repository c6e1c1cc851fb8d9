"""The schedule controller: the one object that owns depth during training.

Phase ``fixed`` (every micro-batch at ``schedule.fixed_loops``: 1 in ELR's recipe and the default of a
late switch to a mixed sampler, else the anchor ``schedule.loops``) until ``switch_at`` of the run's tokens,
then ``mixed``, where the configured sampler picks each micro-batch's loop count ℓ and the exits
that are supervised. Draws are pure functions of (seed, step, micro-batch, replica), so a resumed
run draws exactly what an uninterrupted run would, and all TP/PP ranks of one replica agree — and
every rank can compute the plans of the other replicas of its expert-parallel group, hence the
loop count the group's MoE all-to-alls run for, without a collective (:meth:`ScheduleController.step_plans`).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Literal

import numpy as np

from elastic_pretrain.config import INT_LIMIT, ConfigError, field
from elastic_pretrain.jsonsafe import choice, count, mapping

Sampler = Literal["fixed", "independent_rank", "per_step", "telescopic", "fixed_exits"]
DepthGroup = Literal["replica", "expert_group"]
Order = Literal["draw", "deep_first"]
Balance = Literal["off", "compute"]
UnusedPassInit = Literal["copy_pass0", "as_initialised"]
ExitAxis = Literal["loop", "layer"]
# Samplers that mix ℓ across replicas/steps after the switch: ELR's mixed phase.
MIXED_SAMPLERS = ("independent_rank", "per_step")


@dataclasses.dataclass(kw_only=True)
class ScheduleConfig:
    """Depth during training (ELR fixed→mixed switch; TLM telescopic; Matryoshka fixed exits)."""

    sampler: Sampler = field("fixed", doc="How ℓ is chosen in the mixed phase (see docs/elastic-depth.md).")
    loops: int | None = field(None, doc="The anchor depth (sampler fixed, telescopic); None = L_max.")
    fixed_loops: int | None = field(
        None,
        doc="ℓ of the fixed phase before switch_at. None = 1 for a late switch (0 < switch_at < 1) to a mixed "
        "sampler (independent_rank, per_step: ELR pretrains at one loop, the non-looped baseline's compute), "
        "else the anchor (loops).",
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
    telescopic_draws: int = field(
        1,
        doc="telescopic: prefix exits drawn per micro-batch besides the anchor, without replacement (TLM: 1). "
        "Set it to len(exits) - 1 of a fixed_exits baseline to match its training FLOPs (docs/exit-axis.md).",
    )
    exits: list[int] = field(factory=list, doc="fixed_exits: the only supervised exits (Matryoshka baseline).")
    exit_axis: ExitAxis = field(
        "loop",
        doc="What an exit counts: loop counts ℓ (loop), or core layers of a non-looped stack (layer: TLM's own axis; "
        "model.loops * model.flatten = 1, the anchor is all core layers; docs/exit-axis.md).",
    )
    depth_group: DepthGroup = field(
        "replica",
        doc="independent_rank: who draws one ℓ per micro-batch: each replica (ELR), or each expert-parallel group "
        "(ranks that exchange tokens agree, so nobody idles in ghost passes; groups still mix ℓ within a step).",
    )
    order: Order = field(
        "draw",
        doc="Order a replica runs its micro-batches in: as drawn, or deep_first (sorted by ℓ, so the deep ones of "
        "an expert-parallel group run together; same draws, same gradient sum up to rounding).",
    )

    balance: Balance = field(
        "off",
        doc="independent_rank: compute = compute-balanced mixed depth: ℓ is drawn per bundle of micro-batches (one "
        "per replica of a depth group) and bundles are dealt to depth groups so that every replica executes about "
        "the same passes per step (replicas at fewer loops take more micro-batches of the same global batch); the "
        "loss is the plain per-token mean over the global batch (docs/elastic-depth.md). off: each replica runs "
        "its own micro-batches.",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.switch_at <= 1.0:
            raise ConfigError(f"switch_at: {self.switch_at} must be in [0, 1] (0 = mixed from scratch, 1 = never)")
        if not 0.0 <= self.one_loop_fraction <= 1.0:
            raise ConfigError(f"one_loop_fraction: {self.one_loop_fraction} must be in [0, 1]")
        if any(w < 0 for w in self.weights + self.telescopic_weights) or (self.weights and sum(self.weights) <= 0):
            raise ConfigError("weights: must be non-negative with a positive sum")
        if self.telescopic_weights and len(self.telescopic_weights) != len(self.telescopic_depths):
            raise ConfigError("telescopic_weights: give one weight per entry of telescopic_depths")
        if self.telescopic_draws < 1 or (self.telescopic_draws != 1 and self.sampler != "telescopic"):
            raise ConfigError(
                f"schedule.telescopic_draws: {self.telescopic_draws} must be >= 1 and applies to "
                "sampler telescopic only: remove it or set sampler: telescopic"
            )
        if self.depth_group != "replica" and self.sampler != "independent_rank":
            raise ConfigError(
                f"schedule.depth_group: {self.depth_group} applies to sampler independent_rank only "
                f"(got {self.sampler}); remove depth_group or set sampler: independent_rank"
            )
        if self.balance != "off" and self.sampler != "independent_rank":
            raise ConfigError(
                f"schedule.balance: {self.balance} applies to sampler independent_rank only "
                f"(got {self.sampler}); remove balance or set sampler: independent_rank"
            )
        if self.sampler == "fixed_exits" and not self.exits:
            raise ConfigError("exits: fixed_exits needs the list of supervised exits, e.g. exits: [1, 2, 4]")
        if self.fixed_loops is None and self.sampler in MIXED_SAMPLERS and 0.0 < self.switch_at < 1.0:
            # ELR's recipe: "pretrain at a fixed loop count (one loop), then switch to mixed depth". An unset
            # value used to fall back to the anchor (L_max): a job called ELR trained its fixed phase at 4
            # loops, 4x the compute ELR's baseline spends (issue 32). The resolved config says 1.
            self.fixed_loops = 1
        if self.sampler != "fixed" and self.switch_at == 1.0:
            raise ConfigError(
                f"schedule.sampler: {self.sampler} never runs with switch_at: 1.0 (the whole run stays at fixed depth):"
                " set schedule.switch_at (0 = from the start, e.g. 0.75 = ELR's late switch) or sampler: fixed"
            )

    def validate_for(self, max_loops: int, *, loop_conditioning: bool = False, layers: int | None = None) -> None:
        """Checks that need the model's L_max (whether it has loop-count conditioning heads, and its core layers)."""
        for name in ("loops", "fixed_loops"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= max_loops:
                raise ConfigError(f"schedule.{name}={value} is outside [1, {max_loops}]: pick a value in that range")
        if self.exit_axis == "layer":
            self._validate_layer_axis(max_loops, layers)
        elif loop_conditioning and self.sampler in ("telescopic", "fixed_exits"):
            # one run supervises several exits, so every pass is conditioned on the deepest one; evaluation
            # (and serving) conditions a run of ℓ passes on ℓ itself: the truncated exits would disagree.
            # (On the layer axis every exit is read out of one pass conditioned on ℓ = 1, in training and eval.)
            raise ConfigError(
                f"schedule.sampler: {self.sampler} reads shallower exits out of one deeper run, whose passes the "
                "loop-conditioning heads condition on the deeper ℓ (evaluation conditions ℓ on itself): "
                "set model.loop_conditioning: false"
            )
        if self.weights and len(self.weights) != max_loops:
            raise ConfigError(f"schedule.weights: give {max_loops} weights (one per ℓ = 1..{max_loops})")
        top, unit = (layers or 0, "core layers") if self.exit_axis == "layer" else (max_loops, "loop counts")
        bad = [d for d in self.telescopic_depths + self.exits if not 1 <= d <= top]
        if bad:
            raise ConfigError(
                f"schedule: exit/depth {bad[0]} is outside [1, {top}] (exit_axis: {self.exit_axis} "
                f"counts {unit}): pick exits in that range"
            )
        if self.sampler == "telescopic":
            anchor = top if self.exit_axis == "layer" else (self.loops or max_loops)
            have = len(self.telescopic_candidates(anchor))
            if self.telescopic_draws > 1 and have < self.telescopic_draws:
                raise ConfigError(
                    f"schedule.telescopic_draws: {self.telescopic_draws} prefix exits per micro-batch, but only {have} "
                    f"depth(s) below the anchor {anchor} can be drawn (with weight > 0): lower telescopic_draws or "
                    "list more telescopic_depths"
                )

    def _validate_layer_axis(self, max_loops: int, layers: int | None) -> None:
        if max_loops != 1:
            raise ConfigError(
                f"schedule.exit_axis: layer exits after the core layers of a non-looped stack, but the model runs "
                f"L_max = model.loops * model.flatten = {max_loops} passes: set model.loops=1 and model.flatten=1, "
                "or exit_axis: loop"
            )
        if layers is None:
            raise ValueError("validate_for: exit_axis layer needs the model's core layer count (layers=...)")
        if self.sampler in ("independent_rank", "per_step"):
            raise ConfigError(
                f"schedule.sampler: {self.sampler} draws loop counts, and a non-looped stack has one: on exit_axis: "
                "layer use sampler telescopic, fixed_exits or fixed"
            )
        if self.sampler == "fixed_exits" and layers not in self.exits:
            raise ConfigError(
                f"schedule.exits: {self.exits} on exit_axis: layer must include the full stack {layers} (the anchor; "
                f"its head is shared by every exit): add it, e.g. exits: {_sparse_example(layers)}"
            )

    def telescopic_candidates(self, anchor: int) -> list[int]:
        """The prefix depths a telescopic exit is drawn from: below ``anchor``, listed (or all), weight > 0."""
        if not self.telescopic_depths:
            return list(range(1, anchor))
        w = self.telescopic_weights or [1.0] * len(self.telescopic_depths)
        return [d for d, x in zip(self.telescopic_depths, w, strict=True) if d < anchor and x > 0]


def _sparse_example(layers: int) -> list[int]:
    """Matryoshka-style sparse exits L/4, L/2, L (the ones that exist)."""
    return sorted({d for d in (layers // 4, layers // 2, layers) if d >= 1})


@dataclasses.dataclass(frozen=True)
class DepthPlan:
    """What one micro-batch of one replica runs: ℓ passes, supervised at ``exits`` (ℓ included).

    ``axis`` layer (``schedule.exit_axis``): one pass (ℓ = 1) through a non-looped stack, supervised after
    the core layers ``exits`` (the full stack included)."""

    loops: int
    exits: tuple[int, ...]
    # passes the expert-parallel group's MoE calls run for (max ℓ over the group; ghosts beyond ``loops``);
    # None: not known locally (a hand-built plan), and the step agrees on it with a collective
    group_loops: int | None = None
    axis: ExitAxis = "loop"


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Which replicas share this rank's expert-parallel group, and which replica keys a group's draw.

    ``group``: the replicas of this rank's EP group (its MoE all-to-alls pair with theirs).
    ``key``: replica → the smallest replica of its *depth group*, the replicas linked through EP
    groups (all TP/PP ranks of a replica must draw the same ℓ even when they sit in different EP groups).
    Built once at start-up by ``parallel/mesh.py: expert_layout``."""

    group: tuple[int, ...]
    key: dict[int, int]

    @staticmethod
    def single(replica: int) -> ExpertLayout:
        return ExpertLayout(group=(replica,), key={replica: replica})


class ScheduleController:
    """Owns depth: phase, switch, per-micro-batch plans. Checkpointable via ``state_dict``."""

    def __init__(
        self, cfg: ScheduleConfig, *, max_loops: int, total_tokens: int, seed: int, layers: int | None = None
    ) -> None:
        cfg.validate_for(max_loops, layers=layers)
        self.cfg = cfg
        self.max_loops = max_loops
        self.anchor = cfg.loops or max_loops
        self.layers = layers or 0  # exit_axis layer: the core layers of the stack (its anchor)
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
        if self.cfg.exit_axis == "layer":
            return self._layer_plan(step, micro, replica)
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
            rng = self._rng(step, micro, replica, 2)  # replica: the group's key under depth_group=expert_group
            if rng.random() < self.cfg.one_loop_fraction:
                return DepthPlan(1, (1,))
            ell = 1 + int(rng.choice(self.max_loops, p=self._weights()))
            return DepthPlan(ell, (ell,))
        if sampler == "telescopic":
            return DepthPlan(self.anchor, (*self._telescopic_exits(step, micro, replica, self.anchor), self.anchor))
        exits = tuple(sorted(set(self.cfg.exits)))  # fixed_exits
        return DepthPlan(max(exits), exits)

    def _layer_plan(self, step: int, micro: int, replica: int) -> DepthPlan:
        """``exit_axis: layer``: one pass through the stack; the exits are core layers, the anchor all of them
        (TLM, seeds/001: "run the model only up to that depth, and train that truncated prefix against the
        full next-token target. Alongside that, they run one full-capacity pass")."""
        full, sampler = self.layers, self.cfg.sampler
        if not self.mixed or sampler == "fixed":
            exits: tuple[int, ...] = (full,)
        elif sampler == "telescopic":
            exits = (*self._telescopic_exits(step, micro, replica, full), full)
        else:  # fixed_exits (validated to include the full stack)
            exits = tuple(sorted(set(self.cfg.exits)))
        return DepthPlan(1, exits, group_loops=1, axis="layer")

    def step_plans(
        self, *, step: int, micro_batches: int, replica: int, layout: ExpertLayout | None = None
    ) -> list[tuple[int, DepthPlan]]:
        """This replica's (micro-batch index, plan) pairs of ``step``, in the order to run them.

        Each plan carries ``group_loops``, the EP group's maximum ℓ, computed here from the other
        replicas' draws (plans are pure functions of seed, step, micro-batch and replica): no
        agreement collective per micro-batch. Under ``order: deep_first`` every replica runs its
        micro-batches by decreasing ℓ (ties by index), so the EP group's deep ones coincide."""
        layout = layout or ExpertLayout.single(replica)
        group = self.cfg.depth_group == "expert_group"

        def draws(r: int) -> list[DepthPlan]:
            rr = layout.key.get(r, r) if group else r
            return [self.plan(step=step, micro=i, replica=rr) for i in range(micro_batches)]

        def run_order(r: int) -> list[DepthPlan]:  # replica r's plans in the order r runs them
            plans = draws(r)
            return [plans[i] for i in self._ordered(plans)]

        mine = draws(replica)
        peers = [run_order(r) for r in layout.group if r != replica]
        out = []
        for pos, i in enumerate(self._ordered(mine)):
            top = max([mine[i].loops] + [p[pos].loops for p in peers])
            out.append((i, dataclasses.replace(mine[i], group_loops=top)))
        return out

    @property
    def balanced(self) -> bool:
        """Compute-balanced mixed depth: replicas run :meth:`balanced_plans` (slots of the global batch)."""
        return self.cfg.balance == "compute"

    def balanced_plans(
        self, *, step: int, micro_batches: int, replica: int, replicas: int, layout: ExpertLayout | None = None
    ) -> list[tuple[int, DepthPlan]]:
        """Compute-balanced mixed depth: this replica's (global micro-batch slot, plan) pairs of ``step``.

        The step's global batch is ``micro_batches × replicas`` micro-batches ("slots", the data loader's
        order). A *depth group* (the replicas linked through expert-parallel groups, ``layout.key``; each
        replica alone without EP) of E replicas takes slots in *bundles* of E consecutive slots, one per
        member, all at one ℓ: the group's MoE all-to-alls pair up with no ghost pass. Each bundle draws
        its ℓ i.i.d. from ``weights`` (and the one-loop override), so every token of the global batch
        is at ℓ with probability w_ℓ — the per-token distribution ``independent_rank`` draws, and the
        plain token mean over the global batch is its unbiased estimator (no importance weights; the
        step weights every token 1 / global tokens, session.wrap_ddp). Bundles are then dealt, deepest
        first, each to the depth group with the fewest passes so far (ties: the smaller key; LPT
        scheduling): the groups' pass totals differ by at most L_max (the group that ends highest was the
        lowest when it took its last bundle), so a group whose bundles are shallow takes more of them.
        Pure in (seed, step): every rank deals the same hands."""
        layout = layout or ExpertLayout.single(replica)
        key = {r: layout.key.get(r, r) for r in range(replicas)}
        members: dict[int, list[int]] = {}
        for r in range(replicas):
            members.setdefault(key[r], []).append(r)
        size = len(members[key[replica]])
        if any(len(m) != size for m in members.values()):  # megatron's EP groups are equal in size
            raise ValueError(f"depth groups of unequal size: {sorted(map(len, members.values()))}")
        n_bundles = micro_batches * replicas // size
        if self.mixed:
            rng = self._rng(step, 5)
            ell = 1 + rng.choice(self.max_loops, size=n_bundles, p=self._weights())
            ell[rng.random(n_bundles) < self.cfg.one_loop_fraction] = 1
        else:
            ell = np.full(n_bundles, self.fixed_loops)
        loads = [(0, g) for g in sorted(members)]  # (passes dealt, group key): a heap
        mine: list[int] = []
        for b in sorted(range(n_bundles), key=lambda b: (-int(ell[b]), b)):
            load, g = heapq.heappop(loads)
            heapq.heappush(loads, (load + int(ell[b]), g))
            if g == key[replica]:
                mine.append(b)
        j = members[key[replica]].index(replica)
        return [(b * size + j, DepthPlan(int(ell[b]), (int(ell[b]),), group_loops=int(ell[b]))) for b in mine]

    def _ordered(self, plans: list[DepthPlan]) -> list[int]:
        idx = list(range(len(plans)))
        return sorted(idx, key=lambda i: -plans[i].loops) if self.cfg.order == "deep_first" else idx

    def _telescopic_exits(self, step: int, micro: int, replica: int, anchor: int) -> tuple[int, ...]:
        """``telescopic_draws`` random prefix depths < ``anchor`` (TLM), sorted: uniform, or from the configured
        density, without replacement. Concentrated on the sparse exits of a fixed_exits baseline with as many
        draws as it has prefix exits, every draw is exactly that baseline's exits (tests/train/test_exit_axis.py)."""
        rng = self._rng(step, micro, replica, 3)
        depths = [d for d in (self.cfg.telescopic_depths or range(1, anchor)) if d < anchor]
        if not depths:
            return ()  # the anchor alone (an exit list is a set: the plan does not repeat it)
        p = None
        if self.cfg.telescopic_weights:
            w = np.asarray([self.cfg.telescopic_weights[self.cfg.telescopic_depths.index(d)] for d in depths])
            p = w / w.sum()
        if self.cfg.telescopic_draws == 1:  # the one-draw stream of earlier runs, kept bit for bit
            return (int(rng.choice(depths, p=p)),)
        return tuple(sorted(int(d) for d in rng.choice(depths, size=self.cfg.telescopic_draws, replace=False, p=p)))

    def unused_passes(self) -> range:
        """Passes the fixed phase never ran (their attention is what ``init_unused_passes`` sets at the switch)."""
        return range(self.fixed_loops, self.max_loops) if self.switch_step != 0 else range(0)

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "switch_step": self.switch_step,
            "seed": self.seed,
            "total_tokens": self.total_tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's phase, and its ``total_tokens``: the switch point (``switch_at`` of them) belongs to
        the run's schedule, fixed by the ``train.steps`` it started with, like megatron's LR horizon. A larger
        ``train.steps`` on resume adds steps at the schedule's end instead of moving the switch (issue 33).
        A checkpoint written before the count was saved keeps this job's."""
        self.phase, self.switch_step, self.seed, total_tokens = self.check_state(state)
        if total_tokens is not None:
            self.total_tokens = total_tokens

    @staticmethod
    def check_state(state: Any) -> tuple[Literal["fixed", "mixed"], int | None, int, int | None]:
        """(phase, switch step, seed, total tokens or None when not saved) of a saved state, each in range, else
        :class:`StateError` (trainer.json comes from whoever shared the checkpoint: docs/security.md)."""
        state = mapping(state, "controller")
        phase: Literal["fixed", "mixed"] = choice(state, "phase", "controller", ("fixed", "mixed"))
        # fixed: the switch has not happened yet
        switch = (
            choice(state, "switch_step", "controller", (None,))
            if phase == "fixed"
            else count(state, "switch_step", "controller")
        )
        seed = count(state, "seed", "controller", high=INT_LIMIT)  # numpy's SeedSequence: non-negative
        # the run's token horizon (the switch point's base); absent in checkpoints written before issue 33
        total = count(state, "total_tokens", "controller", low=1) if "total_tokens" in state else None
        return phase, switch, seed, total
