"""The GPU check's size and speed sections: memory per pass, MFU, grouped experts, and ``pytest -m gpu``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import torch

from bench.gpu_common import PAR, REPO, Ctx, build, fwd_bwd, stdlib_tokens, timed
from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel import megatron as pm
from elastic_pretrain.train.mfu import DepthCounts, device_peak, step_flops

MEMORY_TOL = 0.25  # per-pass slope vs the estimate, as tests/gpu/test_gpu_path.py (the estimate's stated accuracy)


def measure_activations(net: Any, tokens: torch.Tensor, loops: int, ctx: Ctx) -> int:
    """Activation bytes of one fwd+bwd. CUDA: peak allocated above the model's static memory (gradients stay
    allocated: zeroed, not freed). CPU: bytes saved for backward (saved_tensors_hooks) — what the estimate models."""
    net.zero_grad(set_to_none=False)
    if ctx.cuda:
        ctx.sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops)[loops].float().mean().backward()
        ctx.sync()
        return torch.cuda.max_memory_allocated() - before
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops)[loops].float().mean()
    out.backward()
    return sum(seen.values())


def section_memory(ctx: Ctx) -> None:
    """Activation memory per pass — the slope (bytes at ℓ=4 − bytes at ℓ=1) / 3, which the model's static
    memory and the allocator's warm-up do not enter — against ``estimate_memory``, for each recompute mode."""
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.parallel.memory import RECOMPUTE_MODES, estimate_memory

    d, seq = (64, 32) if ctx.toy else (2048, 4096)
    overrides = [
        "parallel=single",
        f"model.hidden_size={d}",
        f"model.num_heads={4 if ctx.toy else 16}",
        f"model.ffn_hidden_size={4 * d}",
        f"model.moe_ffn_hidden_size={d // 2}",
        "model.num_experts=8",
        "model.core_layers=2",
        "model.flatten=1",
        "model.loops=4",
        "model.dtype=bf16",
        f"data.seq_len={seq}",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
    ]
    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", overrides)
    est = estimate_memory(job, 1, spec="te" if ctx.te else "local").stages[0].activation_bytes
    tokens = stdlib_tokens(1, seq, seed=4).to(ctx.device)
    mib = 2**20
    step_time = {}
    print(f"  {'recompute':>9} {'ℓ=1 MiB':>9} {'ℓ=4 MiB':>9} {'MiB/pass':>9} {'estimate':>9} {'ratio':>6}")
    for mode in RECOMPUTE_MODES:
        net = build(job.model, ctx, recompute=mode).train()
        measure_activations(net, tokens, 4, ctx)  # warm-up (kernels, allocator) and every pass's gradients allocated
        got = {ell: measure_activations(net, tokens, ell, ctx) for ell in (1, 4)}
        slope, want = (got[4] - got[1]) / 3, (est[mode][4] - est[mode][1]) / 3
        ratio = slope / want if want else float("nan")
        print(f"  {mode:>9} {got[1] / mib:9.1f} {got[4] / mib:9.1f} {slope / mib:9.2f} {want / mib:9.2f} {ratio:6.2f}")
        if ctx.cuda:
            ctx.check(
                f"recompute={mode}: measured bytes per pass within {MEMORY_TOL:.0%} of the estimate",
                abs(ratio - 1) <= MEMORY_TOL,
                f"ratio {ratio:.2f}",
            )
        if mode in ("none", "pass"):
            step_time[mode] = timed(fwd_bwd(net, tokens, loops=4), ctx, 1 if ctx.toy else 3)
        del net
        if ctx.cuda:
            torch.cuda.empty_cache()
    print(
        f"  recompute=pass step time at ℓ=4: {step_time['pass'] / step_time['none']:.3f}x recompute=none "
        "(expected about 4/3: one more forward of the core)"
    )
    if not ctx.cuda:
        print("  (no CUDA: 'measured' = bytes saved for backward; the estimate's pass mode adds the re-run pass)")


def section_mfu(ctx: Ctx) -> None:
    """The looped model at ℓ=4 vs megatron's GPTModel with the same layers unrolled: tokens/s, and MFU from
    train/mfu.py (the trainer's FLOP count and peak table)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from elastic_pretrain.model.vocab import padded_vocab_size

    d = 96 if ctx.toy else 2048
    shape = dict(
        hidden_size=d,
        num_heads=4 if ctx.toy else 16,
        ffn_hidden_size=4 * d,
        prelude_layers=1,
        coda_layers=1,
        num_experts=8,
        moe_top_k=2,
        moe_ffn_hidden_size=d // 2,
        dtype="bf16",
        loop_conditioning=False,
        edge_mlp="moe",
    )
    cfg = ModelConfig(**shape, core_layers=2, loops=4, flatten=1)  # L_max 4
    seq, mbs = (64, 2) if ctx.toy else (2048, 4)
    tokens = stdlib_tokens(mbs, seq, seed=3).to(ctx.device)
    looped = build(cfg, ctx)
    unrolled = cfg.prelude_layers + cfg.core_layers_built * cfg.max_loops + cfg.coda_layers
    gcfg = ModelConfig(**{**shape, "core_layers": cfg.core_layers_built * cfg.max_loops, "loops": 1})
    assert gcfg.num_unique_layers == unrolled
    gpt = GPTModel(
        config=pm.transformer_config(gcfg, PAR),
        transformer_layer_spec=pm.layer_specs(gcfg).moe,
        vocab_size=padded_vocab_size(gcfg.vocab_size, 1),
        max_sequence_length=seq,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).to(ctx.device)
    reps = 2 if ctx.toy else 10
    get_moe_layer_wise_logging_tracker().clear()  # the MoE loss tracker is sized by the first model that logs
    t_loop = timed(fwd_bwd(looped, tokens, loops=cfg.max_loops), ctx, reps)
    get_moe_layer_wise_logging_tracker().clear()
    t_gpt = timed(
        lambda: (
            gpt.zero_grad(set_to_none=True),
            gpt(tokens[:, :-1], None, None, labels=tokens[:, 1:]).float().mean().backward(),
        ),
        ctx,
        reps,
    )
    get_moe_layer_wise_logging_tracker().clear()
    n_tok = mbs * seq
    flops = step_flops(
        cfg, DepthCounts(loops=cfg.max_loops, exits=1, ghost_passes=0), seq_len=seq, micro_batch_tokens=n_tok
    ).model  # the same per token for GPTModel: same layers, one exit
    peak = device_peak(None, precision="bf16")
    print(f"  peak: {peak[1] if peak else 'unknown on this device (train.peak_tflops sets one)'}")
    for name, t in (("looped ℓ=4", t_loop), (f"GPTModel {unrolled} layers", t_gpt)):
        mfu = f"{flops * n_tok / t / peak[0]:.1%}" if peak else "n/a"
        print(f"  {name:>20}: {n_tok / t:12.0f} tokens/s  MFU {mfu}")
    print(f"  looped / GPTModel tokens/s: {t_gpt / t_loop:.3f} (same FLOPs per token; 1.0 = no loop overhead)")


def section_grouped(ctx: Ctx) -> None:
    """MoE MLP fwd+bwd: TE grouped GEMM experts vs the per-expert loop (SequentialMLP)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import build_module

    d, f, e = (64, 64, 4) if ctx.toy else (2048, 1024, 8)
    n = 256 if ctx.toy else 16384
    cfg = ModelConfig(
        hidden_size=d,
        num_heads=4,
        num_experts=e,
        moe_ffn_hidden_size=f,
        moe_top_k=2,
        dtype="bf16",
        core_layers=1,
        loops=1,
        ffn_hidden_size=4 * d,
    )
    x = torch.randn(n, 1, d, device=ctx.device, dtype=torch.bfloat16)
    times = {}
    for grouped in (False, True):
        if grouped and not ctx.te:
            print("  grouped GEMM: not run here (needs CUDA + Transformer Engine)")
            continue
        tconfig = dataclasses.replace(pm.transformer_config(cfg, PAR), moe_grouped_gemm=grouped)
        spec = (
            gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=e, moe_grouped_gemm=grouped)
            if ctx.te
            else gpt_layer_specs.get_gpt_layer_local_spec(num_experts=e)
        )
        mlp = build_module(spec.submodules.mlp, config=tconfig).to(ctx.device)

        def run(mlp: Any = mlp) -> None:
            out, _ = mlp(x.detach().requires_grad_())
            out.float().sum().backward()

        times[grouped] = timed(run, ctx, 2 if ctx.toy else 20)
        print(
            f"  {'grouped GEMM' if grouped else 'per-expert loop':>16}: {times[grouped] * 1e3:8.2f} ms fwd+bwd "
            f"({n} tokens, {e} experts, top-2, D={d}, F={f})"
        )
    if len(times) == 2:
        print(f"  grouped speed-up over the per-expert loop: {times[False] / times[True]:.2f}x")


def section_pytest_gpu(ctx: Ctx) -> None:
    """``pytest -m gpu tests/gpu`` (skipped without CUDA), in its own process within the section's budget."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "tests/gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-W",
            "ignore",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=ctx.remaining(),
    )
    print("\n".join(f"  {line}" for line in proc.stdout.strip().splitlines()[-15:]))
    ctx.check("pytest -m gpu", proc.returncode == 0, f"exit {proc.returncode}")
