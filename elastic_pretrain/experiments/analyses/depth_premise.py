"""depth-premise: on a corpus whose answers need 1..6 sequential lookups (``data: depth-pays``), does the
looped model trained at fixed depth ℓ = L_max beat the same model trained at ℓ = 1 (issue 32)?

Every depth claim of the papers presupposes that extra depth pays; on the byte corpus at this scale it does not.
This report checks the premise where it can hold, per true difficulty of the predicted token, on two shapes:
``bare-*`` (the looped core alone: ℓ = 1 is one layer, which cannot look anything up) and ``fixed-*`` (with a
prelude and a coda: ℓ = 1 is three layers). docs/experiments.md, "The depth-pays corpus: the premise first".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_pretrain.data.difficulty import load_difficulty
from elastic_pretrain.eval.difficulty import DifficultyTable, by_difficulty
from elastic_pretrain.experiments.present import figure, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings
from elastic_pretrain.experiments.stats import Claim, Direction, Metrics

SOURCE = "seeds/003 (ELR), seeds/000 (TaH2); the premise issue 32 asks for"
MULTI = 2  # answers needing at least this many lookups: what one pass cannot do by a single lookup


@dataclasses.dataclass(frozen=True)
class Shape:
    """One pair of arms: the same model trained at ℓ = 1 and at ℓ = L_max."""

    shallow: str
    deep: str
    what: str  # the shape in words, for the claims


BARE = Shape("bare-1", "bare-max", "the bare looped core (ℓ = 1: one layer; ℓ = 4: four)")
WRAPPED = Shape("fixed-1", "fixed-max", "prelude + looped core + coda (ℓ = 1: three layers; ℓ = 4: six)")
SHAPES = (BARE, WRAPPED)
SHALLOW_ARMS = {sh.shallow for sh in SHAPES}


def _deep_minus_shallow(shape: Shape, key: str) -> Callable[[Metrics], float]:
    return lambda m: m[shape.deep][key] - m[shape.shallow][key]


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
    reading = []
    for sh in SHAPES:
        if sh.deep not in tabs or sh.shallow not in tabs:
            continue
        hard = [k for k in tabs[sh.deep].levels if k > 0]
        top, deep, shallow = trained[sh.deep], metrics[sh.deep], metrics[sh.shallow]
        gaps = ", ".join(f"d={k} {deep[f'loss[d={k}]'] - shallow[f'loss[d={k}]']:+.3f}" for k in hard)
        acc_gaps = ", ".join(f"d={k} {deep[f'acc[d={k}]'] - shallow[f'acc[d={k}]']:+.2f}" for k in hard)
        reading += [
            f"{sh.what}: {sh.deep} at ℓ = {top} minus {sh.shallow} at ℓ = 1, loss per difficulty: {gaps}; "
            f"accuracy: {acc_gaps}.",
            f"{sh.what}: all held-out tokens {deep['loss[all]']:.4f} ({sh.deep}, ℓ = {top}) vs "
            f"{shallow['loss[all]']:.4f} ({sh.shallow}, ℓ = 1); answer tokens {deep['loss[answers]']:.4f} vs "
            f"{shallow['loss[answers]']:.4f}; answer accuracy {deep['acc[answers]']:.3f} vs "
            f"{shallow['acc[answers]']:.3f}.",
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
            "Every arm is evaluated at every ℓ = 1..L_max; the claims compare each pair at the depth each arm "
            f"trained at (ℓ = 1 and ℓ = L_max). `d>={MULTI}`: answers needing {MULTI} or more lookups.",
            "Two shapes of the same looped core (one layer of attention and an 8-expert MoE, run 4 times): bare "
            "(no prelude or coda) and wrapped in one prelude and one coda layer. A lookup needs two layers (a "
            "previous-token layer, then the copy), so bare ℓ = 1 cannot do one, while wrapped ℓ = 1 (three "
            "layers) can do the one- and two-lookup answers, which are most of the answers.",
        ],
        held_out=f"the first {tokens.shape[0]} sequences of the validation split ({predicted:,} predicted tokens; "
        "documents never trained on, chosen by a hash of their name)",
    )


def curve_table(tabs: dict[str, DifficultyTable], trained: dict[str, int]) -> str:
    """Loss / accuracy per (arm, ℓ) and true difficulty, then all answers and all tokens."""
    deep = next(iter(tabs.values()))
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
                if not own and name in SHALLOW_ARMS:
                    continue  # an ℓ = 1 arm never ran passes 2..4: its deeper exits are untrained noise
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


def _premise_rows(shape: Shape) -> tuple[Claim, ...]:
    """The premise on all tokens, on the answers, on multi-lookup answers and in answer accuracy, for one shape."""
    paper = ('Depth pays: the premise of every depth claim ("four loops adding 7.25 and 4.75 points", ELR; '
             'adaptive depth that "keeps gaining" with more iterations, TaH2)')  # fmt: skip
    head = f"{shape.what}: {shape.deep} at ℓ = L_max minus {shape.shallow} at ℓ = 1"
    rows: tuple[tuple[str, str, str, str, Direction], ...] = (
        ("", "ELR: −0.058 nat at five loops (0.5B); here: any resolved gain", "all held-out tokens (nats)",
         "loss[all]", "negative"),
        (" — on the tokens that need computation", "any resolved gain", "answer tokens (nats)", "loss[answers]",
         "negative"),
        (f" — on answers needing {MULTI} or more sequential lookups", "any resolved gain",
         f"answers of difficulty >= {MULTI} (nats)", f"loss[d>={MULTI}]", "negative"),
        (" — in next-token accuracy on the answers", "TaH2 reports accuracy; any resolved gain",
         "answer-token accuracy (fraction)", "acc[answers]", "positive"),
    )  # fmt: skip
    return tuple(
        Claim(
            paper=paper + suffix,
            source=SOURCE,
            magnitude=magnitude,
            measure=f"{head}, {what}",
            value=_deep_minus_shallow(shape, key),
            expect=expect,
            kind="premise",
        )
        for suffix, magnitude, what, key, expect in rows
    )


# the premise other claims can gate on: the bare core, whose ℓ = 1 cannot look anything up
BARE_ROWS = _premise_rows(BARE)
PREMISE = BARE_ROWS[0]

EXPERIMENT = Experiment(
    name="depth-premise",
    title="Does depth pay? Fixed depth ℓ = L_max vs ℓ = 1 on a corpus of k-hop lookups",
    question="The premise of every depth claim, on the depth-pays corpus (data/depth-pays.yaml: chained "
    "variable assignments whose answers need 1..6 lookups, the difficulty stored per token): the looped model "
    "trained at fixed depth ℓ = L_max against the same model trained at ℓ = 1, same tokens and seed, for the "
    "bare looped core and for the core wrapped in a prelude and a coda; loss and next-token accuracy per ℓ and "
    "per true difficulty.",
    analyse=analyse,
    claims=(*BARE_ROWS, *_premise_rows(WRAPPED)),
)
