"""kv-cache: last-loop vs per-loop KV cache (ELR): bytes per token and teacher-forced loss."""

from __future__ import annotations

from typing import Any

from elastic_pretrain.experiments.present import figure, pct, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings
from elastic_pretrain.experiments.stats import Claim, Metrics

ELR = "seeds/003 (ELR)"


def _draw(numbers: dict[str, Any], ax: Any) -> None:
    for name, by in numbers.items():
        ells = sorted(by)
        for p, style in (("per-loop", "-o"), ("last-loop", "--s")):
            ax.plot(ells, [by[e][p]["loss"] for e in ells], style, label=f"{name}, {p}")
    ax.set_xlabel("loop count ℓ")
    ax.set_ylabel("teacher-forced held-out loss (nats/token)")
    ax.set_xticks(sorted({e for by in numbers.values() for e in by}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def analyse(ctx: Context) -> Findings:
    from elastic_pretrain.model.inference import KV_POLICIES, teacher_forced_loss

    # last-loop decoding goes token by token: fewer sequences than elsewhere (and --quick: 32 positions only)
    n, length = (2, 32) if ctx.quick else (16, ctx.runs[0].job.data.seq_len)
    tokens = ctx.val_tokens(n)[:, : length + 1]
    rows = []
    numbers: dict[str, Any] = {}
    for r in ctx.runs:
        model = ctx.model(r.name)
        numbers[r.name] = {}
        top = r.job.model.max_loops
        for ell in [top] if ctx.quick else range(2, top + 1):
            tf = {p: teacher_forced_loss(model, tokens, loops=ell, kv_cache=p, batch_size=n) for p in KV_POLICIES}
            numbers[r.name][ell] = {
                p: {"loss": t.loss, "kv_bytes_per_token": t.kv_bytes_per_token} for p, t in tf.items()
            }
            per, last = tf["per-loop"], tf["last-loop"]
            rows.append(
                (
                    r.name,
                    ell,
                    f"{per.kv_bytes_per_token:,.0f}",
                    f"{last.kv_bytes_per_token:,.0f}",
                    f"{per.loss:.4f}",
                    f"{last.loss:.4f}",
                    f"{last.loss - per.loss:+.4f}",
                )
            )
    reading: list[str] = []
    metrics: Metrics = {}
    for name, by in numbers.items():
        top = max(by)
        per, last = by[top]["per-loop"], by[top]["last-loop"]
        metrics[name] = {"last_minus_per@max": last["loss"] - per["loss"], "per_loop@max": per["loss"]}
        reading.append(
            f"{name} at ℓ = {top}: the last-loop cache holds "
            f"{last['kv_bytes_per_token'] / per['kv_bytes_per_token']:.0%} of the per-loop bytes per token and "
            f"changes the teacher-forced loss by {last['loss'] - per['loss']:+.4f} nats "
            f"({pct(last['loss'], per['loss'])})."
        )
    header = (
        "job",
        "ℓ",
        "KV bytes/token per-loop",
        "KV bytes/token last-loop",
        "loss per-loop",
        "loss last-loop",
        "last − per",
    )
    held = f"{n} sequences of the validation split, {tokens.shape[1] - 1} positions each"
    return Findings(
        tables=[table(header, rows)],
        reading=reading,
        numbers={"teacher_forced": numbers, "sequences": n, "predicted_tokens": n * (tokens.shape[1] - 1)},
        metrics=metrics,
        held_out=f"the first {held} ({n * (tokens.shape[1] - 1):,} predicted tokens, files never trained on)",
        plot=lambda path: figure(path, lambda ax: _draw(numbers, ax)),
        method=[
            f"Teacher-forced loss of the first {held} (fewer than in the other experiments because last-loop "
            "decoding goes token by token) at each ℓ ≥ 2 (at ℓ = 1 the policies are the same). per-loop: every "
            "pass keeps its own keys/values (exactly the model's forward); last-loop: only the last pass's "
            "keys/values are cached and every pass of a later token attends to them (docs/evaluation.md). Bytes "
            "per token are those the cache holds.",
        ],
    )


def _last_minus_per(arm: str) -> Any:
    return lambda m: m[arm]["last_minus_per@max"]


EXPERIMENT = Experiment(
    name="kv-cache",
    title="Last-loop vs per-loop KV cache: bytes and loss",
    question="Caching only the last pass's keys/values of the core layers cuts their KV memory by a factor "
    "ℓ (the prelude and coda caches stay); how much held-out loss does it cost, for a fixed-depth model and "
    "for a late-switch (mixed-depth) model?",
    analyse=analyse,
    claims=tuple(
        Claim(
            paper='last-loop KV caching costs a little quality: "four-loop scores 0–3% below per-loop caching"',
            source=ELR,
            magnitude="scores 0–3% lower at four loops (Koi-4B)",
            measure=f"{arm}: last-loop minus per-loop teacher-forced loss at ℓ = L_max (nats; same model, paired)",
            value=_last_minus_per(arm),
            expect="positive",
        )
        for arm in ("late-switch", "fixed-depth")
    ),
)
