"""depth-premise: on a corpus whose answers need 1..6 sequential lookups (``data: depth-pays``), does the
looped model trained at fixed depth ℓ = L_max beat the same model trained at ℓ = 1 (issue 32)?

Every depth claim of the papers presupposes that extra depth pays: ELR's "four loops adding 7.25 and 4.75
points", TaH2's decider giving passes to the tokens that need them, TLM's prefixes below the full depth. On
the byte corpus at this scale it does not (docs/results/README.md). This report checks the premise where it
can hold, per true difficulty of the predicted token (data/synthetic.py: the number of lookups its answer
needs; 0 for every other token), so that a verdict says *which* tokens depth pays on.

The two arms train on the same tokens with the same seed (initialisation and data order): ``fixed-1`` at one
pass (prelude, pass 0, coda) and ``fixed-max`` at L_max = 4 passes (prelude, passes 0..3, coda).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_pretrain.data.difficulty import load_difficulty
from elastic_pretrain.eval.difficulty import DifficultyTable, by_difficulty
from elastic_pretrain.experiments.present import figure, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings
from elastic_pretrain.experiments.stats import Claim, Metrics

SOURCE = "seeds/003 (ELR), seeds/000 (TaH2); the premise issue 32 asks for"
SHALLOW, DEEP = "fixed-1", "fixed-max"
MULTI = 2  # answers needing at least this many lookups: what one pass cannot do by a single lookup


def _deep_minus_shallow(key: str) -> Callable[[Metrics], float]:
    return lambda m: m[DEEP][key] - m[SHALLOW][key]


def _cell(tab: DifficultyTable, ell: int, levels: list[int]) -> tuple[float, float, int]:
    """Token-weighted (loss, accuracy, count) over ``levels`` at ℓ."""
    cells = [tab.cells[ell][k] for k in levels if k in tab.cells[ell]]
    n = sum(c.count for c in cells)
    if n == 0:
        return float("nan"), float("nan"), 0
    return (sum(c.loss * c.count for c in cells) / n, sum(c.accuracy * c.count for c in cells) / n, n)


def arm_metrics(tab: DifficultyTable, ell: int) -> dict[str, float]:
    """One arm's metrics at ℓ: every token, answers, multi-hop answers, and each difficulty."""
    hard = [k for k in tab.levels if k > 0]
    out: dict[str, float] = {}
    for name, levels in (("all", tab.levels), ("answers", hard), (f"d>={MULTI}", [k for k in hard if k >= MULTI]),
                         *((f"d={k}", [k]) for k in hard)):  # fmt: skip
        loss, acc, _ = _cell(tab, ell, levels)
        out[f"loss[{name}]"], out[f"acc[{name}]"] = loss, acc
    return out


def analyse(ctx: Context) -> Findings:
    tokens = ctx.val_tokens()
    labels = load_difficulty(ctx.runs[0].job.data, num_sequences=tokens.shape[0])
    if labels is None:
        raise ValueError(f"{ctx.runs[0].job.data.validation}: no per-token difficulty; use data: depth-pays")
    tabs = {r.name: by_difficulty(ctx.model(r.name), tokens, labels) for r in ctx.runs}
    trained = {r.name: r.job.schedule.fixed_loops or r.job.schedule.loops or r.job.model.max_loops for r in ctx.runs}
    metrics = {name: arm_metrics(tab, trained[name]) for name, tab in tabs.items()}
    hard = [k for k in tabs[DEEP].levels if k > 0]
    top = trained[DEEP]
    gaps = {k: metrics[DEEP][f"loss[d={k}]"] - metrics[SHALLOW][f"loss[d={k}]"] for k in hard}
    acc_gaps = {k: metrics[DEEP][f"acc[d={k}]"] - metrics[SHALLOW][f"acc[d={k}]"] for k in hard}
    reading = [
        f"{DEEP} at ℓ = {top} minus {SHALLOW} at ℓ = 1, loss per difficulty: "
        + ", ".join(f"d={k} {v:+.3f}" for k, v in gaps.items())
        + "; accuracy: " + ", ".join(f"d={k} {v:+.2f}" for k, v in acc_gaps.items()) + ".",
        f"All held-out tokens: {metrics[DEEP]['loss[all]']:.4f} ({DEEP}, ℓ = {top}) vs "
        f"{metrics[SHALLOW]['loss[all]']:.4f} ({SHALLOW}, ℓ = 1); answer tokens "
        f"{metrics[DEEP]['loss[answers]']:.4f} vs {metrics[SHALLOW]['loss[answers]']:.4f}.",
    ]
    predicted = tokens.shape[0] * (tokens.shape[1] - 1)
    return Findings(
        tables=[curve_table(tabs, trained)],
        reading=reading,
        numbers={"by_difficulty": {n: t.to_json() for n, t in tabs.items()}, "trained_loops": trained},
        metrics=metrics,
        plot=lambda path: plot_difficulty(tabs, trained, path),
        method=[
            "Difficulty of a token = the lookups its value needs (data/synthetic.py's reference solver, stored "
            "beside the tokens by prepare-data: data/difficulty.py); 0 for every token that is not an answer. "
            "A token's loss is scored under the difficulty of the token predicted.",
            f"Both arms are evaluated at every ℓ = 1..L_max; the claims compare each at the depth it trained at "
            f"({SHALLOW}: 1, {DEEP}: {top}). `d>={MULTI}`: answers needing {MULTI} or more lookups.",
        ],
        held_out=f"the first {tokens.shape[0]} sequences of the validation split ({predicted:,} predicted tokens; "
        "documents never trained on, chosen by a hash of their name)",
    )


def curve_table(tabs: dict[str, DifficultyTable], trained: dict[str, int]) -> str:
    """Loss / accuracy per (arm, ℓ) and true difficulty, then all answers and all tokens."""
    deep = tabs[DEEP]
    hard = [k for k in deep.levels if k > 0]
    rows = []
    for name, tab in tabs.items():
        for ell in tab.loops:
            mark = " (trained)" if ell == trained[name] else ""
            cells = [_cell(tab, ell, [k]) for k in hard] + [_cell(tab, ell, hard), _cell(tab, ell, tab.levels)]
            rows.append((f"{name}{mark}", ell, *(f"{loss:.3f} / {acc:.2f}" for loss, acc, _ in cells)))
    counts = [_cell(deep, deep.loops[0], [k])[2] for k in hard]
    total = _cell(deep, deep.loops[0], deep.levels)[2]
    header = ("arm", "ℓ", *(f"d={k} ({n:,})" for k, n in zip(hard, counts)), f"answers ({sum(counts):,})",
              f"all tokens ({total:,})")  # fmt: skip
    return ("Loss (nats/token) / next-token accuracy per ℓ and true difficulty of the predicted token (tokens "
            "scored in brackets):\n\n" + table(header, rows))  # fmt: skip


def plot_difficulty(tabs: dict[str, DifficultyTable], trained: dict[str, int], path: Path) -> Any:
    """Loss and accuracy against true difficulty, one line per (arm, ℓ); the trained depth drawn solid."""

    def draw(axes: Any) -> None:
        for name, tab in tabs.items():
            hard = [k for k in tab.levels if k > 0]
            for ell in tab.loops:
                own = ell == trained[name]
                if not own and name == SHALLOW:
                    continue  # fixed-1 never ran passes 2..4: its deeper exits are untrained noise
                style = dict(marker="o", linestyle="-" if own else ":", label=f"{name} ℓ={ell}")
                axes[0].plot(hard, [tab.cells[ell][k].loss for k in hard], **style)
                axes[1].plot(hard, [tab.cells[ell][k].accuracy for k in hard], **style)
        axes[0].set_ylabel("held-out loss (nats/token)")
        axes[1].set_ylabel("next-token accuracy")
        for ax in axes:
            ax.set_xlabel("true difficulty (lookups the answer needs)")
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7)

    return figure(path, draw, panels=2)


PREMISE = Claim(
    paper='Depth pays: the premise of every depth claim ("four loops adding 7.25 and 4.75 points", ELR; '
    "adaptive depth that \"keeps gaining\" with more iterations, TaH2)",
    source=SOURCE,
    magnitude="ELR: −0.058 nat at five loops (0.5B); here: any resolved gain",
    measure=f"{DEEP} at ℓ = L_max minus {SHALLOW} at ℓ = 1, all held-out tokens (nats)",
    value=_deep_minus_shallow("loss[all]"),
    expect="negative",
    kind="premise",  # a condition the papers' depth claims need, not a claim of theirs: never "contradicted"
)

EXPERIMENT = Experiment(
    name="depth-premise",
    title="Does depth pay? Fixed depth ℓ = L_max vs ℓ = 1 on a corpus of k-hop lookups",
    question="The premise of every depth claim, on the depth-pays corpus (data/depth-pays.yaml: chained "
    "variable assignments whose answers need 1..6 lookups, the difficulty stored per token): the looped model "
    "trained at fixed depth ℓ = L_max against the same model trained at ℓ = 1, same tokens and seed; loss and "
    "next-token accuracy per ℓ and per true difficulty.",
    analyse=analyse,
    claims=(
        PREMISE,
        Claim(
            paper=PREMISE.paper + " — on the tokens that need computation",
            source=SOURCE,
            magnitude="any resolved gain",
            measure=f"{DEEP} at ℓ = L_max minus {SHALLOW} at ℓ = 1, answer tokens (nats)",
            value=_deep_minus_shallow("loss[answers]"),
            expect="negative",
            kind="premise",
        ),
        Claim(
            paper=PREMISE.paper + f" — on answers needing {MULTI} or more sequential lookups",
            source=SOURCE,
            magnitude="any resolved gain",
            measure=f"{DEEP} at ℓ = L_max minus {SHALLOW} at ℓ = 1, answers of difficulty >= {MULTI} (nats)",
            value=_deep_minus_shallow(f"loss[d>={MULTI}]"),
            expect="negative",
            kind="premise",
        ),
        Claim(
            paper=PREMISE.paper + " — in next-token accuracy on the answers",
            source=SOURCE,
            magnitude="TaH2 reports accuracy; any resolved gain",
            measure=f"{DEEP} at ℓ = L_max minus {SHALLOW} at ℓ = 1, answer-token accuracy (fraction)",
            value=_deep_minus_shallow("acc[answers]"),
            expect="positive",
            kind="premise",
        ),
    ),
)
