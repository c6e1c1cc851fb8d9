"""Named, minimal patches that let megatron-core 0.16.1 run on CPU with gloo.

megatron-core assumes CUDA in a handful of places. On a machine without CUDA we apply exactly these
ten patches (each was shown necessary by removing it; ``shared/notes/megatron-cpu.md``), and only
there: :func:`apply_cpu_patches` is a no-op when ``torch.cuda.is_available()``. An eleventh,
``eager_jit_fuser``, is for speed, not correctness: it keeps torch.compile's import out of every CPU process.

Every patch names the megatron-core code it works around as a :class:`Probe` (module, attribute,
source fragment). ``tests/parallel/test_cpu_compat.py`` checks every probe, so a megatron-core
upgrade that changes the patched code fails a test instead of silently mis-patching.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

MEGATRON_CORE_VERSION = "0.16.1"


@dataclasses.dataclass(frozen=True)
class Probe:
    """``fragment`` must appear in the source of ``module.attr`` (or the whole module if attr is None)."""

    module: str
    attr: str | None
    fragment: str

    def holds(self) -> bool:
        mod = importlib.import_module(self.module)
        obj: Any = mod
        for part in (self.attr or "").split(".") if self.attr else []:
            obj = getattr(obj, part)
        return self.fragment in inspect.getsource(obj)


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    why: str
    probes: tuple[Probe, ...]
    apply: Callable[[], None]


APPLIED: list[str] = []


# 1 ------------------------------------------------------------------------------------------------
def _rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Keeps torch CPU generator states where megatron keeps CUDA ones (same fork semantics)."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            gen = torch.Generator()
            gen.manual_seed(seed)
            self.states_[name] = gen.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


# 2 ------------------------------------------------------------------------------------------------
def _cuda_device_noops() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


# 3 ------------------------------------------------------------------------------------------------
def _moe_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


# 4 ------------------------------------------------------------------------------------------------
class _NoopEvent:
    def __init__(self, *a: Any, **k: Any) -> None: ...
    def record(self, *a: Any, **k: Any) -> None: ...
    def synchronize(self) -> None: ...
    def wait(self, *a: Any, **k: Any) -> None: ...
    def query(self) -> bool:
        return True


class _NoopStream:
    def __init__(self, *a: Any, **k: Any) -> None: ...
    def wait_stream(self, *a: Any, **k: Any) -> None: ...
    def wait_event(self, *a: Any, **k: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def record_event(self, event: _NoopEvent | None = None) -> _NoopEvent:
        return event or _NoopEvent()


_STREAM = _NoopStream()


def _cuda_streams() -> None:
    torch.cuda.Stream = _NoopStream  # type: ignore[misc,assignment]
    torch.cuda.Event = _NoopEvent  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda *a, **k: _STREAM  # type: ignore[assignment,return-value]
    torch.cuda.default_stream = lambda *a, **k: _STREAM  # type: ignore[assignment,return-value]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment,return-value]


# 5 ------------------------------------------------------------------------------------------------
def _moe_alltoall_splits() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu  # type: ignore[attr-defined]


# 6 ------------------------------------------------------------------------------------------------
class SequenceParallelTorchNorm:
    """torch LayerNorm/RMSNorm allowed under sequence parallelism.

    Parameters are tagged ``sequence_parallel`` so megatron's ``finalize_model_grads`` all-reduces
    their gradients over TP, as it does for TE's and Apex's norms.
    """

    def __new__(  # type: ignore[misc]
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        module = norm_cls(hidden_size, eps=eps)
        for p in module.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return module


def _sp_torch_norm() -> None:
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    backends.LNImpl = SequenceParallelTorchNorm  # type: ignore[misc,assignment]
    backends.WrappedTorchNorm = SequenceParallelTorchNorm  # type: ignore[misc,assignment]
    transformer_block.LayerNormImpl = SequenceParallelTorchNorm  # type: ignore[misc,assignment,attr-defined]
    gpt_layer_specs.LNImpl = SequenceParallelTorchNorm  # type: ignore[misc,assignment]
    gpt_layer_specs.WrappedTorchNorm = SequenceParallelTorchNorm  # type: ignore[misc,assignment,attr-defined]


# 7 ------------------------------------------------------------------------------------------------
_FACTORIES = frozenset(
    {
        "zeros",
        "ones",
        "empty",
        "full",
        "tensor",
        "as_tensor",
        "arange",
        "rand",
        "randn",
        "randint",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
    }
)


def _on_cpu(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device == "cpu"):
        return "cpu"
    return "cpu" if torch.device(device).type == "cuda" else device


class _CpuTorch:
    """Stands in for ``torch`` inside the megatron modules listed in ``SHIMMED_MODULES``: everything
    delegates to torch, except that tensor factories asked for a CUDA device allocate on CPU."""

    def __getattr__(self, name: str) -> Any:
        obj = getattr(torch, name)
        if name not in _FACTORIES:
            return obj

        def factory(*args: Any, device: Any = None, pin_memory: bool = False, **kwargs: Any) -> Any:
            return obj(*args, device=_on_cpu(device), **kwargs)

        return factory


SHIMMED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.data",
)


def _cuda_device_shim() -> None:
    shim = _CpuTorch()
    for name in SHIMMED_MODULES:
        importlib.import_module(name).torch = shim  # type: ignore[attr-defined]
    # exchange_utils / tensor_parallel.data call Tensor.cuda(): a move to this machine's device, i.e. the same
    # tensor (`.to("cpu")` of a CPU tensor returns it). Through `.to` rather than a bare identity so that torch
    # function modes see the move (strict device mode, parallel/strict.py, counts the result as on the device).
    torch.Tensor.cuda = lambda self, *a, **k: self.to("cpu")  # type: ignore[method-assign]


# 8 ------------------------------------------------------------------------------------------------
def _tensor_type_string() -> None:
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu":
            caller = sys._getframe(1).f_globals.get("__name__", "")
            text = original(self)
            return "torch.cuda." + text[len("torch.") :] if caller.startswith("megatron.") else text
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign,assignment]


# 9 ------------------------------------------------------------------------------------------------
def _checkpoint_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # No CUDA generator to save or restore: the CPU generator and the (CPU) tracker states still are.
    mrandom._get_cuda_rng_state = _no_op_for(mrandom._get_cuda_rng_state)
    mrandom._set_cuda_rng_state = _no_op_for(mrandom._set_cuda_rng_state)


def _no_op_for(original: Any) -> Any:
    """A stand-in returning None that still reports ``original``'s signature (``inspect.signature`` follows
    ``__wrapped__``): the private-name check (tests/test_private_names.py) sees megatron's, patched or not."""
    if getattr(original, "__wrapped__", None) is not None:  # applied twice
        return original

    def no_op(*a: Any, **k: Any) -> None:
        return None

    no_op.__wrapped__ = original  # type: ignore[attr-defined]
    return no_op


def _sharded_tensor_init_data() -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    original = ShardedTensor.init_data

    def init_data(self: Any, device: Any, init_fn: Any = torch.empty) -> None:
        original(self, _on_cpu(device), init_fn)

    ShardedTensor.init_data = init_data  # type: ignore[method-assign]


# 11 -----------------------------------------------------------------------------------------------
def _eager_jit_fuser() -> None:
    from megatron.core import jit

    jit.disable_jit_fuser()


def after_megatron_jit(module: Any) -> None:
    """``megatron.core.jit`` has just run and nothing has imported its ``jit_fuser`` yet (the import hook in
    ``elastic_pretrain/_import_hooks.py`` calls this): on CPU, make it the no-op decorator before megatron's
    modules decorate their fused functions with it."""
    if needs_cpu_patches():
        module.disable_jit_fuser()
        AT_IMPORT.append("eager_jit_fuser")


AT_IMPORT: list[str] = []  # patches the import hook applied in this process

PATCHES: tuple[Patch, ...] = (
    Patch(
        "rng_tracker",
        "CudaRNGStatesTracker.add() calls torch.cuda.get_rng_state(): 'Torch not compiled with CUDA'.",
        (Probe("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add", "torch.cuda.get_rng_state()"),),
        _rng_tracker,
    ),
    Patch(
        "cuda_device_noops",
        "torch.cuda.current_device()/synchronize() are called unconditionally (RoPE, TP mappings, "
        "router, grad buffers, checkpoint save); make the device 'cpu' and synchronize a no-op.",
        (
            Probe("megatron.core.distributed.param_and_grad_buffer", None, "device=torch.cuda.current_device()"),
            Probe("megatron.core.rerun_state_machine", None, "torch.cuda.current_device()"),
        ),
        _cuda_device_noops,
    ),
    Patch(
        "moe_te_general_gemm",
        "moe_utils defines te_general_gemm only when Transformer Engine imports; the router forward "
        "then raises NameError (0.16.1 bug).",
        (Probe("megatron.core.transformer.moe.moe_utils", None, "if te_general_gemm is not None"),),
        _moe_te_general_gemm,
    ),
    Patch(
        "cuda_streams",
        "MoEAlltoAllTokenDispatcher creates torch.cuda.Stream() and uses current_stream()/stream(); "
        "on CPU everything is synchronous, so no-op streams and events are exact.",
        (Probe("megatron.core.transformer.moe.token_dispatcher", None, "torch.cuda.Stream()"),),
        _cuda_streams,
    ),
    Patch(
        "moe_alltoall_splits",
        "maybe_move_tensor_to_cpu(as_numpy=True) returns CPU tensors unchanged, and gloo's "
        "all_to_all_single rejects tensor split sizes; convert CPU tensors to numpy too.",
        (Probe("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", "tensor.is_cuda"),),
        _moe_alltoall_splits,
    ),
    Patch(
        "sp_torch_norm",
        "WrappedTorchNorm asserts not sequence_parallel, but MoE with TP>1 requires sequence "
        "parallelism; without TE/Apex use a torch norm tagged for SP gradient reduction.",
        (Probe("megatron.core.transformer.torch_norm", "WrappedTorchNorm", "assert not config.sequence_parallel"),),
        _sp_torch_norm,
    ),
    Patch(
        "cuda_device_shim",
        "Hard-coded device='cuda' tensors in schedules (even PP=1), optimizers, DDP buffers, masks.",
        (
            Probe("megatron.core.pipeline_parallel.schedules", None, 'device="cuda"'),
            Probe("megatron.core.optimizer.optimizer", None, "device='cuda'"),
            Probe("megatron.core.optimizer.clip_grads", None, "device='cuda'"),
            Probe("megatron.core.distributed.param_and_grad_buffer", None, 'device="cuda"'),
            Probe("megatron.core.transformer.utils", None, 'device="cuda"'),
        ),
        _cuda_device_shim,
    ),
    Patch(
        "tensor_type_string",
        "Optimizers and grad clipping classify params by param.type() == 'torch.cuda.FloatTensor'; "
        "report CUDA type strings for CPU tensors, only to callers inside megatron.",
        (
            Probe("megatron.core.optimizer.clip_grads", None, "'torch.cuda.FloatTensor'"),
            Probe("megatron.core.optimizer.optimizer", None, "torch.cuda.FloatTensor"),
            Probe("megatron.core.optimizer.distrib_optimizer", None, "torch.cuda.FloatTensor"),
        ),
        _tensor_type_string,
    ),
    Patch(
        "checkpoint_rng",
        "tensor_parallel.checkpoint (selective recompute of core attention) saves and restores the CUDA RNG "
        "state unconditionally; without CUDA there is none to keep.",
        (
            Probe("megatron.core.tensor_parallel.random", "_get_all_rng_states", "_get_cuda_rng_state("),
            Probe("megatron.core.tensor_parallel.random", "_set_all_rng_states", "_set_cuda_rng_state("),
        ),
        _checkpoint_rng,
    ),
    Patch(
        "sharded_tensor_init_data",
        "The fully parallel checkpoint load allocates the exchange buffer of a shard this rank does not "
        "need with ShardedTensor.init_data('cuda') (checkpoint/parallel_io.py); allocate it on CPU.",
        (
            Probe(
                "megatron.core.dist_checkpointing.exchange_utils",
                "_get_empty_tensor_for_exchange",
                'sh_ten.init_data("cuda")',
            ),
        ),
        _sharded_tensor_init_data,
    ),
    Patch(
        "eager_jit_fuser",
        "megatron.core.jit sets jit_fuser = torch.compile at import, and decorating megatron's ~20 fused "
        "functions with it imports torch._dynamo and torch._inductor: 2.6 s of CPU in every process, a third of "
        "a training rank's import. On CPU the fusions are off (parallel/megatron.py), so none of those functions "
        "runs; the no-op decorator keeps them plain. Applied by the import hook (elastic_pretrain/_import_hooks.py) "
        "as megatron.core.jit is imported, before anything decorates with it; apply_cpu_patches only covers "
        "functions decorated later, if megatron was imported before elastic_pretrain.",
        (
            Probe("megatron.core.jit", "enable_jit_fuser", "jit_fuser = torch.compile"),
            Probe("megatron.core.jit", "disable_jit_fuser", "jit_fuser = noop_decorator"),
        ),
        _eager_jit_fuser,
    ),
)


def needs_cpu_patches() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_patches() -> list[str]:
    """Apply every patch once, only when CUDA is absent. Returns the names applied (for the log)."""
    if not needs_cpu_patches():
        return []
    import megatron.core

    if megatron.core.__version__ != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"CPU patches target megatron-core {MEGATRON_CORE_VERSION}, found {megatron.core.__version__}: "
            "install the pinned version (bash scripts/setup.sh)"
        )
    for patch in PATCHES:
        if patch.name not in APPLIED:
            patch.apply()
            APPLIED.append(patch.name)
    return list(APPLIED)


def reset_rng_tracker() -> None:
    """Re-create the CPU RNG tracker (``model_parallel_cuda_manual_seed`` adds to it once per process)."""
    if "rng_tracker" in APPLIED:
        _rng_tracker()
