"""Per-pass activation recompute (``train.recompute: pass``): keep a pass's inputs, re-run it in backward.

A reentrant checkpoint like megatron's ``tensor_parallel.checkpoint`` (which this follows): the forward
runs without grad and saves only its tensor inputs; backward restores the RNG states of the forward
(CPU, CUDA when present, and megatron's model-parallel RNG tracker, so dropout draws the same masks),
re-runs the whole function with grad and back-propagates through it. Unlike megatron's it works on CPU
(megatron's reads the CUDA RNG unconditionally), and unlike torch's non-reentrant checkpoint it never
stops the re-run early: every MoE all-to-all of the pass is issued again, on every rank of the
expert-parallel group, ghosts included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core import tensor_parallel
from torch import Tensor


def _rng_states() -> tuple[Tensor, Tensor | None, dict[str, Any]]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, tensor_parallel.get_cuda_rng_tracker().get_states()


def _set_rng_states(states: tuple[Tensor, Tensor | None, dict[str, Any]]) -> None:
    cpu, cuda, tracker = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    tracker_states = tensor_parallel.get_cuda_rng_tracker()
    tracker_states.set_states(tracker)


class PassCheckpoint(torch.autograd.Function):
    """``PassCheckpoint.apply(run, *tensors)``: ``run(*tensors)`` saving only ``tensors`` for backward."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Tensor], *args: Tensor) -> Tensor:
        ctx.run = run
        ctx.rng = _rng_states()
        with torch.no_grad():
            out = run(*args)
        ctx.save_for_backward(*args)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        now = _rng_states()
        _set_rng_states(ctx.rng)
        try:
            with torch.enable_grad():
                out = ctx.run(*inputs)
        finally:
            _set_rng_states(now)
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        return (None, *(t.grad if t.requires_grad else None for t in inputs))


def checkpoint_pass(run: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
    return PassCheckpoint.apply(run, *tensors)


_scope: list[int] = [0, 0]  # [the scope now open (0: none), the last scope number handed out]


@contextlib.contextmanager
def checkpoint_scope() -> Iterator[None]:
    """Marks the forward of one checkpointed (reentrant) pass: its backward re-runs it in a backward call
    of its own, so each parameter it uses gets one more gradient-ready hook than the outer graph gives.
    ``parallel/overlap.py`` counts the uses inside a scope per scope (:func:`current_scope`)."""
    outer = _scope[0]
    _scope[1] += 1
    _scope[0] = _scope[1]
    try:
        yield
    finally:
        _scope[0] = outer


def current_scope() -> int:
    """The checkpoint scope whose forward is running (0: none)."""
    return _scope[0]
