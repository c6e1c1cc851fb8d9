"""Strict device mode: every collective's tensors live on the device its backend serves.

On a CPU machine with gloo a collective handed a host tensor "works", so device mistakes stay hidden until
the first GPU job. This mode gives every tensor a *virtual* placement (host if made without ``device=``,
propagated as CUDA placement would be) and makes each collective on a would-be-NCCL group require device
tensors (gloo groups: CPU tensors), raising :class:`DeviceMistake` otherwise. On a GPU it checks the real
placement too. Enabled in ``train()`` by ``ELASTIC_PRETRAIN_STRICT_DEVICES=1``.
docs/gpu.md, "Device placement and collectives" (Strict device mode).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from elastic_pretrain.parallel.device import device

ENV = "ELASTIC_PRETRAIN_STRICT_DEVICES"
_HOST = "_elastic_pretrain_host"  # attribute set on host tensors: where they were born

_FACTORIES = frozenset(
    {
        "tensor",
        "as_tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "linspace",
        "rand",
        "randn",
        "randint",
        "randperm",
        "eye",
        "scalar_tensor",
    }
)
_LIKE = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"})
_KEEP_SELF = frozenset({"copy_", "__setitem__"})  # writes into ``self``: its placement does not change

# (parameter names that hold tensors) of the collectives we check
_TENSOR_ARGS = (
    "tensor",
    "tensor_list",
    "output",
    "input",
    "output_tensor",
    "input_tensor",
    "output_tensor_list",
    "input_tensor_list",
    "gather_list",
    "scatter_list",
    "scatter_list",
)
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
)
# megatron modules that bind a collective at import time (``dist_all_gather_func = ...``)
_BOUND = (
    ("megatron.core.tensor_parallel.mappings", ("dist_all_gather_func", "dist_reduce_scatter_func")),
    ("megatron.core.tensor_parallel.layers", ("dist_all_gather_func", "dist_reduce_scatter_func")),
    ("megatron.core.distributed.param_and_grad_buffer", ("dist_all_gather_func", "dist_reduce_scatter_func")),
)


class DeviceMistake(AssertionError):
    """A tensor on the wrong device reached a collective (see the module docstring)."""


def is_host(t: torch.Tensor) -> bool:
    return bool(getattr(t, _HOST, None))


def _mark(t: torch.Tensor, origin: str | None) -> None:
    try:
        if origin is None:
            if is_host(t):
                delattr(t, _HOST)
        else:
            setattr(t, _HOST, origin)
    except (AttributeError, RuntimeError):  # tensors without a __dict__ (rare C++-made views)
        pass


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def _to_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The device a ``Tensor.to`` call moves to (a tensor for ``to(other)``), or None (dtype only)."""
    if "device" in kwargs and kwargs["device"] is not None:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool):
            return a
    return None


class _HostTracker(TorchFunctionMode):
    """Gives every tensor made while active its virtual placement (module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _FACTORIES:
            origin = f"torch.{name}(...) without device=" if kwargs.get("device") is None else None
        elif name in _LIKE:
            origin = getattr(args[0], _HOST, None) if kwargs.get("device") is None else None
        elif name == "cpu":
            origin = ".cpu()"
        elif name == "cuda":
            origin = None
        elif name == "to":
            target = _to_target(args, kwargs)
            if target is None:
                origin = getattr(args[0], _HOST, None)
            else:
                origin = getattr(target, _HOST, None) if isinstance(target, torch.Tensor) else None
        elif name in _KEEP_SELF:
            return out
        else:
            inputs = _tensors((args, kwargs))
            host = [t for t in inputs if is_host(t)]
            taints = host and (len(host) == len(inputs) or any(t.dim() > 0 for t in host))
            origin = getattr(host[0], _HOST) if taints else None
            if origin is None:
                return out  # nothing to mark, and an in-place op on a host tensor keeps it host
        for t in _tensors(out):
            _mark(t, origin)
        return out


def _gloo_groups() -> list[Any]:
    """megatron's groups created with ``backend="gloo"`` on purpose (CPU collectives on any machine)."""
    from megatron.core import parallel_state

    found: list[Any] = []
    for name, value in vars(parallel_state).items():
        if "GLOO" in name and value is not None:
            found += value if isinstance(value, list) else [value]
    return found


_INTENDED_GLOO: list[Any] = []  # the project's own groups made with backend="gloo" (checkpoint I/O)


def intended_gloo(group: Any) -> Any:
    """Register ``group``, created with ``backend="gloo"`` on every machine, as one whose collectives take
    CPU tensors (like megatron's ``*_GLOO`` groups); returns it."""
    _INTENDED_GLOO.append(group)
    return group


def _check(what: str, group: Any, tensors: list[torch.Tensor], gloo: list[Any]) -> None:
    intended_cpu = group is not None and any(group is g for g in (*gloo, *_INTENDED_GLOO))
    want = device()
    for t in tensors:
        if intended_cpu:
            if t.device.type != "cpu":
                raise DeviceMistake(f"{what} on a gloo group got a tensor on {t.device}: gloo reduces CPU tensors")
            continue
        where = getattr(t, _HOST, None)
        if where is not None or t.device != want:
            born = f" (made by {where})" if where else ""
            raise DeviceMistake(
                f"{what} on a group that is NCCL on GPU machines got a host tensor{born} of shape "
                f"{tuple(t.shape)}, {t.dtype}: create it on parallel.device.device() (want {want}) or move it "
                "with parallel.device.to_device"
            )


def _checked(name: str, original: Callable[..., Any], gloo: list[Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        tensors = _tensors([bound.arguments.get(a) for a in _TENSOR_ARGS])
        _check(f"torch.distributed.{name}", bound.arguments.get("group"), tensors, gloo)
        return original(*args, **kwargs)

    return wrapper


def _checked_batch(original: Callable[..., Any], gloo: list[Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(p2p_op_list: list[Any]) -> Any:
        for op in p2p_op_list:
            _check("torch.distributed.batch_isend_irecv", op.group, [op.tensor], gloo)
        return original(p2p_op_list)

    return wrapper


def _marking_from_numpy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def from_numpy(array: Any) -> torch.Tensor:
        t = original(array)
        _mark(t, "torch.from_numpy(...)")
        return t

    return from_numpy


@contextlib.contextmanager
def strict_devices() -> Iterator[None]:
    """Check every collective's tensors while active (module docstring). Needs the mesh initialised."""
    import importlib

    gloo = _gloo_groups()
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, new: Any) -> None:
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    for name, fn in originals.items():
        patch(dist, name, _checked(name, fn, gloo))
    patch(dist, "batch_isend_irecv", _checked_batch(dist.batch_isend_irecv, gloo))
    for module_name, attrs in _BOUND:
        module = importlib.import_module(module_name)
        for attr in attrs:
            fn = getattr(module, attr)
            match = next((n for n, o in originals.items() if o is fn), None)
            if match is not None:
                patch(module, attr, getattr(dist, match))
    patch(torch, "from_numpy", _marking_from_numpy(torch.from_numpy))
    try:
        with _HostTracker():
            yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def enter_strict_devices() -> contextlib.ExitStack:
    """:func:`strict_devices` entered when ``ELASTIC_PRETRAIN_STRICT_DEVICES=1`` (else nothing); ``close()`` ends it."""
    stack = contextlib.ExitStack()
    if enabled():
        stack.enter_context(strict_devices())
    return stack
