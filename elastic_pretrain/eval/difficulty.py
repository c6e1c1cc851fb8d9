"""Held-out loss and next-token accuracy per loop count ℓ and per true difficulty of the predicted token.

On a corpus whose tokens carry a difficulty (the number of sequential lookups the token needs; a synthetic
source, data/synthetic.py and data/difficulty.py) this says *where* depth pays: a model that resolves one
lookup per layer answers difficulty-1 tokens at ℓ = 1 and deeper ones only with more passes (issue 32).

Shape legend: N sequences, T sequence length (rows hold T+1 tokens: inputs ``[:, :-1]``, labels
``[:, 1:]``); the difficulty array has the tokens' shape and labels the token it sits on, so a prediction's
difficulty is that of its label. Difficulty 0 is an ordinary token.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

from elastic_pretrain.parallel.device import to_device

ANSWERS = -1  # pseudo-level: every token of difficulty >= 1


@dataclasses.dataclass(frozen=True)
class Cell:
    """Mean loss (nats/token) and next-token argmax accuracy over ``count`` tokens."""

    loss: float
    accuracy: float
    count: int


@dataclasses.dataclass(frozen=True)
class DifficultyTable:
    """``cells[ℓ][level]`` for every ℓ evaluated and every difficulty level present (0 = ordinary tokens,
    :data:`ANSWERS` = all tokens of difficulty >= 1)."""

    cells: dict[int, dict[int, Cell]]

    @property
    def loops(self) -> list[int]:
        return sorted(self.cells)

    @property
    def levels(self) -> list[int]:
        """Difficulty levels present, ascending (0 first when ordinary tokens were scored), without ANSWERS."""
        return sorted(k for k in next(iter(self.cells.values())) if k != ANSWERS)

    def to_json(self) -> dict[str, dict[str, dict[str, float]]]:
        name = {ANSWERS: "answers"}
        return {
            str(ell): {name.get(k, str(k)): dataclasses.asdict(c) for k, c in row.items()}
            for ell, row in self.cells.items()
        }

    def metrics(self) -> dict[str, float]:
        """``eval/loss_loops_<ℓ>_difficulty_<k>`` and ``eval/accuracy_...`` (k = answers for all of them)."""
        out = {}
        for ell, row in self.cells.items():
            for k, c in row.items():
                level = "answers" if k == ANSWERS else str(k)
                out[f"eval/loss_loops_{ell}_difficulty_{level}"] = c.loss
                out[f"eval/accuracy_loops_{ell}_difficulty_{level}"] = c.accuracy
        return out

    def markdown(self, what: str = "loss") -> str:
        """One row per ℓ, one column per difficulty (then all answers and ordinary tokens): ``what`` is
        ``loss`` (nats/token) or ``accuracy``."""
        hard = [k for k in self.levels if k > 0]
        cols = [*hard, ANSWERS, *([0] if 0 in self.levels else [])]
        first = next(iter(self.cells.values()))
        label = {ANSWERS: "answers", 0: "ordinary"}
        head = "| ℓ | " + " | ".join(f"{label.get(k, f'd={k}')} ({first[k].count:,})" for k in cols) + " |"
        rows = [f"{what} per true difficulty (tokens scored per column):", "", head,
                "|---|" + "---|" * len(cols)]  # fmt: skip
        fmt = "{:.4f}" if what == "loss" else "{:.3f}"
        for ell in self.loops:
            rows.append(f"| {ell} | " + " | ".join(fmt.format(getattr(self.cells[ell][k], what)) for k in cols) + " |")
        return "\n".join(rows) + "\n"


@torch.no_grad()
def by_difficulty(
    model: Any,
    tokens_NT1: torch.Tensor,
    difficulty_NT1: torch.Tensor,
    loops: Sequence[int] | None = None,
    *,
    batch_size: int = 8,
) -> DifficultyTable:
    """Loss and accuracy at every ℓ in ``loops`` (default 1..L_max), per difficulty of the predicted token.

    One process (``elastic-pretrain eval`` and the experiments load a one-process model). As in
    ``eval/loss.py``: one L_max run with an exit at every ℓ, or one run per ℓ when a run of ℓ passes is not
    the prefix of a longer one (``one_exit_per_run``). The loss is computed here from the full-vocabulary
    logits (``forward`` without labels), the same cross-entropy as the model's own over the real vocabulary.
    """
    if tokens_NT1.shape != difficulty_NT1.shape:
        raise ValueError(f"difficulty {tuple(difficulty_NT1.shape)} does not label tokens {tuple(tokens_NT1.shape)}")
    net = model
    while not hasattr(net, "cfg") and hasattr(net, "module"):
        net = net.module
    wanted = sorted(set(range(1, net.cfg.max_loops + 1) if loops is None else loops))
    for ell in wanted:
        net.cfg.check_loops(ell)
    runs = [(ell, (ell,)) for ell in wanted] if net.one_exit_per_run else [(wanted[-1], tuple(wanted))]
    levels = sorted(int(v) for v in difficulty_NT1[:, 1:].unique())
    # per ℓ: [levels + answers] x (loss sum, correct, count), float64
    sums = {ell: torch.zeros(len(levels) + 1, 3, dtype=torch.float64) for ell in wanted}
    was_training = model.training
    model.eval()
    net.set_is_first_microbatch()
    try:
        for start in range(0, tokens_NT1.shape[0], batch_size):
            batch = tokens_NT1[start : start + batch_size]
            inputs, labels_BT = to_device(batch[:, :-1].contiguous()), batch[:, 1:]
            level_BT = difficulty_NT1[start : start + batch_size, 1:]
            for ell, exits in runs:
                logits = model(inputs, loops=ell, exits=exits)
                for e in exits:
                    _accumulate(sums[e], logits[e].float().cpu(), labels_BT, level_BT, levels)
    finally:
        clear_aux_losses_tracker()  # the MoE layers logged aux losses of these forwards: not training's
        model.train(was_training)
    keys = [*levels, ANSWERS]
    return DifficultyTable(cells={ell: {k: _mean(s[i]) for i, k in enumerate(keys)} for ell, s in sums.items()})


def _mean(row: torch.Tensor) -> Cell:
    """(CE sum, correct, count) -> mean loss and accuracy (NaN where no token has this difficulty)."""
    n = float(row[2])
    return Cell(loss=float(row[0]) / n if n else math.nan, accuracy=float(row[1]) / n if n else math.nan, count=int(n))


def _accumulate(
    sums: torch.Tensor, logits_BTV: torch.Tensor, labels_BT: torch.Tensor, level_BT: torch.Tensor, levels: list[int]
) -> None:
    """Add per-level (CE sum, correct count, token count) of one batch at one exit into ``sums``."""
    ce_BT = torch.nn.functional.cross_entropy(logits_BTV.transpose(1, 2), labels_BT, reduction="none").double()
    correct_BT = (logits_BTV.argmax(-1) == labels_BT).double()
    for i, level in enumerate(levels):
        mask = level_BT == level
        sums[i] += torch.stack([ce_BT[mask].sum(), correct_BT[mask].sum(), mask.sum().double()])
    mask = level_BT > 0
    sums[-1] += torch.stack([ce_BT[mask].sum(), correct_BT[mask].sum(), mask.sum().double()])


# ---------------------------------------------------------------------------------------------------
# Where an adaptive model spends its passes (TaH2: "Extra compute goes where it moves the answer")
@dataclasses.dataclass(frozen=True)
class PassesByDifficulty:
    """Mean core passes per true difficulty of the predicted token under one stop rule (``threshold``: the
    decider's), and Spearman's rank correlation of passes with difficulty over the answer tokens
    (``rho_answers``, difficulty >= 1) and over every token (``rho_all``, ordinary tokens as difficulty 0)."""

    threshold: float
    mean_passes: dict[int, float]
    count: dict[int, int]
    rho_answers: float
    rho_all: float

    def to_json(self) -> dict[str, Any]:
        return {
            "threshold": self.threshold,
            "mean_passes": {str(k): v for k, v in self.mean_passes.items()},
            "count": {str(k): v for k, v in self.count.items()},
            "rho_answers": self.rho_answers,
            "rho_all": self.rho_all,
        }

    def row(self, levels: Sequence[int]) -> list[str]:
        """Mean passes per level in ``levels`` (blank where absent), then the two correlations."""
        cells = [f"{self.mean_passes[k]:.2f}" if k in self.mean_passes else "" for k in levels]
        return [*cells, f"{self.rho_answers:+.3f}", f"{self.rho_all:+.3f}"]


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n of a 1-D tensor, ties given their mean rank (float64)."""
    x = x.double()
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(1, x.numel() + 1, dtype=torch.float64)
    values, inverse = torch.unique(x, return_inverse=True)
    sums = torch.zeros(values.numel(), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(values.numel(), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
    return (sums / counts)[inverse]


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rank correlation (Pearson's on tie-averaged ranks) of two equally long 1-D tensors; 0 when
    either is constant (no ordering to agree with) or has fewer than two values."""
    if x.shape != y.shape or x.dim() != 1:
        raise ValueError(f"spearman: shapes {tuple(x.shape)} and {tuple(y.shape)} are not two equal 1-D tensors")
    if x.numel() < 2:
        return 0.0
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float((rx.square().sum() * ry.square().sum()).sqrt())
    return float((rx * ry).sum()) / den if den > 0 else 0.0


@torch.no_grad()
def passes_by_difficulty(
    model: Any, stop: Any, tokens_NT1: torch.Tensor, difficulty_NT1: torch.Tensor, *, threshold: float
) -> PassesByDifficulty:
    """Teacher-forced (per-loop KV) passes of every held-out prediction under ``stop`` (a stop rule: the
    decider's ``stopper(threshold)``), grouped by the difficulty of the token it predicts (``difficulty[:,
    1:]``: a prediction's difficulty is its label's)."""
    from elastic_pretrain.model.inference import teacher_forced_loss

    if tokens_NT1.shape != difficulty_NT1.shape:
        raise ValueError(f"difficulty {tuple(difficulty_NT1.shape)} does not label tokens {tuple(tokens_NT1.shape)}")
    tf = teacher_forced_loss(model, tokens_NT1, kv_cache="per-loop", stop=stop, keep_passes=True)
    assert tf.passes_NT is not None
    passes, level = tf.passes_NT.flatten().double(), difficulty_NT1[:, 1:].flatten()
    levels = sorted(int(v) for v in level.unique())
    mean = {k: float(passes[level == k].mean()) for k in levels}
    count = {k: int((level == k).sum()) for k in levels}
    answers = level > 0
    return PassesByDifficulty(
        threshold=threshold,
        mean_passes=mean,
        count=count,
        rho_answers=spearman(passes[answers], level[answers].double()),
        rho_all=spearman(passes, level.double()),
    )
