"""samplers: independent-rank (ELR) vs per-step vs the samplers that do not idle (issue 19 item 4).

Every arm trains with 2 processes (``slurm.nproc_per_node: 2``; the runner starts them through the launcher
of ``train --nproc-per-node``) at equal tokens, paired seeds (the seed sets initialisation, data order and
draws), mixed depth from the first step and ELR's 15% one-loop override in every arm, so that every token
sits at ℓ with the same probability in every arm and only *where* loop counts are mixed differs:

* EP = 2 (``cpu-ep2``: data-parallel 2, one expert-parallel group spanning both replicas):
  ``independent-rank`` (ELR: each replica draws its own ℓ per micro-batch; ghost passes), ``per-step`` (one
  ℓ per optimizer step; the override forces single replicas to ℓ = 1: ELR's "one-loop rank override"
  ablation), ``expert-group`` (one ℓ per micro-batch and EP group: here both replicas agree, so ℓ mixes
  across micro-batches only). EP-group ordering (``order: deep_first``) is not an arm: it runs ELR's draws
  in another order, the same gradient up to rounding (``tests/train/test_depth_order.py``, rtol 1e-5), so
  its losses are ELR's; on this shared machine its three runs did not fit the time (its depth efficiency
  is measured in docs/elastic-depth.md).
* DP = 2 without EP (each replica its own depth group; at EP = 2 with one group ``balance: compute`` has
  nothing to balance and deals what ``expert-group`` draws): ``balanced`` (compute-balanced: the replica
  that drew shallower bundles takes more micro-batches) against its own reference
  ``independent-rank-dp2`` (expert weights initialise per EP rank, so the layouts' initialisations differ).

Held-out loss at ℓ = 1 and L_max, depth efficiency (useful / executed passes), depth balance and wall time
per training token, from the runs' summaries.
"""

from __future__ import annotations

from typing import Any

from elastic_pretrain.experiments.measure import losses
from elastic_pretrain.experiments.present import figure, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings, Run
from elastic_pretrain.experiments.stats import Claim, paired

ELR = "seeds/003 (ELR)"
REFERENCE = "independent-rank"  # ELR at EP = 2: the reference of per-step and expert-group
REFERENCE_DP2 = "independent-rank-dp2"  # ELR at DP = 2 without EP: the reference of balanced
REFERENCES = {"per-step": REFERENCE, "expert-group": REFERENCE, "balanced": REFERENCE_DP2}
# "matches" band of the new samplers: ELR's own gap between synchronized and independent-rank sampling at ℓ = 1
# (1.6871 − 1.6774): a sampler that loses less than that keeps what independent-rank buys
BAND = 0.0097
WHERE = (
    '"What keeps the one-loop endpoint alive is how the recurrent state is updated and where loop counts are '
    'mixed inside an optimizer update, not a narrower loop range"'
)


def sampler_label(run: Run) -> str:
    s = run.job.schedule
    parts: list[str] = [s.sampler]
    if s.order != "draw":
        parts.append(f"order: {s.order}")
    if s.depth_group != "replica":
        parts.append(f"depth_group: {s.depth_group}")
    if s.balance != "off":
        parts.append(f"balance: {s.balance}")
    if s.one_loop_fraction:
        parts.append(f"one_loop_fraction {s.one_loop_fraction:g}")
    return " + ".join(parts)


def layout_label(run: Run) -> str:
    lay = run.summary.get("layout") or {"world_size": 1, "dp": 1, "ep": 1}
    return f"{lay['world_size']} proc, DP {lay['dp']}, EP {lay['ep']}"


def analyse(ctx: Context) -> Findings:
    top = ctx.runs[0].job.model.max_loops
    loss = {r.name: losses(ctx, r, [1, top]) for r in ctx.runs}
    ms = {r.name: 1e6 * r.seconds_per_step / r.job.tokens_per_step for r in ctx.runs}
    eff = {r.name: float(r.summary.get("depth_efficiency", 1.0)) for r in ctx.runs}
    bal = {r.name: float(r.summary.get("depth_balance", 1.0)) for r in ctx.runs}
    ghost = {r.name: float(r.summary.get("ghost_time_s", 0.0)) for r in ctx.runs}

    def delta(name: str, ell: int) -> str:
        ref = REFERENCES.get(name)
        return f"{loss[name][ell] - loss[ref][ell]:+.4f} vs {ref}" if ref in loss else "–"

    rows = [
        (
            r.name,
            sampler_label(r),
            layout_label(r),
            f"{loss[r.name][1]:.4f}",
            f"{loss[r.name][top]:.4f}",
            delta(r.name, 1),
            delta(r.name, top),
            f"{eff[r.name]:.3f}",
            f"{bal[r.name]:.3f}",
            f"{eff[r.name] * bal[r.name]:.3f}",
            f"{ghost[r.name]:.1f}",
            f"{ms[r.name]:.2f}",
        )
        for r in ctx.runs
    ]
    header = (
        "job", "sampler", "layout", "loss ℓ=1", f"loss ℓ={top}", "Δ ℓ=1", f"Δ ℓ={top}", "depth eff",
        "depth balance", "eff × balance", "ghost s", "ms / 1k tokens",
    )  # fmt: skip

    def draw(ax: Any) -> None:
        names = list(loss)
        for ell, style in ((1, "o"), (top, "s")):
            ax.plot(range(len(names)), [loss[n][ell] for n in names], style, label=f"ℓ = {ell}")
        ax.set_xticks(range(len(names)), names, fontsize=6, rotation=20)
        ax.set_ylabel("held-out loss (nats/token)")
        ax.legend(fontsize=7)

    reading = [
        f"{n}: ℓ=1 {loss[n][1]:.4f}, ℓ={top} {loss[n][top]:.4f}; depth efficiency {eff[n]:.3f}, balance {bal[n]:.3f}, "
        f"{ms[n]:.2f} ms per 1k tokens"
        for n in loss
    ]
    return Findings(
        tables=[table(header, rows)],
        reading=reading,
        numbers={
            "loss_by_run": loss,
            "ms_per_1k_tokens": ms,
            "depth_efficiency": eff,
            "depth_balance": bal,
            "ghost_time_s": ghost,
            "samplers": {r.name: sampler_label(r) for r in ctx.runs},
            "layouts": {r.name: r.summary.get("layout") for r in ctx.runs},
        },
        metrics={
            n: {
                "loss@1": loss[n][1],
                "loss@max": loss[n][top],
                "depth_efficiency": eff[n],
                "depth_balance": bal[n],
                "ms_per_1k_tokens": ms[n],
            }
            for n in loss
        },
        plot=lambda path: figure(path, draw),
        method=[
            "Every run: 2 gloo processes on one machine, started by the experiment runner through the launcher of "
            "`elastic-pretrain train --nproc-per-node 2` (`slurm.nproc_per_node: 2` in each job file).",
            "Every arm carries ELR's 15% one-loop override (`one_loop_fraction: 0.15`) over uniform ℓ ∈ 1..L_max: "
            "the same depth distribution per token in every arm. ELR applies its rank override to synchronized "
            "sampling (the per-step arm here); giving it to independent-rank too keeps the arms at equal depth mix.",
            "Depth efficiency = useful / executed passes (ghost passes of an EP group counted), depth balance = mean "
            "/ max passes per replica per step: the runs' own means over their steps (`summary.json`).",
            "Wall time per token: the run's training seconds / steps / tokens per step. The machine (2 cores) was "
            "shared with other jobs and the experiment ran niced, so wall times are indicative only: compare arms "
            "of one layout within one seed, never across reports.",
            "At DP = 2 without EP each replica is its own depth group, so `balance: compute` deals bundles between "
            "the two replicas; at EP = 2 with one group spanning both it would reduce to `expert-group` (nothing to "
            "balance). Its reference is ELR at the same layout (`independent-rank-dp2`): initialisations differ "
            "between layouts (megatron seeds each EP rank's experts apart).",
        ],
    )


def _matches(arm: str, metric: str, ell: str) -> Claim:
    ref = REFERENCES[arm]
    return Claim(
        paper=f"{WHERE} — does {arm} keep ELR's loss at ℓ = {ell}? (issue 19: the samplers that do not idle)",
        source=ELR,
        magnitude=f"matches within ±{BAND} nats (ELR's synchronized − independent-rank gap at ℓ = 1)",
        measure=f"{arm} minus {ref} held-out loss at ℓ = {ell} (nats)",
        value=paired(arm, ref, metric),
        expect="equal",
        margin=BAND,
    )


EXPERIMENT = Experiment(
    name="samplers",
    title="Depth samplers at 2 processes: independent-rank (ELR) vs per-step vs the samplers that do not idle",
    question="At equal tokens, paired seeds and the same depth distribution per token, does the sampler change the "
    "held-out loss at ℓ = 1 and ℓ = L_max, the depth efficiency and the wall time per token? Independent-rank "
    "draws (ELR), one ℓ per optimizer step, one ℓ per EP group (`depth_group: expert_group`) and "
    "compute-balanced mixed depth (`balance: compute`), 2 processes each.",
    analyse=analyse,
    claims=(
        Claim(
            paper='"Sampling one loop count per optimizer step and varying it across steps fails to preserve the '
            'one-loop endpoint even when one loop is drawn a third of the time" (0.5B: "a 15% one-loop rank '
            'override lowered it to 1.6830, independent-rank sampling reached 1.6774")',
            source=ELR,
            magnitude="−0.0056 nats at ℓ = 1 (independent-rank minus synchronized with the 15% rank override)",
            measure="independent-rank minus per-step held-out loss at ℓ = 1 (nats; both with the 15% override)",
            value=paired(REFERENCE, "per-step", "loss@1"),
            expect="negative",
        ),
        *(_matches(arm, "loss@1", "1") for arm in ("expert-group", "balanced")),
        *(_matches(arm, "loss@max", "L_max") for arm in ("expert-group", "balanced")),
    ),
)
