"""The GPU check's numerics sections: TE vs local spec, fused vs unfused route replay, route replay at size, FP8.

Tolerances (fp32 with TF32 off, bench/gpu_common.py ``tf32_off``): one fp32 rounding is 2^-24 ≈ 6e-8 of a
value; two implementations of the same layer that differ only in summation order or fused kernels differ by
a few roundings per op, compounding over the dozen layer calls of these models to ~1e-6..1e-5 of a value. TF32
(10-bit mantissa, 2^-11 ≈ 5e-4 per product) would show as ≳ 1e-4. So logits and losses must agree to 1e-5
(parity allows 1e-4: different attention and norm kernels), gradients — relative to each tensor's largest
entry — to 1e-4.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from bench.gpu_common import Ctx, build, copy_weights, fusion_fields, rel_diff, stdlib_tokens, train
from elastic_pretrain.model.config import ModelConfig

LOGIT_TOL = 1e-4
LOSS_TOL = 1e-5
GRAD_TOL = 1e-4


def small(ctx: Ctx, **kw: Any) -> ModelConfig:
    d = 64 if ctx.toy else 256
    base = dict(
        hidden_size=d,
        num_heads=4 if ctx.toy else 8,
        ffn_hidden_size=2 * d,
        prelude_layers=1,
        coda_layers=1,
        core_layers=2,
        num_experts=4,
        loops=2,
        flatten=2,
        moe_ffn_hidden_size=d,
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=0.0,
    )
    return ModelConfig(**{**base, **kw})


def section_parity(ctx: Ctx) -> None:
    """TE-spec vs local-spec logits at every ℓ with the same weights (fp32, route replay off), then bf16 steps."""
    cfg = small(ctx, route_replay=False, dtype="fp32")
    local = build(cfg, ctx, spec="local").eval()
    te = build(cfg, ctx).eval()
    if not ctx.te:
        print("  no Transformer Engine here: local spec vs local spec (the code path only)")
    missing, unused = copy_weights(local, te)
    ctx.check(
        "every TE-spec weight has a local-spec source, every local weight is used (final norm included)",
        not missing and not unused,
        f"without source: {missing or 'none'}; unused: {unused or 'none'}",
    )
    tokens = stdlib_tokens(2, 64 if ctx.toy else 256).to(ctx.device)
    worst = 0.0
    with torch.no_grad():
        for ell in range(1, cfg.max_loops + 1):
            err = rel_diff(te(tokens[:, :-1], loops=ell)[ell], local(tokens[:, :-1], loops=ell)[ell])
            worst = max(worst, err)
            print(f"  ℓ={ell}: max |TE - local| / max |local| logits = {err:.2e}")
    ctx.check(f"TE and local logits agree in fp32 at every ℓ (≤ {LOGIT_TOL:g})", worst <= LOGIT_TOL, f"{worst:.2e}")
    steps = 3 if ctx.toy else 30
    bcfg = dataclasses.replace(cfg, dtype="bf16")
    data = stdlib_tokens(steps * 4, 64 if ctx.toy else 256, seed=1)
    nets = {"local": build(bcfg, ctx, spec="local"), "te": build(bcfg, ctx)}
    copy_weights(nets["local"], nets["te"])
    curves = {name: train(net, data, steps=steps, mbs=4, loops=cfg.max_loops, ctx=ctx) for name, net in nets.items()}
    marks = sorted({0, steps // 2, steps - 1})
    for name, curve in curves.items():
        print(f"  {name:>5} bf16: " + "  ".join(f"step {i + 1}: {curve[i]:.4f}" for i in marks))
    print(
        f"  max |loss TE - loss local| over {steps} bf16 steps: "
        f"{max(abs(a - b) for a, b in zip(*curves.values())):.4f} (bf16 rounding; informative)"
    )


def grads_of(net: Any, tokens: torch.Tensor, *, loops: int, exits: tuple[int, ...]) -> tuple[dict[int, float], dict]:
    """Per-exit mean losses of one forward and the gradients of their sum."""
    net.zero_grad(set_to_none=True)
    out = net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops, exits=exits)
    total = torch.stack([v.float().mean() for v in out.values()]).sum()
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}
    return {e: float(v.float().mean()) for e, v in out.items()}, grads


def compare(ctx: Ctx, what: str, a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    """Check two (losses, gradients) results equal to LOSS_TOL / GRAD_TOL."""
    loss_err = max(abs(a[0][e] - b[0][e]) / abs(b[0][e]) for e in b[0])
    grad_err = max(rel_diff(a[1][n], b[1][n]) for n in b[1].keys() & a[1].keys())
    ctx.check(f"{what}: losses at every exit (≤ {LOSS_TOL:g})", loss_err <= LOSS_TOL, f"{loss_err:.2e}")
    ctx.check(f"{what}: every gradient (≤ {GRAD_TOL:g} of its largest entry)", grad_err <= GRAD_TOL, f"{grad_err:.2e}")
    ctx.check(
        f"{what}: the same parameters get gradients",
        a[1].keys() == b[1].keys(),
        str(sorted(a[1].keys() ^ b[1].keys())[:4]),
    )


def section_replay_fused(ctx: Ctx) -> None:
    """Route replay (``dispatch``) with Transformer Engine's fused permute vs megatron's unfused permute: passes
    ≥ 1 permute with pass 0's recorded routing map through the fused kernel, which no CPU test can run."""
    cfg = small(ctx, route_replay=True, dtype="fp32", num_experts=8, loops=3, flatten=1)
    with fusion_fields(moe_permute_fusion=False):
        unfused = build(cfg, ctx).train()
    fused = build(cfg, ctx).train()
    fused.load_state_dict(unfused.state_dict())
    if ctx.te:
        ctx.check("the fused model permutes with TE's fused kernel", bool(fused.config.moe_permute_fusion))
    else:
        print("  no Transformer Engine here: unfused vs unfused (the code path only)")
    tokens = stdlib_tokens(4, 64 if ctx.toy else 512, seed=5).to(ctx.device)
    a = grads_of(fused, tokens, loops=3, exits=(1, 2, 3))
    b = grads_of(unfused, tokens, loops=3, exits=(1, 2, 3))
    compare(ctx, "route replay, fused vs unfused permute (fp32, ℓ=3)", a, b)


def section_replay_size(ctx: Ctx) -> None:
    """Route replay at a realistic size (hidden 1024, 16k tokens per micro-batch): the ``dispatch`` and
    ``router`` implementations replay the same routes, so with aux/z losses off their losses and gradients are
    equal (fp32); then the step time of each against replay off (bf16, interleaved; ELR reports -11.7 %)."""
    d, seq, rows = (64, 64, 2) if ctx.toy else (1024, 4096, 4)
    shape = dict(
        hidden_size=d,
        num_heads=4 if ctx.toy else 16,
        ffn_hidden_size=4 * d,
        prelude_layers=1,
        coda_layers=1,
        core_layers=2,
        num_experts=8,
        loops=4,
        flatten=1,
        moe_top_k=2,
        moe_ffn_hidden_size=d,
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=0.0,
    )
    tokens = stdlib_tokens(rows, seq, seed=6).to(ctx.device)
    print(f"  hidden {d}, {rows} x {seq} = {rows * seq} tokens, 8 experts top-2, ℓ=4")
    results = {}
    for impl in ("dispatch", "router"):
        net = build(ModelConfig(**shape, route_replay=True, route_replay_impl=impl, dtype="fp32"), ctx).train()
        results[impl] = grads_of(net, tokens, loops=4, exits=(2, 4))
        del net
    compare(ctx, "route replay dispatch vs router (fp32)", results["dispatch"], results["router"])
    print(f"  loss at ℓ=2, 4: {results['dispatch'][0][2]:.5f}, {results['dispatch'][0][4]:.5f}")
    del results
    if ctx.cuda:
        torch.cuda.empty_cache()
    variants = {
        "off": dict(route_replay=False),
        "dispatch": dict(route_replay=True, route_replay_impl="dispatch"),
        "router": dict(route_replay=True, route_replay_impl="router"),
    }
    nets = {k: build(ModelConfig(**shape, **kw, dtype="bf16"), ctx).train() for k, kw in variants.items()}
    ratios = interleaved(ctx, nets, tokens, repeats=2 if ctx.toy else 7)
    print(
        "  step time (bf16, fwd+bwd, ℓ=4), median of paired ratios: "
        + ", ".join(f"{k}/off {v:.3f}" for k, v in ratios.items())
    )


def interleaved(ctx: Ctx, nets: dict[str, Any], tokens: torch.Tensor, *, repeats: int) -> dict[str, float]:
    """Each repeat runs every variant once in turn; a ratio is the median of (variant / ``off``) per repeat."""

    def step(net: Any) -> float:
        net.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        net(tokens[:, :-1], labels=tokens[:, 1:], loops=4)[4].float().mean().backward()
        ctx.sync()
        return time.perf_counter() - t0

    for net in nets.values():  # warm-up: kernels, allocator
        step(net)
    samples: dict[str, list[float]] = {k: [] for k in nets}
    for _ in range(repeats):
        for k, net in nets.items():
            samples[k].append(step(net))
    return {k: statistics.median(x / o for x, o in zip(v, samples["off"])) for k, v in samples.items() if k != "off"}


def fp8_probe(net: torch.nn.Module) -> tuple[dict[str, int], list[Any]]:
    """Count TE GEMM module calls made inside / outside an FP8 autocast (forward pre-hooks). Norms and
    the output layer run outside it, as in megatron's TransformerBlock."""
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except ImportError:  # newer TE
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # type: ignore[no-redef]
    counts = {"fp8": 0, "other": 0}

    def hook(module: Any, args: Any) -> None:
        counts["fp8" if FP8GlobalStateManager.is_fp8_enabled() else "other"] += 1

    handles = [
        m.register_forward_pre_hook(hook)
        for m in net.modules()
        if type(m).__module__.startswith(("transformer_engine", "megatron.core.extensions"))
        and "Linear" in type(m).__name__
    ]
    return counts, handles


def section_fp8(ctx: Ctx) -> None:
    """bf16 vs FP8 (tensorwise, delayed) over 100 steps at hidden 1024 from the same initialisation."""
    d = 128 if ctx.toy else 1024
    cfg = ModelConfig(
        hidden_size=d,
        num_heads=8 if ctx.toy else 16,
        ffn_hidden_size=4 * d,
        prelude_layers=1,
        coda_layers=1,
        core_layers=2,
        num_experts=8,
        loops=2,
        flatten=1,
        moe_top_k=2,
        moe_ffn_hidden_size=d // 2,
        dtype="bf16",
    )
    steps, seq, mbs = (3, 64, 2) if ctx.toy else (100, 1024, 4)
    data = stdlib_tokens(steps * mbs, seq, seed=2)
    results = {"bf16": train(build(cfg, ctx), data, steps=steps, mbs=mbs, loops=cfg.max_loops, ctx=ctx)}
    for recipe in ("tensorwise", "delayed"):
        try:
            net = build(dataclasses.replace(cfg, fp8=recipe), ctx)
        except Exception as err:  # CPU / no TE: refused with a one-line error, as a job would be
            print(f"  fp8={recipe}: not run here ({type(err).__name__}: {err})")
            continue
        counts, handles = fp8_probe(net)
        results[recipe] = train(net, data, steps=steps, mbs=mbs, loops=cfg.max_loops, ctx=ctx)
        for h in handles:
            h.remove()
        ctx.check(
            f"fp8={recipe}: every TE GEMM call ran inside the FP8 autocast",
            counts["fp8"] > 0 and counts["other"] == 0,
            f"{counts['fp8']} inside, {counts['other']} outside",
        )
    window = max(1, steps // 10)
    bf16_last = statistics.mean(results["bf16"][-window:])
    for name, curve in results.items():
        first, last = statistics.mean(curve[:window]), statistics.mean(curve[-window:])
        print(f"  {name:>10}: first {first:.4f}  last {last:.4f} (mean of {window} steps)")
        if name != "bf16":
            # a loose bound: FP8 weights frozen at their step-1 quantization (issue 30 item 2) keep the loss
            # tenths of a nat above bf16's; FP8's own rounding moves it by hundredths
            ctx.check(
                f"fp8={name} tracks bf16 (final loss within 0.1 nats)",
                abs(last - bf16_last) <= 0.1,
                f"{last - bf16_last:+.4f}",
            )
