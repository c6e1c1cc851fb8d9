"""What the GPU check's sections share (bench/gpu_check.py): the context, data, model building, a training loop.

Every function takes the device from :class:`Ctx`, so the same code runs on CUDA at full size and on CPU at toy
sizes (``Ctx.toy``; tests/parallel/test_gpu_check.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import statistics
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel import megatron as pm
from elastic_pretrain.parallel.mesh import ParallelConfig

REPO = Path(__file__).resolve().parent.parent
PAR = ParallelConfig()


@dataclasses.dataclass
class Ctx:
    toy: bool
    device: torch.device
    te: bool  # CUDA + Transformer Engine: the TE spec is what build_model picks
    workdir: Path
    deadline: float = math.inf  # of the running section (gpu_check.run_sections sets it)
    failures: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def skip_te(self) -> bool:
        """TE sections are skipped on CUDA without TE; on CPU (toy) they run their code paths on the local spec."""
        return self.cuda and not self.te

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 1.0)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        """A verdict line; a failed check fails the section (and the check's exit status)."""
        print(f"  {'PASS' if ok else 'FAIL'}: {what}{f' ({detail})' if detail else ''}", flush=True)
        self.failures += not ok
        return ok

    def close(self) -> None:
        from elastic_pretrain.parallel.mesh import teardown

        shutil.rmtree(self.workdir, ignore_errors=True)
        with contextlib.suppress(Exception):
            teardown()


def tf32_off() -> None:
    """fp32 comparisons in fp32: torch's switches here; cuBLAS and cuDNN calls that ask for TF32 themselves
    (Transformer Engine's fp32 GEMMs use CUBLAS_COMPUTE_32F_FAST_TF32) are overridden by
    NVIDIA_TF32_OVERRIDE=0, which bench/gpu_check.sh exports before CUDA starts."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def make_ctx(*, toy: bool) -> Ctx:
    from elastic_pretrain.parallel.mesh import init_mesh

    warnings.filterwarnings("ignore")
    if toy:
        torch.set_num_threads(1)
    tf32_off()
    init_mesh(PAR, seed=0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return Ctx(toy=toy, device=device, te=pm.te_available(), workdir=Path(tempfile.mkdtemp(prefix="gpu_check_")))


def section_env(ctx: Ctx) -> None:
    import os

    import megatron.core

    te = "absent"
    with contextlib.suppress(Exception):
        import transformer_engine

        te = transformer_engine.__version__
    dev = torch.cuda.get_device_name() if ctx.cuda else "cpu"
    print(
        f"  torch {torch.__version__} (CUDA {torch.version.cuda}) | megatron-core {megatron.core.__version__} | "
        f"transformer-engine {te} | device {dev} | spec {'te' if ctx.te else 'local'}"
    )
    print(
        f"  TF32: torch matmul {torch.backends.cuda.matmul.allow_tf32}, cudnn {torch.backends.cudnn.allow_tf32}, "
        f"NVIDIA_TF32_OVERRIDE={os.environ.get('NVIDIA_TF32_OVERRIDE', '(unset)')}"
    )
    if ctx.skip_te:
        print("  CUDA without Transformer Engine: the TE sections are skipped, the others run on the local spec")


# ------------------------------------------------------------------------------------------------ data
def stdlib_tokens(n_seq: int, seq: int, seed: int = 0) -> torch.Tensor:
    """``[n_seq, seq+1]`` byte tokens from random offsets in the standard library's source (no shards needed)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes() + b"\n"
        if len(data) > 8 << 20:
            break
    flat = torch.frombuffer(bytes(data), dtype=torch.uint8).long()
    starts = torch.randint(0, flat.numel() - seq - 1, (n_seq,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([flat[s : s + seq + 1] for s in starts.tolist()])


# ------------------------------------------------------------------------------------------------ models
@contextlib.contextmanager
def local_spec() -> Iterator[None]:
    """build_model as on a machine without TE (the local spec), also on a GPU."""
    original = pm.te_available
    pm.te_available = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        pm.te_available = original  # type: ignore[assignment]


@contextlib.contextmanager
def fusion_fields(**fields: Any) -> Iterator[None]:
    """``TransformerConfig`` fusion fields overridden while models are built (e.g. moe_permute_fusion=False
    beside every other fusion on: ``model.fusions`` switches them together)."""
    original = pm._fusion_kwargs
    pm._fusion_kwargs = lambda model: {**original(model), **fields}  # type: ignore[assignment]
    try:
        yield
    finally:
        pm._fusion_kwargs = original  # type: ignore[assignment]


def build(cfg: ModelConfig, ctx: Ctx, *, spec: str = "auto", recompute: str = "none", seed: int = 0) -> Any:
    torch.manual_seed(seed)
    if spec == "local":  # the local spec has no TE kernels: no fused kernels, no grouped-GEMM experts either
        cfg = dataclasses.replace(cfg, fusions="off", moe_grouped_gemm="off")
    with local_spec() if spec == "local" else contextlib.nullcontext():
        return pm.build_model(cfg, PAR, recompute=recompute)  # type: ignore[arg-type]


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Copy local-spec weights into a (TE-spec) model of the same shape. TE fuses a layer's input norm
    into its QKV projection (``linear_qkv.layer_norm_weight``) and a dense layer's pre-MLP norm into fc1.
    Returns (destination weights with no source, source weights not used)."""
    src_state = {k: v for k, v in src.state_dict().items() if not k.endswith("_extra_state")}
    renames = (
        ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
        ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
    )
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


# ------------------------------------------------------------------------------------------------ training
def megatron_optimizer(net: Any, lr: float) -> tuple[Any, Any]:
    """megatron DDP (fp32 gradient buffer) + distributed Adam, as a training run builds them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = net.cfg.dtype == "bf16"
    ddp = DistributedDataParallel(
        config=net.config,
        module=net,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            clip_grad=1.0,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=True,
        ),
        [ddp],
    )
    return ddp, opt


def train(net: Any, data: torch.Tensor, *, steps: int, mbs: int, loops: int, ctx: Ctx, lr: float = 1e-3) -> list[float]:
    """``steps`` optimizer steps (one micro-batch each) at ℓ = ``loops``; the loss of each step.

    Each step first tells every Transformer Engine layer that a new step begins (``set_is_first_microbatch``,
    as megatron's schedules do): TE caches a layer's FP8 weight after the first call and requantizes it only
    then, so without it every step would run on the weights quantized at step 1."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()  # sized by the first model that logs: start afresh
    ddp, opt = megatron_optimizer(net, lr)
    net.train()
    losses = []
    for step in range(steps):
        batch = data[(step * mbs) % len(data) :][:mbs].to(ctx.device)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        net.set_is_first_microbatch()
        loss = net(batch[:, :-1], labels=batch[:, 1:], loops=loops)[loops].float().mean()
        loss.backward()
        finalize_model_grads([ddp])
        opt.step()
        clear_aux_losses_tracker()
        losses.append(float(loss))
    return losses


def timed(fn: Callable[[], Any], ctx: Ctx, repeats: int) -> float:
    """Median wall time of ``fn`` after two warm-up calls (synchronised on CUDA)."""
    for _ in range(2):
        fn()
    ctx.sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def fwd_bwd(model: Any, tokens: torch.Tensor, **kw: Any) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        out = model(tokens[:, :-1], labels=tokens[:, 1:], **kw)
        (out[max(out)] if isinstance(out, dict) else out).float().mean().backward()

    return run


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    scale = float(b.abs().max())
    return float((a.float() - b.float()).abs().max()) / scale if scale else float((a - b).abs().max())
