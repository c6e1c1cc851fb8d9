"""route-replay: passes ≥ 1 reuse pass 0's expert choices (ELR); step time and loss, off vs on."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elastic_pretrain.experiments.measure import losses
from elastic_pretrain.experiments.present import figure, table
from elastic_pretrain.experiments.runner import Context, Experiment, Findings
from elastic_pretrain.experiments.stats import Claim, paired

if TYPE_CHECKING:  # annotations only
    from elastic_pretrain.model.looped import LoopedMoEModel

ELR = "seeds/003 (ELR)"


def _fwd_bwd(net: LoopedMoEModel, inputs: torch.Tensor, labels: torch.Tensor, loops: int) -> Callable[[], None]:
    def run() -> None:
        net.zero_grad(set_to_none=True)
        out = net(inputs, labels=labels, loops=loops)
        out[loops].mean().backward()

    return run


def interleaved_times(fns: dict[Any, Callable[[], None]], repeats: int) -> dict[Any, list[float]]:
    """Seconds of each call of each function, called alternately in this process (after one warm-up each)."""
    for fn in fns.values():
        fn()
    samples: dict[Any, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def _paired_times(ctx: Context, ells: list[int], repeats: int) -> dict[int, dict[str, list[float]]]:
    """fwd+bwd seconds per (ℓ, job): every (ℓ, model) in one interleaved loop, so that a change of load on
    the machine hits all of them alike."""
    off, on = ctx.run("replay-off"), ctx.run("replay-on")
    batch = ctx.val_tokens()[: off.job.train.micro_batch_size]
    inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    for r in (off, on):
        ctx.model(r.name).train()
    try:
        fns = {(ell, r.name): _fwd_bwd(ctx.model(r.name), inputs, labels, ell) for ell in ells for r in (off, on)}
        flat = interleaved_times(fns, repeats)
    finally:
        for r in (off, on):
            ctx.model(r.name).zero_grad(set_to_none=True)
            ctx.model(r.name).eval()
    return {ell: {r.name: flat[(ell, r.name)] for r in (off, on)} for ell in ells}


def analyse(ctx: Context) -> Findings:
    off, on = ctx.run("replay-off"), ctx.run("replay-on")
    max_loops = off.job.model.max_loops
    ells = list(range(1, max_loops + 1))
    loss = {r.name: losses(ctx, r) for r in (off, on)}
    repeats = 2 if ctx.quick else 20
    samples = _paired_times(ctx, sorted({1, 2, max_loops}), repeats)
    times = {ell: {k: statistics.median(v) for k, v in t.items()} for ell, t in samples.items()}
    # each replay-on call against the replay-off call just before it (same moment, same load)
    ratio = {
        ell: statistics.median(a / b for a, b in zip(t[on.name], t[off.name], strict=True))
        for ell, t in samples.items()
    }
    rows = [(r.name, *(f"{loss[r.name][e]:.4f}" for e in ells)) for r in (off, on)]
    trows = [
        (
            f"fwd+bwd ℓ={ell}, median of {repeats}",
            f"{t[off.name] * 1e3:.1f} ms",
            f"{t[on.name] * 1e3:.1f} ms",
            f"{ratio[ell]:.3f}",
        )
        for ell, t in times.items()
    ]
    trows.append(
        (
            "training, s/step over the whole run (separate runs)",
            f"{off.seconds_per_step:.3f} s",
            f"{on.seconds_per_step:.3f} s",
            f"{on.seconds_per_step / off.seconds_per_step:.3f} (ratio of means)",
        )
    )
    reading = [
        f"Step time at ℓ = {max_loops}, measured alternately in one process: replay-on / replay-off = "
        f"{ratio[max_loops]:.3f}; at ℓ = 1, where no pass is replayed, {ratio[1]:.3f} (the noise floor).",
        "Held-out loss, replay-on minus replay-off: "
        + ", ".join(f"ℓ={e} {loss[on.name][e] - loss[off.name][e]:+.4f}" for e in ells)
        + " nats.",
    ]

    def draw(axes: Any) -> None:
        for r in (off, on):
            axes[0].plot(ells, [loss[r.name][e] for e in ells], marker="o", label=r.name)
        axes[0].set(xlabel="loop count ℓ", ylabel="held-out loss (nats/token)")
        axes[0].legend(fontsize=8)
        axes[1].plot(list(ratio), list(ratio.values()), marker="o")
        axes[1].axhline(1.0, color="grey", lw=0.8)
        axes[1].set(xlabel="loop count ℓ", ylabel="fwd+bwd time, replay-on / replay-off")
        for ax in axes:
            ax.grid(alpha=0.3)

    metrics = {r.name: {f"loss@{e}": loss[r.name][e] for e in ells} for r in (off, on)}
    metrics[off.name]["time_ratio@max"] = 1.0  # the reference of the paired ratio
    metrics[on.name]["time_ratio@max"] = ratio[max_loops]
    return Findings(
        tables=[
            table(("job", *(f"loss ℓ={e}" for e in ells)), rows),
            table(("measurement", "replay-off", "replay-on", "on/off (median of paired ratios)"), trows),
        ],
        reading=reading,
        numbers={
            "loss_by_loops": loss,
            "fwd_bwd_seconds": {str(ell): t for ell, t in samples.items()},
            "fwd_bwd_paired_ratio": ratio,
            "train_seconds_per_step": {r.name: r.seconds_per_step for r in (off, on)},
        },
        metrics=metrics,
        plot=lambda path: figure(path, draw, panels=2),
        method=[
            "Step time: forward + backward of one micro-batch of held-out tokens with each run's final weights, "
            "the two models and the loop counts alternating in this process (1 thread); the ratio is the median over "
            "the repeats of (replay-on call / the replay-off call just before it), the number to read "
            "(absolute times depend on the machine's load). The training s/step comes from two "
            "separate runs and includes the optimizer; it is noisier.",
        ],
    )


EXPERIMENT = Experiment(
    name="route-replay",
    title="Route replay on/off: step time and loss",
    question="Passes ≥ 1 reuse the expert choices of pass 0 (ELR route replay; gate weights stay live). "
    "What does it cost or save per step, and what does it do to the loss? The late-switch job with "
    "`model.route_replay` off and on.",
    analyse=analyse,
    claims=(
        Claim(
            paper='"Cross-loop route replay cut mixed-depth update time by 11.7%"',
            source=ELR,
            magnitude="−11.7% update time",
            measure="replay-on / replay-off fwd+bwd time at ℓ = L_max, minus 1 (a fraction)",
            value=paired("replay-on", "replay-off", "time_ratio@max"),
            expect="negative",
        ),
        Claim(
            paper='route replay costs little loss: "while raising four-loop validation loss by 0.0038"',
            source=ELR,
            magnitude="+0.0038 nat at four loops",
            measure="replay-on minus replay-off held-out loss at ℓ = 4 (nats)",
            value=paired("replay-on", "replay-off", "loss@4"),
            expect="positive",
        ),
    ),
)
