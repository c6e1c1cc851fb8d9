"""The GPU check: the first thing to run on a CUDA machine (bench/gpu_check.sh runs it; docs/gpu.md).

    python bench/gpu_check.py [--dry-run] [--only SECTION ...]

One process, one GPU, about 5 minutes on an H200. Each section prints its figures against a baseline
measured in the same run (no asserts — a section that raises prints its error and the next one runs):

  env         torch / CUDA / Transformer Engine / megatron-core versions, the device, the spec chosen
  te_vs_local TE-spec vs local-spec logits at every ℓ with the same weights (fp32), and weights one
              side has that the other lacks (a TE model losing its final norm shows here)
  steps       50 bf16 training steps, TE spec vs local spec, same init and data: the loss curves
  fp8         bf16 vs FP8 (tensorwise, then delayed) over 200 steps at hidden 1024, and the fraction
              of Transformer Engine GEMM calls that ran inside an FP8 autocast (proof FP8 ran)
  looped_gpt  the looped model at ℓ=4 vs a megatron GPTModel with the same unrolled layers: tokens/s
              ratio and the model-FLOPs utilisation of each
  grouped     MoE MLP fwd+bwd: TE grouped GEMM experts vs the per-expert loop (SequentialMLP)
  memory      peak activation memory vs parallel/memory.py's estimate at ℓ=1..4, recompute none/pass,
              and the step-time overhead of recompute=pass

``--dry-run`` runs every section at toy sizes with whatever the machine has (CPU, local spec, a few
steps): a test runs it on CPU so that a typo does not cost GPU time. Data: byte-level tokens of the
Python standard library (the embedded default corpus), read directly — no shards needed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import sysconfig
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
warnings.filterwarnings("ignore")

from elastic_pretrain.model.config import ModelConfig  # noqa: E402
from elastic_pretrain.model.vocab import padded_vocab_size  # noqa: E402
from elastic_pretrain.parallel import megatron as pm  # noqa: E402
from elastic_pretrain.parallel.mesh import ParallelConfig  # noqa: E402

PAR = ParallelConfig()
SECTIONS = ("env", "te_vs_local", "steps", "fp8", "looped_gpt", "grouped", "memory")
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12}  # dense bf16 FLOP/s (SXM)


@dataclasses.dataclass
class Env:
    dry: bool
    device: torch.device
    te: bool  # Transformer Engine + CUDA: the TE spec is what build_model picks

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ helpers
def stdlib_tokens(n_seq: int, seq: int, seed: int = 0) -> torch.Tensor:
    """``[n_seq, seq+1]`` byte tokens from random offsets in the standard library's source."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes() + b"\n"
        if len(data) > 8 << 20:
            break
    flat = torch.frombuffer(bytes(data), dtype=torch.uint8).long()
    starts = torch.randint(0, flat.numel() - seq - 1, (n_seq,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([flat[s : s + seq + 1] for s in starts.tolist()])


@contextlib.contextmanager
def local_spec() -> Iterator[None]:
    """build_model as on a machine without TE (the local spec), also on a GPU."""
    original = pm.te_available
    pm.te_available = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        pm.te_available = original  # type: ignore[assignment]


def build(cfg: ModelConfig, env: Env, *, spec: str = "auto", recompute: str = "none", seed: int = 0) -> Any:
    torch.manual_seed(seed)
    if spec == "local":  # the local spec has no TE kernels: no fused kernels, no grouped-GEMM experts either
        names = {f.name for f in dataclasses.fields(cfg)}
        cfg = dataclasses.replace(cfg, **{k: "off" for k in ("fusions", "moe_grouped_gemm") if k in names})
    with local_spec() if spec == "local" else contextlib.nullcontext():
        return pm.build_model(cfg, PAR, recompute=recompute)  # type: ignore[arg-type]


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Copy local-spec weights into a (TE-spec) model of the same shape. TE fuses a layer's input norm
    into its QKV projection (``linear_qkv.layer_norm_weight``) and a dense layer's pre-MLP norm into fc1.
    Returns (destination weights with no source, source weights not used)."""
    src_state = {k: v for k, v in src.state_dict().items() if not k.endswith("_extra_state")}
    renames = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
               ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))
    missing, used = [], set()
    with torch.no_grad():
        for name, tensor in dst.state_dict().items():
            if name.endswith("_extra_state") or not torch.is_floating_point(tensor):
                continue
            source = name
            for fused, plain in renames:
                if fused in name:
                    source = name.replace(fused, plain)
            if source not in src_state:
                missing.append(name)
                continue
            tensor.copy_(src_state[source].to(tensor.dtype))
            used.add(source)
    unused = [k for k, v in src_state.items() if k not in used and torch.is_floating_point(v)]
    return missing, unused


def megatron_optimizer(net: Any, lr: float) -> tuple[Any, Any]:
    """megatron DDP (fp32 gradient buffer) + distributed Adam, as a training run builds them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = net.cfg.dtype == "bf16"
    ddp = DistributedDataParallel(config=net.config, module=net, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=True), [ddp])
    return ddp, opt


def train(net: Any, data: torch.Tensor, *, steps: int, mbs: int, loops: int, env: Env, lr: float = 1e-3) -> list[float]:
    """``steps`` optimizer steps (one micro-batch each) at ℓ = ``loops``; the loss of each step."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()  # sized by the first model that logs: start afresh

    ddp, opt = megatron_optimizer(net, lr)
    net.train()
    losses = []
    for step in range(steps):
        batch = data[(step * mbs) % len(data):][:mbs].to(env.device)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = net(batch[:, :-1], labels=batch[:, 1:], loops=loops)[loops].float().mean()
        loss.backward()
        finalize_model_grads([ddp])
        opt.step()
        clear_aux_losses_tracker()
        losses.append(float(loss))
    return losses


def timed(fn: Callable[[], Any], env: Env, repeats: int) -> float:
    for _ in range(2):
        fn()
    env.sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        env.sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def fwd_bwd(model: Any, tokens: torch.Tensor, **kw: Any) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        out = model(tokens[:, :-1], labels=tokens[:, 1:], **kw)
        (out[max(out)] if isinstance(out, dict) else out).float().mean().backward()
    return run


def flops_per_token(cfg: ModelConfig, seq: int, loops: int) -> float:
    """Model FLOPs (fwd + bwd = 3x fwd) per token at ℓ passes: GEMMs + attention scores, no recompute."""
    d = cfg.hidden_size
    attn = 8 * d * d + 4 * seq * d  # QKV + output projection, QK^T + AV (no causal discount, as megatron)
    moe = cfg.moe_top_k * 6 * d * cfg.moe_ffn_hidden_size + 2 * d * cfg.experts_built
    edge_mlp = moe if cfg.edge_mlp == "moe" else 6 * d * cfg.ffn_hidden_size
    layers = loops * cfg.core_layers_built * (attn + moe) + (cfg.prelude_layers + cfg.coda_layers) * (attn + edge_mlp)
    return 3 * (layers + 2 * d * padded_vocab_size(cfg.vocab_size, 1))


def peak_flops(env: Env) -> float | None:
    if env.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


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

    handles = [m.register_forward_pre_hook(hook) for m in net.modules()
               if type(m).__module__.startswith(("transformer_engine", "megatron.core.extensions"))
               and "Linear" in type(m).__name__]
    return counts, handles


def measure_activations(net: Any, tokens: torch.Tensor, loops: int, env: Env) -> int:
    """Peak activation bytes of one fwd+bwd. CUDA: peak allocated above the model's static memory
    (gradients stay allocated: zeroed, not freed); CPU (dry run): bytes saved for backward
    (saved_tensors_hooks) — what the estimate models."""
    net.zero_grad(set_to_none=False)
    if env.device.type == "cuda":
        env.sync()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops)[loops].float().mean().backward()
        env.sync()
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


# ------------------------------------------------------------------------------------------------ sections
def section_env(env: Env) -> None:
    import megatron.core

    te = "absent"
    with contextlib.suppress(Exception):
        import transformer_engine

        te = transformer_engine.__version__
    dev = torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu"
    print(f"  torch {torch.__version__} (CUDA {torch.version.cuda}) | megatron-core {megatron.core.__version__} | "
          f"transformer-engine {te} | device {dev} | spec {'te' if env.te else 'local'}")
    if env.device.type == "cuda" and not env.te:
        print("  WARNING: CUDA without Transformer Engine: the TE sections compare the local spec with itself")


def section_te_vs_local(env: Env) -> None:
    cfg = ModelConfig(hidden_size=256, num_heads=8, ffn_hidden_size=512, prelude_layers=1, coda_layers=1,
                      core_layers=2, num_experts=4, loops=2, flatten=2, moe_ffn_hidden_size=256, moe_z_loss_coeff=0,
                      route_replay=True, dtype="fp32")
    local = build(cfg, env, spec="local").eval()
    te = build(cfg, env).eval()
    missing, unused = copy_weights(local, te)
    print(f"  TE-model weights without a local source: {missing or 'none'}; local weights unused: {unused or 'none'}")
    tokens = stdlib_tokens(2, 128).to(env.device)
    with torch.no_grad():
        for ell in range(1, cfg.max_loops + 1):
            a = local(tokens[:, :-1], loops=ell)[ell].float()
            b = te(tokens[:, :-1], loops=ell)[ell].float()
            err = float((a - b).abs().max() / a.abs().max())
            print(f"  l={ell}: max |TE - local| / max |local| logits = {err:.2e}")


def section_steps(env: Env) -> None:
    cfg = ModelConfig(hidden_size=256, num_heads=8, ffn_hidden_size=512, prelude_layers=1, coda_layers=1,
                      core_layers=2, num_experts=4, loops=2, flatten=2, moe_ffn_hidden_size=256, dtype="bf16")
    steps = 3 if env.dry else 50
    data = stdlib_tokens(steps * 4, 64 if env.dry else 256, seed=1)
    local = build(cfg, env, spec="local")
    te = build(cfg, env)
    copy_weights(local, te)
    curves = {"local": train(local, data, steps=steps, mbs=4, loops=cfg.max_loops, env=env),
              "te": train(te, data, steps=steps, mbs=4, loops=cfg.max_loops, env=env)}
    for name, losses in curves.items():
        marks = sorted({0, steps // 4, steps // 2, steps - 1})
        print(f"  {name:>5}: " + "  ".join(f"step {i + 1}: {losses[i]:.4f}" for i in marks))
    diff = max(abs(a - b) for a, b in zip(*curves.values()))
    print(f"  max |loss TE - loss local| over {steps} bf16 steps: {diff:.4f}")


def section_fp8(env: Env) -> None:
    d = 128 if env.dry else 1024
    cfg = ModelConfig(hidden_size=d, num_heads=8 if env.dry else 16, ffn_hidden_size=4 * d, prelude_layers=1,
                      coda_layers=1, core_layers=2, num_experts=8, loops=2, flatten=1, moe_top_k=2,
                      moe_ffn_hidden_size=d // 2, dtype="bf16")
    steps, seq, mbs = (3, 64, 2) if env.dry else (200, 1024, 8)
    data = stdlib_tokens(steps * mbs, seq, seed=2)
    bf16 = train(build(cfg, env), data, steps=steps, mbs=mbs, loops=cfg.max_loops, env=env)
    results = {"bf16": bf16}
    for recipe in ("tensorwise", "delayed"):
        fcfg = dataclasses.replace(cfg, fp8=recipe)
        try:
            net = build(fcfg, env)
        except Exception as err:  # CPU / no TE: refused with a one-line error, as a job would be
            print(f"  fp8={recipe}: not run here ({type(err).__name__}: {err})")
            continue
        counts, handles = fp8_probe(net)
        results[recipe] = train(net, data, steps=steps, mbs=mbs, loops=cfg.max_loops, env=env)
        for h in handles:
            h.remove()
        total = counts["fp8"] + counts["other"]
        print(f"  fp8={recipe}: {counts['fp8']}/{total} TE GEMM calls ran inside the FP8 autocast")
    window = max(1, steps // 10)
    for name, losses in results.items():
        first, last = statistics.mean(losses[:window]), statistics.mean(losses[-window:])
        print(f"  {name:>10}: first {first:.4f}  last {last:.4f} (mean of {window} steps)")
        if name != "bf16":
            gap = statistics.mean(losses[-window:]) - statistics.mean(bf16[-window:])
            print(f"  {'':>10}  {name} - bf16 final loss: {gap:+.4f}")


def section_looped_gpt(env: Env) -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    d = 96 if env.dry else 2048
    shape = dict(hidden_size=d, num_heads=4 if env.dry else 16, ffn_hidden_size=4 * d, prelude_layers=1,
                 coda_layers=1, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=d // 2, dtype="bf16",
                 loop_conditioning=False, edge_mlp="moe")
    cfg = ModelConfig(**shape, core_layers=2, loops=4, flatten=1)  # L_max 4
    seq, mbs = (64, 2) if env.dry else (2048, 4)
    tokens = stdlib_tokens(mbs, seq, seed=3).to(env.device)
    looped = build(cfg, env)
    unrolled = cfg.prelude_layers + cfg.core_layers_built * cfg.max_loops + cfg.coda_layers
    # the same layers unrolled: GPTModel builds num_unique_layers = prelude + core + coda MoE layers
    gcfg = ModelConfig(**{**shape, "core_layers": cfg.core_layers_built * cfg.max_loops, "loops": 1})
    assert gcfg.num_unique_layers == unrolled
    gpt = GPTModel(config=pm.transformer_config(gcfg, PAR), transformer_layer_spec=pm.layer_specs(gcfg).moe,
                   vocab_size=padded_vocab_size(gcfg.vocab_size, 1), max_sequence_length=seq,
                   position_embedding_type="rope", share_embeddings_and_output_weights=False).to(env.device)
    reps = 2 if env.dry else 10
    get_moe_layer_wise_logging_tracker().clear()  # the MoE loss tracker is sized by the first model that logs
    t_loop = timed(fwd_bwd(looped, tokens, loops=cfg.max_loops), env, reps)
    get_moe_layer_wise_logging_tracker().clear()  # sized by the first model's layer count
    t_gpt = timed(lambda: (gpt.zero_grad(set_to_none=True),
                           gpt(tokens[:, :-1], None, None, labels=tokens[:, 1:]).float().mean().backward()), env, reps)
    get_moe_layer_wise_logging_tracker().clear()
    n_tok = mbs * seq
    peak = peak_flops(env)
    fpt = flops_per_token(cfg, seq, cfg.max_loops)
    for name, t in (("looped l=4", t_loop), (f"GPTModel {unrolled} layers", t_gpt)):
        mfu = f"{fpt * n_tok / t / peak:.1%}" if peak else "n/a (no known peak)"
        print(f"  {name:>20}: {n_tok / t:12.0f} tokens/s  MFU {mfu}")
    print(f"  looped / GPTModel tokens/s: {t_gpt / t_loop:.3f} (same FLOPs per token; 1.0 = no loop overhead)")


def section_grouped(env: Env) -> None:
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import build_module

    d, f, e = (64, 64, 4) if env.dry else (2048, 1024, 8)
    n = 256 if env.dry else 16384
    cfg = ModelConfig(hidden_size=d, num_heads=4, num_experts=e, moe_ffn_hidden_size=f, moe_top_k=2, dtype="bf16",
                      core_layers=1, loops=1, ffn_hidden_size=4 * d)
    x = torch.randn(n, 1, d, device=env.device, dtype=torch.bfloat16)
    times = {}
    for grouped in (False, True):
        if grouped and not env.te:
            print("  grouped GEMM: not run here (needs CUDA + Transformer Engine)")
            continue
        tconfig = dataclasses.replace(pm.transformer_config(cfg, PAR), moe_grouped_gemm=grouped)
        spec = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=e, moe_grouped_gemm=grouped)
                if env.te else gpt_layer_specs.get_gpt_layer_local_spec(num_experts=e))
        mlp = build_module(spec.submodules.mlp, config=tconfig).to(env.device)

        def run(mlp: Any = mlp) -> None:
            inp = x.detach().requires_grad_()
            out, _ = mlp(inp)
            out.float().sum().backward()
        times[grouped] = timed(run, env, 2 if env.dry else 20)
        print(f"  {'grouped GEMM' if grouped else 'per-expert loop':>16}: {times[grouped] * 1e3:8.2f} ms fwd+bwd "
              f"({n} tokens, {e} experts, top-2, D={d}, F={f})")
    if len(times) == 2:
        print(f"  grouped speed-up over the per-expert loop: {times[False] / times[True]:.2f}x")


def section_memory(env: Env) -> None:
    from elastic_pretrain.job import load_job
    from elastic_pretrain.parallel.memory import estimate_memory

    d, seq = (64, 32) if env.dry else (2048, 4096)
    overrides = ["parallel=single", f"model.hidden_size={d}", f"model.num_heads={4 if env.dry else 16}",
                 f"model.ffn_hidden_size={4 * d}", f"model.moe_ffn_hidden_size={d // 2}", "model.num_experts=8",
                 "model.core_layers=2", "model.flatten=1", "model.loops=4", "model.dtype=bf16",
                 f"data.seq_len={seq}", "train.micro_batch_size=1", "train.global_batch_size=1"]
    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", overrides)
    est = estimate_memory(job, 1, spec="te" if env.te else "local").stages[0].activation_bytes
    tokens = stdlib_tokens(1, seq, seed=4).to(env.device)
    mib = 2**20
    step_time = {}
    print(f"  {'recompute':>9} {'l':>2} {'measured MiB':>13} {'estimate MiB':>13} {'ratio':>6}")
    for mode in ("none", "pass"):
        net = build(job.model, env, recompute=mode).train()
        measure_activations(net, tokens, 1, env)  # warm-up (kernels, allocator)
        for ell in range(1, 5):
            got = measure_activations(net, tokens, ell, env)
            want = est[mode][ell]
            print(f"  {mode:>9} {ell:>2} {got / mib:13.1f} {want / mib:13.1f} {got / want:6.2f}")
        step_time[mode] = timed(fwd_bwd(net, tokens, loops=4), env, 1 if env.dry else 5)
        del net
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"  recompute=pass step time at l=4: {step_time['pass'] / step_time['none']:.3f}x recompute=none")
    if env.device.type != "cuda":
        print("  (no CUDA: 'measured' = bytes saved for backward at the end of the forward; with recompute=pass the "
              "estimate adds the re-run pass live during its backward)")


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on whatever this machine has (CPU test)")
    parser.add_argument("--only", nargs="*", choices=SECTIONS, help="run these sections only")
    args = parser.parse_args(argv)
    from elastic_pretrain.parallel.mesh import init_mesh, teardown

    torch.set_num_threads(1 if args.dry_run else torch.get_num_threads())
    init_mesh(PAR, seed=0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    env = Env(dry=args.dry_run, device=device, te=pm.te_available())
    failed = []
    start = time.perf_counter()
    for name in args.only or SECTIONS:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            globals()[f"section_{name}"](env)
        except Exception:
            failed.append(name)
            traceback.print_exc(file=sys.stdout)
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"== done in {time.perf_counter() - start:.0f} s; failed sections: {', '.join(failed) or 'none'}")
    teardown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
