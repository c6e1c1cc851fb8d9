"""Quality vs. compute of an elastic-depth model: FLOPs per loop count, loss per loop count, AUC.

Shape legend: N sequences, T sequence length, B batch, V vocabulary, D hidden.

**FLOPs per token** (:func:`flops_per_token`) count the matrix multiplications of one forward at ℓ
loops, 2 FLOPs per multiply-add, with nothing else (norms, softmax, RoPE, residual adds, the
embedding lookup and the loop-conditioning head — a per-pass vector, not a per-token matmul — are
left out; they are O(D) per token against the O(D²) matmuls)::

    attn(ctx)  = 2·D·(D + 2·G·d_h)      q, k, v projections (G query groups of width d_h; G·d_h = D without GQA)
               + 2·D·D                  output projection
               + 2·ctx·D + 2·ctx·D      scores QKᵀ and the weighted sum over values
    dense      = 2·3·D·F                SwiGLU: fc1 (D → 2F) + fc2 (F → D)
    moe        = 2·D·E + k·2·3·D·W      router + the k active experts of width W
    FLOPs(ℓ)   = Σ_prelude (attn + mlp) + ℓ·Σ_core (attn + moe) + Σ_coda (attn + mlp) + 2·D·V_padded

``ctx`` is the number of keys a query sees: ``causal`` counts the mean (T+1)/2 of a causal
sequence of length T (what a causal kernel computes), ``full`` counts T (megatron's local unfused
attention multiplies the full T×T score matrix before masking — the test checks this variant against
``torch.utils.flop_counter``). The output layer counts the padded vocabulary, which is what is
multiplied. **Relative compute** = FLOPs(ℓ) / FLOPs(L_max).

**AUC** (:func:`auc`): the quality-budget curve is loss against relative compute, one point per loop
count. Its area is the trapezoid integral of loss over the curve's compute range divided by the
width of that range, i.e. the *compute-averaged loss* (same unit as the loss, lower is better, and
comparable between models whose shallowest exit costs a different fraction of their deepest).
Edge cases: one point (or all points at the same compute) → the mean loss of the points.
:func:`compare` integrates every curve over the *common* compute range (linear interpolation at the
ends) so that relative AUC differences compare like with like.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from elastic_pretrain.model.config import ModelConfig

if TYPE_CHECKING:
    from elastic_pretrain.model.looped import LoopedMoEModel

AttentionContext = Literal["causal", "full"]


# ---------------------------------------------------------------------------------------------------
# FLOPs
def _attention_context(seq_len: int, attention_context: AttentionContext) -> float:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return (seq_len + 1) / 2 if attention_context == "causal" else float(seq_len)


def attention_flops(cfg: ModelConfig, ctx: float, query_groups: int | None = None) -> float:
    """One attention half per token: q/k/v and output projections plus the ctx-dependent matmuls."""
    d = cfg.hidden_size
    d_h = d // cfg.num_heads
    groups = cfg.num_heads if query_groups is None else query_groups
    return 2 * d * (d + 2 * groups * d_h) + 2 * d * d + 4 * ctx * d


def dense_mlp_flops(cfg: ModelConfig) -> float:
    return 2 * 3 * cfg.hidden_size * cfg.ffn_hidden_size  # SwiGLU: fc1 to 2F, fc2 from F


def moe_mlp_flops(cfg: ModelConfig) -> float:
    """Router over the built experts + top-k experts (flattening keeps this equal; Foil, seeds/000:
    "holding expert parameters and expert compute per token fixed")."""
    d = cfg.hidden_size
    return 2 * d * cfg.experts_built + cfg.moe_top_k * 2 * 3 * d * cfg.moe_ffn_hidden_size


@dataclasses.dataclass(frozen=True)
class FlopsBreakdown:
    """FLOPs per token of one forward, split by where they are spent."""

    edges: float  # prelude + coda (run once)
    core_pass: float  # one pass through every core layer
    output: float  # output layer
    loops: float  # passes counted (may be fractional: mean passes per token under adaptive depth)

    @property
    def total(self) -> float:
        return self.edges + self.loops * self.core_pass + self.output


def flops_breakdown(
    cfg: ModelConfig,
    loops: float,
    *,
    seq_len: int,
    padded_vocab: int | None = None,
    attention_context: AttentionContext = "causal",
) -> FlopsBreakdown:
    """The terms of :func:`flops_per_token`; ``loops`` may be a mean number of passes (adaptive depth)."""
    from elastic_pretrain.parallel.megatron import padded_vocab_size

    if not 0 <= loops <= cfg.max_loops:
        raise ValueError(f"loops={loops} is outside [0, {cfg.max_loops}]")
    vocab = padded_vocab_size(cfg.vocab_size, 1) if padded_vocab is None else padded_vocab
    attn = attention_flops(cfg, _attention_context(seq_len, attention_context))
    edge_mlp = moe_mlp_flops(cfg) if cfg.edge_mlp == "moe" else dense_mlp_flops(cfg)
    edges = (cfg.prelude_layers + cfg.coda_layers) * (attn + edge_mlp)
    core_pass = cfg.core_layers_built * (attn + moe_mlp_flops(cfg))
    return FlopsBreakdown(edges=edges, core_pass=core_pass, output=2 * cfg.hidden_size * vocab, loops=loops)


def flops_per_token(
    cfg: ModelConfig,
    loops: float,
    *,
    seq_len: int,
    padded_vocab: int | None = None,
    attention_context: AttentionContext = "causal",
) -> float:
    """Matmul FLOPs per token of a forward at ``loops`` passes (formula in the module docstring)."""
    return flops_breakdown(
        cfg, loops, seq_len=seq_len, padded_vocab=padded_vocab, attention_context=attention_context
    ).total


def relative_compute(
    cfg: ModelConfig, loops: float, *, seq_len: int, attention_context: AttentionContext = "causal"
) -> float:
    """FLOPs(ℓ) / FLOPs(L_max)."""
    return flops_per_token(cfg, loops, seq_len=seq_len, attention_context=attention_context) / flops_per_token(
        cfg, cfg.max_loops, seq_len=seq_len, attention_context=attention_context
    )


# ---------------------------------------------------------------------------------------------------
# Curves and AUC
@dataclasses.dataclass(frozen=True)
class CurvePoint:
    """One operating point: a loop count (or mean passes under adaptive depth), its cost and loss."""

    loops: float
    relative_compute: float
    loss: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@dataclasses.dataclass(frozen=True)
class QualityCurve:
    """Loss against relative compute; points sorted by compute."""

    name: str
    points: tuple[CurvePoint, ...]
    flops_max: float = 0.0  # FLOPs/token at L_max (for the table); 0 = unknown

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError(f"curve {self.name!r} has no points")
        object.__setattr__(self, "points", tuple(sorted(self.points, key=lambda p: (p.relative_compute, p.loops))))

    @property
    def auc(self) -> float:
        return auc([p.relative_compute for p in self.points], [p.loss for p in self.points])


def auc(compute: Sequence[float], loss: Sequence[float], *, lo: float | None = None, hi: float | None = None) -> float:
    """Compute-averaged loss: trapezoid ∫ loss d(compute) over [lo, hi] / (hi − lo).

    ``lo``/``hi`` default to the curve's own compute range; inside it the curve is linearly
    interpolated (used by :func:`compare` for a common range). Points at equal compute are averaged
    first. One point, or ``lo == hi``: the (interpolated) loss there.
    """
    if len(compute) != len(loss) or not compute:
        raise ValueError(f"auc needs equally many (>= 1) compute and loss values, got {len(compute)}, {len(loss)}")
    by_c: dict[float, list[float]] = {}
    for c, v in zip(compute, loss, strict=True):
        if not (math.isfinite(c) and math.isfinite(v)):
            raise ValueError(f"auc: non-finite point ({c}, {v})")
        by_c.setdefault(float(c), []).append(float(v))
    xs = sorted(by_c)
    ys = [sum(by_c[x]) / len(by_c[x]) for x in xs]
    lo = xs[0] if lo is None else lo
    hi = xs[-1] if hi is None else hi
    if lo < xs[0] - 1e-12 or hi > xs[-1] + 1e-12 or lo > hi:
        raise ValueError(f"auc range [{lo}, {hi}] is not inside the curve's compute range [{xs[0]}, {xs[-1]}]")
    if hi - lo <= 0:
        return _interp(xs, ys, lo)
    grid = [lo] + [x for x in xs if lo < x < hi] + [hi]
    vals = [_interp(xs, ys, x) for x in grid]
    area = sum((grid[i + 1] - grid[i]) * (vals[i] + vals[i + 1]) / 2 for i in range(len(grid) - 1))
    return area / (hi - lo)


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            w = (x - xs[i]) / (xs[i + 1] - xs[i])
            return ys[i] + w * (ys[i + 1] - ys[i])
    return ys[-1]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """AUCs of several curves over their common compute range, relative to the first (the reference)."""

    names: tuple[str, ...]
    lo: float
    hi: float
    aucs: tuple[float, ...]

    @property
    def relative(self) -> tuple[float, ...]:
        """(AUC_i − AUC_ref) / AUC_ref; negative = lower (better) loss per unit of compute."""
        ref = self.aucs[0]
        return tuple((a - ref) / ref for a in self.aucs)

    def markdown(self) -> str:
        rows = ["| curve | AUC | vs " + self.names[0] + " |", "|---|---|---|"]
        for name, a, r in zip(self.names, self.aucs, self.relative, strict=True):
            rows.append(f"| {name} | {a:.4f} | {r:+.2%} |")
        return "\n".join(rows) + f"\n\nAUC over relative compute [{self.lo:.3f}, {self.hi:.3f}] (common range).\n"


def compare(curves: Sequence[QualityCurve], path: Path | None = None) -> Comparison:
    """AUC of every curve over the common compute range, relative to ``curves[0]``; plot them if ``path``."""
    if not curves:
        raise ValueError("compare needs at least one curve")
    lo = max(c.points[0].relative_compute for c in curves)
    hi = min(c.points[-1].relative_compute for c in curves)
    if lo > hi:
        raise ValueError(f"curves share no compute range (latest start {lo:.3f} > earliest end {hi:.3f})")
    aucs = tuple(auc([p.relative_compute for p in c.points], [p.loss for p in c.points], lo=lo, hi=hi) for c in curves)
    result = Comparison(names=tuple(c.name for c in curves), lo=lo, hi=hi, aucs=aucs)
    if path is not None:
        plot(
            curves,
            path,
            title="quality vs compute: "
            + ", ".join(
                f"{n} AUC {a:.3f} ({r:+.1%})" for n, a, r in zip(result.names, aucs, result.relative, strict=True)
            ),
        )
    return result


def markdown_table(curve: QualityCurve) -> str:
    """A markdown table of the curve and its AUC."""
    rows = [
        f"**{curve.name}**",
        "",
        "| loops | FLOPs/token | relative compute | loss | perplexity |",
        "|---|---|---|---|---|",
    ]
    for p in curve.points:
        flops = f"{p.relative_compute * curve.flops_max:,.0f}" if curve.flops_max else "–"
        loops = f"{p.loops:g}" if float(p.loops).is_integer() else f"{p.loops:.2f}"
        rows.append(f"| {loops} | {flops} | {p.relative_compute:.3f} | {p.loss:.4f} | {p.perplexity:.3f} |")
    rows += [
        "",
        f"AUC (compute-averaged loss over [{curve.points[0].relative_compute:.3f}, "
        f"{curve.points[-1].relative_compute:.3f}]): {curve.auc:.4f}",
        "",
    ]
    return "\n".join(rows)


def plot(curves: Sequence[QualityCurve], path: Path, *, title: str = "quality vs compute") -> Path:
    """Loss against relative compute for each curve, written as a PNG (matplotlib Agg, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    try:
        for c in curves:
            xs = [p.relative_compute for p in c.points]
            ax.plot(xs, [p.loss for p in c.points], marker="o", label=f"{c.name} (AUC {c.auc:.3f})")
            for p in c.points:
                if float(p.loops).is_integer():
                    ax.annotate(
                        f"ℓ={p.loops:g}",
                        (p.relative_compute, p.loss),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=7,
                    )
        ax.set_xlabel("relative compute  FLOPs(ℓ) / FLOPs(L_max)")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.set_title(title, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    except BaseException:
        plt.close(fig)
        raise
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------
# Loss per loop count on fixed held-out tokens
@dataclasses.dataclass(frozen=True)
class LoopEval:
    loops: int
    loss: float  # mean per-token cross-entropy (nats)
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def token_ce(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``[B, T]`` over the real vocabulary, in fp32."""
    ce = torch.nn.functional.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(), reduction="none")
    return ce.view_as(labels_BT)


@torch.no_grad()
def evaluate_loops(
    model: LoopedMoEModel, tokens_NT1: torch.Tensor, loops: Sequence[int] | None = None, *, batch_size: int = 8
) -> dict[int, LoopEval]:
    """Per-token loss and perplexity at every ℓ in ``loops`` (default 1..L_max) on fixed tokens.

    ``tokens_NT1`` holds N sequences of T+1 tokens (inputs ``[:, :-1]``, labels ``[:, 1:]``). Without
    active loop conditioning the exits of one L_max run share its prefix, so one forward gives every
    ℓ; with it each ℓ is conditioned on itself (ELR) and needs its own run — as under
    ``model.kv_training: last_loop``, where a run attends to its own ℓ's final K/V.

    The loss is the cross-entropy over the *real* vocabulary (the distribution ``generate`` samples
    from). The model's training loss (megatron's vocab-parallel CE) normalises over the padded
    vocabulary too, which adds up to log(V_padded / V) nats (0.40 for bytes at init).
    """
    cfg = model.cfg
    wanted = sorted(set(range(1, cfg.max_loops + 1) if loops is None else loops))
    for ell in wanted:
        cfg.check_loops(ell)
    was_training = model.training
    model.eval()
    sums = dict.fromkeys(wanted, 0.0)
    count = 0
    try:
        for start in range(0, tokens_NT1.shape[0], batch_size):
            chunk = tokens_NT1[start : start + batch_size]
            ids, labels = chunk[:, :-1], chunk[:, 1:]
            if model.one_exit_per_run:
                per = {ell: model(ids, loops=ell)[ell] for ell in wanted}
            else:
                per = model(ids, loops=wanted[-1], exits=wanted)
            for ell in wanted:
                sums[ell] += float(token_ce(per[ell], labels).double().sum())
            count += labels.numel()
    finally:
        model.train(was_training)
    return {ell: LoopEval(loops=ell, loss=sums[ell] / count, tokens=count) for ell in wanted}


def quality_curve(
    model: LoopedMoEModel,
    tokens_NT1: torch.Tensor,
    *,
    name: str = "fixed depth",
    attention_context: AttentionContext = "causal",
    batch_size: int = 8,
) -> QualityCurve:
    """Evaluate every ℓ ∈ 1..L_max and place it at its relative compute."""
    cfg = model.cfg
    seq_len = tokens_NT1.shape[1] - 1
    evals = evaluate_loops(model, tokens_NT1, batch_size=batch_size)
    fmax = flops_per_token(
        cfg, cfg.max_loops, seq_len=seq_len, padded_vocab=model.padded_vocab, attention_context=attention_context
    )
    points = tuple(
        CurvePoint(
            loops=ell,
            loss=e.loss,
            relative_compute=flops_per_token(
                cfg, ell, seq_len=seq_len, padded_vocab=model.padded_vocab, attention_context=attention_context
            )
            / fmax,
        )
        for ell, e in evals.items()
    )
    return QualityCurve(name=name, points=points, flops_max=fmax)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure; returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path
