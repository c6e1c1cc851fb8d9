"""Adaptive depth against fixed depth at matched compute (``elastic-pretrain eval --adaptive``).

A decider threshold sweep gives (mean passes per token, loss, next-token accuracy) points; fixed
depth gives one point per loop count ℓ. Both are placed at their relative compute (FLOPs at the mean
passes / FLOPs at L_max, ``model/flops.py``), and every adaptive point is compared with the fixed-depth
curve linearly interpolated at the same compute. Teacher-forced with the ``per-loop`` cache: at
threshold 0 the adaptive model is exactly the fixed L_max model, above 1 exactly ℓ = 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from elastic_pretrain.eval.curves import CurvePoint, QualityCurve, compare, interp
from elastic_pretrain.eval.report import save_figure
from elastic_pretrain.model.decider import IterationDecider
from elastic_pretrain.model.flops import relative_compute
from elastic_pretrain.model.inference import KVPolicy, teacher_forced_loss
from elastic_pretrain.model.looped import LoopedMoEModel

# threshold 0: every token runs L_max (the fixed model); above 1: every token stops after one pass
DEFAULT_THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)


@dataclasses.dataclass(frozen=True)
class AdaptiveResult:
    threshold: float
    loss: float
    mean_passes: float
    relative_compute: float
    policy: KVPolicy
    accuracy: float = float("nan")  # next-token argmax accuracy


def adaptive_eval(
    model: LoopedMoEModel,
    decider: IterationDecider,
    tokens_NT1: torch.Tensor,
    threshold: float,
    *,
    kv_cache: KVPolicy = "per-loop",
    batch_size: int = 8,
) -> AdaptiveResult:
    """Teacher-forced loss and mean passes per token with per-token early exit at ``threshold``.

    ``per-loop``: the whole sequence in one step (tokens see each other's pass-j K/V while both run,
    a stopped token's frozen K/V after) — at threshold 0 exactly the fixed L_max model.
    ``last-loop``: token by token against the last-pass cache (what ``generate(loops="auto")`` does).
    """
    was_training = decider.training
    decider.eval()
    try:
        tf = teacher_forced_loss(
            model, tokens_NT1, kv_cache=kv_cache, stop=decider.stopper(threshold), batch_size=batch_size
        )
    finally:
        decider.train(was_training)
    rel = relative_compute(model.cfg, tf.mean_passes, seq_len=tokens_NT1.shape[1] - 1)
    return AdaptiveResult(
        threshold=threshold,
        loss=tf.loss,
        mean_passes=tf.mean_passes,
        relative_compute=rel,
        policy=kv_cache,
        accuracy=tf.accuracy,
    )


def threshold_sweep(
    model: LoopedMoEModel,
    decider: IterationDecider,
    tokens_NT1: torch.Tensor,
    thresholds: Sequence[float],
    *,
    kv_cache: KVPolicy = "per-loop",
    name: str = "adaptive (decider)",
) -> tuple[QualityCurve, list[AdaptiveResult]]:
    """Loss against relative compute over decider thresholds (a curve comparable with fixed depth)."""
    results = [adaptive_eval(model, decider, tokens_NT1, t, kv_cache=kv_cache) for t in thresholds]
    points = tuple(CurvePoint(loops=r.mean_passes, relative_compute=r.relative_compute, loss=r.loss) for r in results)
    return QualityCurve(name=name, points=points), results


def accuracy_per_doubling(compute: Sequence[float], accuracy: Sequence[float]) -> float:
    """TaH2's accuracy-compute slope: accuracy gained per doubling of decode compute — the least-squares
    slope of accuracy against log2(compute). TaH2: "what the accuracy-compute slope looks like as test-time
    decoding FLOPs double" (2.74 vs 1.79 points on AIME). NaN with fewer than two distinct computes."""
    if len(compute) != len(accuracy):
        raise ValueError(f"accuracy_per_doubling: {len(compute)} computes but {len(accuracy)} accuracies")
    if any(c <= 0 for c in compute):
        raise ValueError("accuracy_per_doubling: compute must be > 0 (it is doubled on a log2 axis)")
    x = torch.log2(torch.tensor(compute, dtype=torch.float64))
    y = torch.tensor(accuracy, dtype=torch.float64)
    dx = x - x.mean()
    var = float((dx * dx).sum())
    if len(compute) < 2 or var == 0.0:
        return float("nan")
    return float((dx * (y - y.mean())).sum()) / var


@dataclasses.dataclass(frozen=True)
class FixedPoint:
    loops: int
    relative_compute: float
    loss: float
    accuracy: float


@dataclasses.dataclass(frozen=True)
class AdaptiveSweep:
    """A threshold sweep and the fixed-depth curve of the same model on the same tokens."""

    fixed: tuple[FixedPoint, ...]
    adaptive: tuple[AdaptiveResult, ...]
    policy: KVPolicy = "per-loop"  # the KV cache of both curves

    def fixed_at(self, compute: float) -> tuple[float, float]:
        """(loss, accuracy) of fixed depth interpolated at ``compute`` (relative)."""
        xs = [p.relative_compute for p in self.fixed]
        loss = interp(xs, [p.loss for p in self.fixed], compute)
        return loss, interp(xs, [p.accuracy for p in self.fixed], compute)

    def slopes(self) -> tuple[float, float]:
        """(fixed depth, adaptive) accuracy gained per doubling of decode compute (:func:`accuracy_per_doubling`)."""
        return (
            accuracy_per_doubling([p.relative_compute for p in self.fixed], [p.accuracy for p in self.fixed]),
            accuracy_per_doubling([r.relative_compute for r in self.adaptive], [r.accuracy for r in self.adaptive]),
        )

    def curves(self) -> tuple[QualityCurve, QualityCurve]:
        """(fixed depth, adaptive) loss-vs-compute curves, for :func:`~elastic_pretrain.eval.curves.compare`."""
        fixed = QualityCurve(
            name="fixed depth", points=tuple(CurvePoint(p.loops, p.relative_compute, p.loss) for p in self.fixed)
        )
        adaptive = QualityCurve(
            name="adaptive (decider)",
            points=tuple(CurvePoint(r.mean_passes, r.relative_compute, r.loss) for r in self.adaptive),
        )
        return fixed, adaptive

    def markdown(self) -> str:
        rows = [
            "| threshold | mean passes/token | relative compute | loss | accuracy "
            "| fixed-depth loss at matched compute | Δ loss | fixed-depth accuracy | Δ accuracy |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.adaptive:
            loss, acc = self.fixed_at(r.relative_compute)
            rows.append(
                f"| {r.threshold:g} | {r.mean_passes:.3f} | {r.relative_compute:.3f} | {r.loss:.4f} | {r.accuracy:.4f} "
                f"| {loss:.4f} | {r.loss - loss:+.4f} | {acc:.4f} | {r.accuracy - acc:+.4f} |"
            )
        fixed = ["| ℓ (fixed) | relative compute | loss | accuracy |", "|---|---|---|---|"]
        fixed += [f"| {p.loops} | {p.relative_compute:.3f} | {p.loss:.4f} | {p.accuracy:.4f} |" for p in self.fixed]
        slope_fixed, slope_adaptive = self.slopes()
        slope = (
            "accuracy per doubling of decode compute (TaH2's slope, points): "
            f"fixed depth {100 * slope_fixed:.2f}, adaptive {100 * slope_adaptive:.2f}"
        )
        return "\n".join([f"**adaptive depth (iteration decider), teacher-forced, {self.policy} KV**", "", *rows, "",
                          *fixed, "", slope, ""])  # fmt: skip


@torch.no_grad()
def adaptive_sweep(
    model: LoopedMoEModel,
    decider: IterationDecider,
    tokens_NT1: torch.Tensor,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    *,
    batch_size: int = 8,
    kv_cache: KVPolicy = "per-loop",
) -> AdaptiveSweep:
    """Fixed depth at every ℓ and adaptive depth at every threshold, on the same held-out tokens, both under
    the ``kv_cache`` policy (``last-loop``: the cache ``generate`` serves with, token by token)."""
    seq_len = tokens_NT1.shape[1] - 1
    fixed = []
    for ell in range(1, model.cfg.max_loops + 1):
        tf = teacher_forced_loss(model, tokens_NT1, loops=ell, kv_cache=kv_cache, batch_size=batch_size)
        rel = relative_compute(model.cfg, ell, seq_len=seq_len)
        fixed.append(FixedPoint(loops=ell, relative_compute=rel, loss=tf.loss, accuracy=tf.accuracy))
    adaptive = [
        adaptive_eval(model, decider, tokens_NT1, t, batch_size=batch_size, kv_cache=kv_cache)
        for t in sorted(thresholds)
    ]
    return AdaptiveSweep(fixed=tuple(fixed), adaptive=tuple(adaptive), policy=kv_cache)


def plot_sweep(sweep: AdaptiveSweep, path: Path, *, root: Path | None = None) -> Path:
    """Loss and accuracy against relative compute, fixed depth vs adaptive (PNG, matplotlib Agg); ``root``: as
    for :func:`~elastic_pretrain.eval.report.save_figure`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmp = compare(list(sweep.curves()))
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    try:
        series = (
            ("fixed depth", [(p.relative_compute, p.loss, p.accuracy, f"ℓ={p.loops}") for p in sweep.fixed]),
            ("adaptive (decider)",
             [(r.relative_compute, r.loss, r.accuracy, f"t={r.threshold:g}") for r in sweep.adaptive]),
        )  # fmt: skip
        for (name, pts), auc, rel in zip(series, cmp.aucs, cmp.relative, strict=True):
            pts = sorted(pts)
            xs = [p[0] for p in pts]
            ax_loss.plot(xs, [p[1] for p in pts], marker="o", label=f"{name} (AUC {auc:.3f}, {rel:+.1%})")
            ax_acc.plot(xs, [p[2] for p in pts], marker="o", label=name)
            for x, loss, _, text in pts:
                ax_loss.annotate(text, (x, loss), textcoords="offset points", xytext=(3, 3), fontsize=6)
        for ax, label in ((ax_loss, "held-out loss (nats/token)"), (ax_acc, "next-token accuracy")):
            ax.set_xlabel("relative compute  FLOPs(mean passes) / FLOPs(L_max)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"adaptive vs fixed depth (AUC over relative compute [{cmp.lo:.3f}, {cmp.hi:.3f}])", fontsize=8)
    except BaseException:
        plt.close(fig)
        raise
    return save_figure(fig, path, root=root)
