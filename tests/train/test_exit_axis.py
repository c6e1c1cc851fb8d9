"""``schedule.exit_axis: layer`` (TLM's own axis) and the sparse-exit baseline it is compared with.

The exit after core layer k of a non-looped stack is the stack truncated after layer k (+ the shared
final norm and output layer); telescopic training samples such prefixes; a fixed_exits baseline at
L/4, L/2, L is one setting of the telescopic dial, at equal training FLOPs (docs/exit-axis.md).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from elastic_pretrain.config import ConfigError
from elastic_pretrain.eval.loss import loss_by_loops, quality_curve
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig
from elastic_pretrain.parallel.pipeline import _loss_func
from elastic_pretrain.schedule import DepthPlan, ScheduleConfig, ScheduleController
from tests.conftest import REPO

PAR = ParallelConfig()
N = 8  # core layers of the stack in the schedule tests
SET = REPO / "jobs/experiments/exit-schedules"


def stack(**kw) -> ModelConfig:
    base = dict(
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        core_layers=4,
        num_experts=4,
        loops=1,
        moe_top_k=2,
        moe_ffn_hidden_size=32,
        moe_z_loss_coeff=0.0,
        moe_aux_loss_coeff=0.0,
        loop_conditioning=False,
    )
    return ModelConfig(**{**base, **kw})


def tokens(cfg: ModelConfig, rows: int = 2, cols: int = 17, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (rows, cols), generator=torch.Generator().manual_seed(seed))


def layer_ctl(**kw) -> ScheduleController:
    cfg = ScheduleConfig(exit_axis="layer", switch_at=0.0, **kw)
    return ScheduleController(cfg, max_loops=1, total_tokens=1000, seed=3, layers=N)


# --- the model: exit after layer k == the stack truncated after layer k ------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_layer_exit_equals_first_k_layers_then_final_norm_and_head(mesh1, k):
    """Naive reference from the model's own modules: embedding, prelude, megatron's full layer call of core
    layers 1..k, final norm, output layer — nothing of layers > k."""
    cfg = stack(prelude_layers=1)
    torch.manual_seed(0)
    model = build_model(cfg, PAR).eval()
    ids = tokens(cfg)[:, :-1]
    with torch.no_grad():
        got = model(ids, loops=1, exits=[k, 4], exit_axis="layer")
        rope = model.rotary_pos_emb(ids.shape[1])
        h = model.embedding(input_ids=ids, position_ids=None)
        for layer in model.prelude:
            h, _ = layer(h, attention_mask=None, rotary_pos_emb=rope)
        for core in list(model.core)[:k]:
            h, _ = core.full_layer(h, attention_mask=None, rotary_pos_emb=rope)
        logits, _ = model.output_layer(model.final_layernorm(h))
        want = logits[..., : cfg.vocab_size].transpose(0, 1)
    assert set(got) == {k, 4}
    torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5)
    if k == 4:  # the full-stack exit is the ordinary one-loop forward
        torch.testing.assert_close(got[4], model(ids, loops=1)[1], rtol=0, atol=0)


def test_layer_exit_equals_a_k_layer_model_with_the_same_weights(mesh1):
    """With a coda: exit k == a model built with k core layers (same embedding, prelude, layers 1..k, coda,
    norm and head), i.e. the coda and head are shared by every exit, as TLM's exits share the head."""
    cfg = stack(prelude_layers=1, coda_layers=1)
    torch.manual_seed(0)
    full = build_model(cfg, PAR).eval()
    k = 2
    short = build_model(stack(prelude_layers=1, coda_layers=1, core_layers=k), PAR).eval()
    state = {n: t for n, t in full.state_dict().items() if not n.startswith("core.") or int(n.split(".")[1]) < k}
    missing, unexpected = short.load_state_dict(state, strict=False)
    assert not [m for m in missing if not m.endswith("_extra_state")] and not unexpected
    ids = tokens(cfg)[:, :-1]
    with torch.no_grad():
        got = full(ids, loops=1, exits=[k], exit_axis="layer")
        want = short(ids, loops=1)[1]
    assert set(got) == {k}
    torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5)


def test_layer_exit_gradient_reaches_only_layers_up_to_k(mesh1):
    """Supervising exit k (besides the anchor) adds gradient to layers 1..k only: layers above k see the
    anchor's gradient alone, as a truncated prefix cannot lean on the layers above it."""
    cfg = stack()
    torch.manual_seed(0)
    model = build_model(cfg, PAR)
    t = tokens(cfg, seed=4)
    ids, labels = t[:, :-1], t[:, 1:]

    def grads(exits: tuple[int, ...]) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        objective, _, _ = _loss_func(
            DepthPlan(1, exits, axis="layer"), model(ids, labels=labels, loops=1, exits=exits, exit_axis="layer")
        )
        objective.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    anchor, both = grads((4,)), grads((2, 4))
    for name, g in both.items():
        layer = int(name.split(".")[1]) if name.startswith("core.") else None
        if layer is not None and layer >= 2:
            torch.testing.assert_close(g, anchor[name], rtol=0, atol=0)
    assert not torch.equal(
        both["core.0.passes.0.self_attention.linear_qkv.weight"],
        anchor["core.0.passes.0.self_attention.linear_qkv.weight"],
    )


@pytest.mark.parametrize("conditioned", [False, True], ids=["plain", "loop-conditioning-on"])
def test_evaluate_on_the_layer_axis_reads_every_layer_exit(mesh1, conditioned):
    """The one evaluator (eval/loss.py loss_by_loops, the trainer's validation) on the layer axis: loss after
    each layer k, the same numbers as the training forward's per-token losses at those exits — with the
    loop-conditioning head on too (both condition every exit on ℓ = 1)."""
    cfg = stack(loop_conditioning=conditioned)
    torch.manual_seed(0)
    model = build_model(cfg, PAR)
    t = tokens(cfg, rows=4, seed=5)
    if conditioned:
        with torch.no_grad():
            plain = loss_by_loops(model, t, loops=[1, 2], batch_size=2, exit_axis="layer")
            model.set_modes(conditioning=True)
            model.loop_conditioning.out.weight.normal_(0, 0.5)
        assert loss_by_loops(model, t, loops=[1, 2], batch_size=2, exit_axis="layer")[1] != pytest.approx(plain[1])
    val = loss_by_loops(model, t, loops=[1, 2, 3, 4], batch_size=2, exit_axis="layer")
    with torch.no_grad():
        per = model(t[:, :-1], labels=t[:, 1:], loops=1, exits=[1, 2, 3, 4], exit_axis="layer")
    assert sorted(val) == [1, 2, 3, 4]
    for k in val:
        assert val[k] == pytest.approx(float(per[k].double().mean()), rel=1e-6)
    assert len({round(v, 6) for v in val.values()}) == 4
    assert loss_by_loops(model, t, batch_size=2, exit_axis="layer") == val  # default: every layer 1..N
    curve = quality_curve(model, t, batch_size=2, exit_axis="layer")
    assert [p.loss for p in curve.points] == [val[k] for k in (1, 2, 3, 4)]
    xs = [p.relative_compute for p in curve.points]
    assert xs == sorted(xs) and xs[-1] == 1.0 and 0 < xs[0] < 0.5


# --- the schedule on the layer axis --------------------------------------------------------------------
def test_layer_axis_plans():
    fixed = ScheduleController(ScheduleConfig(exit_axis="layer"), max_loops=1, total_tokens=10, seed=0, layers=N)
    assert fixed.plan(step=0, micro=0, replica=0) == DepthPlan(1, (N,), group_loops=1, axis="layer")
    assert layer_ctl(sampler="fixed_exits", exits=[8, 2, 4]).plan(step=0, micro=0, replica=0) == DepthPlan(
        1, (2, 4, 8), group_loops=1, axis="layer"
    )
    plans = [layer_ctl(sampler="telescopic").plan(step=s, micro=m, replica=0) for s in range(300) for m in range(2)]
    assert all(p.loops == 1 and p.axis == "layer" and p.exits[-1] == N and len(p.exits) == 2 for p in plans)
    assert {p.exits[0] for p in plans} == set(range(1, N))


def test_telescopic_draws_several_prefix_exits_without_replacement():
    plans = [layer_ctl(sampler="telescopic", telescopic_draws=3).plan(step=s, micro=0, replica=0) for s in range(300)]
    assert all(len(p.exits) == 4 and len(set(p.exits)) == 4 and p.exits[-1] == N for p in plans)
    assert {e for p in plans for e in p.exits[:-1]} == set(range(1, N))


def test_one_draw_keeps_the_earlier_stream():
    """telescopic_draws: 1 (the default) draws exactly what the sampler drew before the option existed."""
    import numpy as np

    c = ScheduleController(ScheduleConfig(sampler="telescopic", switch_at=0.0), max_loops=4, total_tokens=10, seed=3)
    for s in range(20):
        old = int(np.random.default_rng([3, s, 1, 0, 3]).choice([1, 2, 3]))
        assert c.plan(step=s, micro=1, replica=0).exits == (old, 4)


def _matched_pair(weights: list[float] | None = None) -> tuple[ScheduleController, ScheduleController]:
    depths = list(range(1, N)) if weights else [2, 4]
    sparse = layer_ctl(sampler="fixed_exits", exits=[2, 4, N])
    tele = layer_ctl(
        sampler="telescopic", telescopic_depths=depths, telescopic_weights=weights or [1.0, 1.0], telescopic_draws=2
    )
    return sparse, tele


@pytest.mark.parametrize("weights", [None, [0, 1, 0, 3, 0, 0, 0]], ids=["listed", "one-hot-on-all-depths"])
def test_concentrated_telescopic_weights_recover_the_sparse_exit_baseline(weights):
    """Density on the baseline's prefix exits (L/4, L/2) with as many draws: every plan is the baseline's."""
    sparse, tele = _matched_pair(weights)
    for s in range(100):
        for m in range(2):
            for r in range(2):
                assert tele.plan(step=s, micro=m, replica=r) == sparse.plan(step=s, micro=m, replica=r)


def test_one_draw_concentrated_recovers_the_baseline_in_expectation(mesh1):
    """One draw concentrated on {L/4, L/2} with weights p: each plan supervises the anchor and one of the
    baseline's exits, drawn with frequency p, so the expected gradient is that of anchor + Σ p_d · loss_d —
    the baseline's objective with its prefix exits weighted by p (checked through the real loss function)."""
    ctl = layer_ctl(sampler="telescopic", telescopic_depths=[1, 2, 3], telescopic_weights=[0, 1, 3])
    seen = Counter(ctl.plan(step=s, micro=0, replica=0).exits for s in range(2000))
    assert set(seen) == {(2, N), (3, N)} and 0.70 < seen[(3, N)] / 2000 < 0.80
    cfg = stack()
    torch.manual_seed(0)
    model = build_model(cfg, PAR)
    t = tokens(cfg, seed=6)
    ids, labels = t[:, :-1], t[:, 1:]
    p = {2: 0.25, 3: 0.75}

    def grad_of(objective_fn) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        objective_fn(model(ids, labels=labels, loops=1, exits=[2, 3, 4], exit_axis="layer")).backward()
        return [q.grad.clone() for q in model.parameters() if q.grad is not None]

    expected = None
    for d, w in p.items():  # E over the draw of the telescopic step objective
        g = grad_of(lambda losses, d=d: _loss_func(DepthPlan(1, (d, 4), axis="layer"), losses)[0])
        expected = [w * x for x in g] if expected is None else [e + w * x for e, x in zip(expected, g, strict=True)]
    weighted = grad_of(lambda losses: losses[4].sum() + sum(w * losses[d].sum() for d, w in p.items()))
    for e, x in zip(expected, weighted, strict=True):  # fp32, summed in another order: ~1 ulp of O(1) terms
        torch.testing.assert_close(e, x, rtol=1e-5, atol=1e-6)


def test_equal_flops_pair_has_the_same_step_loss_and_gradients(mesh1):
    """The matched pair's plans drive the real step objective to identical losses and gradients."""
    sparse, tele = _matched_pair()
    cfg = stack(core_layers=N)
    torch.manual_seed(0)
    model = build_model(cfg, PAR)
    t = tokens(cfg, seed=7)
    out = []
    for ctl in (sparse, tele):
        plan = ctl.plan(step=5, micro=1, replica=0)
        model.zero_grad(set_to_none=True)
        losses = model(t[:, :-1], labels=t[:, 1:], loops=plan.loops, exits=plan.exits, exit_axis=plan.axis)
        objective, _, _ = _loss_func(plan, losses)
        objective.backward()
        out.append((objective.detach(), [q.grad.clone() for q in model.parameters() if q.grad is not None]))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1], strict=True))


# --- equal training FLOPs ------------------------------------------------------------------------------
def test_exit_schedule_jobs_are_matched_in_training_flops():
    from elastic_pretrain.experiments.analyses.exit_schedules import planned_training_flops

    flops = {p.stem: planned_training_flops(load_job(p), steps=20) for p in sorted(SET.glob("*.yaml"))}
    assert set(flops) == {"fixed-depth", "sparse-exits", "telescopic", "telescopic-dial", "telescopic-one-draw"}
    assert flops["telescopic"] == flops["sparse-exits"]
    assert flops["fixed-depth"] < flops["telescopic-one-draw"] < flops["telescopic"]
    # the density dial moves where the draw lands, not how many: the one-draw job's FLOPs, and only its exits
    assert flops["telescopic-dial"] == flops["telescopic-one-draw"]
    from elastic_pretrain.experiments.analyses.exit_schedules import DIAL_EXITS
    from elastic_pretrain.schedule import ScheduleController

    dial = load_job(SET / "telescopic-dial.yaml")
    ctl = ScheduleController(dial.schedule, max_loops=1, total_tokens=10**6, seed=1, layers=8)
    ctl.update(step=0, tokens_seen=0)
    drawn = {e for step in range(20) for e in ctl.plan(step=step, micro=0, replica=0).exits}
    assert drawn == {*DIAL_EXITS, 8}
    # the trainer's per-step count (train/mfu.py step_flops via the step's depth counts) agrees with the replay
    from elastic_pretrain.train.mfu import DepthCounts, step_flops

    job = load_job(SET / "sparse-exits.yaml")
    per_token = step_flops(
        job.model, DepthCounts(loops=1, exits=3, ghost_passes=0), seq_len=job.data.seq_len, micro_batch_tokens=1
    ).model
    assert flops["sparse-exits"] == pytest.approx(20 * job.tokens_per_step * per_token, rel=1e-12)


# --- contradictory settings: one line naming the fix ---------------------------------------------------
TINY = REPO / "jobs/tiny-cpu.yaml"
LAYER = [
    "model.loops=1",
    "model.flatten=1",
    "model.core_layers=4",
    "parallel=single",
    "schedule.exit_axis=layer",
    "schedule.sampler=telescopic",
    "schedule.switch_at=0.0",
]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["model.loops=2"], r"L_max = model.loops \* model.flatten = 2 passes: set model.loops=1 and model.flatten=1"),
        (["schedule.telescopic_depths=[1,5]"], r"exit/depth 5 is outside \[1, 4\] \(exit_axis: layer counts core "),
        (
            ["schedule.sampler=fixed_exits", "schedule.exits=[1,2]"],
            r"must include the full stack 4 .* add it, e\.g\. "
            r"exits: \[1, 2, 4\]",
        ),
        (["schedule.sampler=independent_rank"], r"draws loop counts.*use sampler telescopic, fixed_exits or fixed"),
        (["schedule.telescopic_draws=4"], r"only 3 depth\(s\) below the anchor 4 .* lower telescopic_draws"),
        (
            ["schedule.sampler=fixed_exits", "schedule.exits=[2,4]", "schedule.telescopic_draws=2"],
            r"applies to sampler telescopic only",
        ),
        (
            ["parallel=cpu-pp2"],
            r"parallel.pipeline=2 does not run with schedule.exit_axis=layer.*set parallel.pipeline=1",
        ),
        (["train.recompute=pass"], r"train.recompute=pass does not run .* set train.recompute=selective"),
        (
            ["model.kv_training=last_loop", "schedule.sampler=fixed"],
            r"model.kv_training=last_loop does not run .* set "
            r"model.kv_training=same_pass",
        ),
    ],
    ids=[
        "looped",
        "out-of-range",
        "no-anchor",
        "loop-sampler",
        "too-many-draws",
        "draws-elsewhere",
        "pipeline",
        "recompute",
        "kv",
    ],
)
def test_contradictory_layer_axis_settings_are_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_job(TINY, LAYER + overrides)
    assert "\n" not in str(err.value)


def test_layer_axis_job_builds_with_loop_conditioning_on():
    """Every layer exit is read out of one pass conditioned on ℓ = 1, in training and evaluation alike: no
    disagreement to refuse (unlike shared-prefix exits on the loop axis)."""
    job = load_job(TINY, [*LAYER, "model.loop_conditioning=true"])
    assert job.exit_depths == 4 and job.schedule.exit_axis == "layer"
    assert load_job(TINY).exit_depths == 4 and load_job(TINY).schedule.exit_axis == "loop"


def test_telescopic_without_a_prefix_depth_supervises_the_anchor_once():
    """No depth below the anchor to draw (anchor ℓ = 1): the plan is the anchor alone — before, the anchor was
    listed twice and its loss counted twice in the objective."""
    c = ScheduleController(
        ScheduleConfig(sampler="telescopic", switch_at=0.0, loops=1), max_loops=4, total_tokens=10, seed=0
    )
    assert c.plan(step=0, micro=0, replica=0) == DepthPlan(1, (1,))
