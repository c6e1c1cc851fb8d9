"""Measurements of a trained run that several analyses and the report share: held-out losses per loop
count, FLOPs, parameters, training compute, held-out routing health, and how far two runs' training paths
agree before a switch."""

from __future__ import annotations

import statistics

import torch

from elastic_pretrain.eval.loss import loss_by_loops
from elastic_pretrain.experiments.runner import Context, Run
from elastic_pretrain.model.flops import flops_breakdown, flops_per_token

ROUTING_STATS = ("confidence", "load_cv", "maxvio", "entropy")


def losses(ctx: Context, run: Run, loops: list[int] | None = None) -> dict[int, float]:
    """Held-out loss at each ℓ (default 1..L_max) of the run's final checkpoint."""
    return loss_by_loops(ctx.model(run.name), ctx.val_tokens(), loops)


def run_flops(run: Run, loops: float) -> float:
    """Forward FLOPs per token of the run's model at ``loops`` passes."""
    return flops_per_token(run.job.model, loops, seq_len=run.job.data.seq_len)


def max_flops(run: Run) -> float:
    return run_flops(run, run.job.model.max_loops)


def parameters(ctx: Context, run: Run) -> int:
    return sum(p.numel() for p in ctx.model(run.name).parameters())


def switch_step(run: Run) -> int | None:
    """The index of the run's first mixed-depth step (replayed from its schedule; None: it never switches)."""
    from elastic_pretrain.schedule import ScheduleController

    job = run.job
    ctl = ScheduleController(job.schedule, max_loops=job.model.max_loops,
                             total_tokens=run.steps * job.tokens_per_step, seed=job.train.seed)  # fmt: skip
    if ctl.mixed:
        return 0
    for step in range(run.steps):
        if ctl.update(step=step, tokens_seen=step * job.tokens_per_step):
            return step
    return None


def steps_apart_before_switch(run: Run, twin: Run) -> int:
    """Steps of ``run``'s fixed phase (before :func:`switch_step`) at which ``twin`` logged another training loss
    (``history.jsonl``, one entry per step); a step either history lacks counts as apart. 0: the two trained
    the same path, to the last bit, until the switch."""
    from elastic_pretrain.rundir import RunFiles
    from elastic_pretrain.train.trainer import read_history

    switch = switch_step(run)
    fixed = run.steps if switch is None else switch  # steps 1..fixed (1-based, as logged) ran the fixed phase
    a, b = ({h["step"]: h.get("loss") for h in read_history(RunFiles(r.run_dir).history, fixed)} for r in (run, twin))
    return sum(1 for step in range(1, fixed + 1) if step not in a or step not in b or a[step] != b[step])


def training_compute(run: Run) -> tuple[float, float]:
    """(mean passes per training micro-batch, training FLOPs = 3 x forward FLOPs summed over the tokens).

    Replays the run's depth plans (a pure function of seed, step, micro-batch and replica; schedule.py)
    for every data-parallel replica of the layout the run trained with (``summary.json``; expert-parallel
    groups of consecutive replicas, as megatron builds them at TP = 1); an extra supervised exit costs one
    more coda + output layer; ``model.kv_training: last_loop`` adds its no-grad forward of the ℓ passes and
    the coda at ℓ > 1 (docs/kv-training.md)."""
    from elastic_pretrain.schedule import ExpertLayout, ScheduleController

    job = run.job
    cfg, seq = job.model, job.data.seq_len
    layout = run.summary.get("layout") or {}
    dp, ep = int(layout.get("dp", 1)), int(layout.get("ep", 1))
    group = ep if int(layout.get("tp", 1)) == 1 and dp % ep == 0 else 1  # replicas per EP group
    key = {r: r - r % group for r in range(dp)}
    layouts = [ExpertLayout(group=tuple(range(key[r], key[r] + group)), key=key) for r in range(dp)]
    micro = job.train.micro_batches(dp)
    tokens_per_micro = job.train.micro_batch_size * seq
    ctl = ScheduleController(
        job.schedule,
        max_loops=cfg.max_loops,
        total_tokens=run.steps * job.tokens_per_step,
        seed=job.train.seed,
        layers=cfg.core_layers_built,
    )
    passes, flops, n = 0.0, 0.0, 0
    for step in range(run.steps):
        ctl.update(step=step, tokens_seen=step * job.tokens_per_step)
        plans = [
            p
            for r in range(dp)
            for _, p in (
                ctl.balanced_plans(step=step, micro_batches=micro, replica=r, replicas=dp, layout=layouts[r])
                if ctl.balanced
                else ctl.step_plans(step=step, micro_batches=micro, replica=r, layout=layouts[r])
            )
        ]
        for plan in plans:
            b = flops_breakdown(cfg, plan.loops, seq_len=seq)
            coda = b.edges * cfg.coda_layers / max(1, cfg.prelude_layers + cfg.coda_layers)
            # model.kv_training last_loop: a no-grad forward first (at ℓ > 1; at ℓ = 1 only beside a deeper EP partner)
            pre_run = plan.loops * b.core_pass + coda if cfg.kv_training == "last_loop" and plan.loops > 1 else 0.0
            passes += plan.loops
            flops += tokens_per_micro * (3 * (b.total + (len(plan.exits) - 1) * (coda + b.output)) + pre_run)
            n += 1
    return passes / max(1, n), flops


@torch.no_grad()
def held_out_routing(ctx: Context, run: Run) -> dict[str, float]:
    """Routing health on held-out tokens at ℓ = L_max, averaged over every (layer, pass) router call."""
    from elastic_pretrain.train.step import reduce_routing

    net = ctx.model(run.name)
    tokens = ctx.val_tokens()
    net.start_routing_probe()
    try:
        for start in range(0, tokens.shape[0], 8):
            net(tokens[start : start + 8, :-1], loops=net.cfg.max_loops)
    finally:
        probe = net.stop_routing_probe()
    stats = reduce_routing(probe)
    return {s: statistics.fmean(v[s] for v in stats.values()) for s in ROUTING_STATS}
