"""Parameters the current phase never runs stay out of the optimizer step: out of the gradient norm, and
unchanged by it.

ELR's loop-count conditioning heads are built with the model and switched on at the mixed-depth switch
("conditioning heads initialized to zero at the switch", ELR, seeds/003); a late switch from one loop leaves
passes 1.. of untied attention unrun until then. Their gradients are exactly zero in that phase, yet two parts
of megatron-core's optimizer step still reached them:

* **The gradient norm.** megatron sums the per-tensor norms in one vectorised reduction
  (``local_multi_tensor_l2_norm`` on CPU, apex/TE's ``multi_tensor_l2norm`` on GPU); three more zero entries
  regroup that sum, so the norm — and with ``train.clip_grad`` the clip factor of every parameter — differs from
  the no-heads twin's in its last bit. Measured on ``late-switch-depth-pays-long``'s 0.75 switch: the run with
  heads and its no-heads twin, identical before the switch in every value the model computes, parted at step 7
  and for good at step 32; with the zero entries left out of the norm they agree bitwise for 200 steps
  (docs/results/README.md: by step 4,500 such pairs trained at 0.52 vs 0.36 nat).
* **Weight decay.** AdamW's decoupled decay multiplies every parameter by (1 − lr·wd) per step, gradient or
  not: over a 75% fixed phase the heads' embeddings (and an ``init_unused_passes: as_initialised`` pass's
  attention) shrank to a few percent of their initialisation, so the switch met heads that were not the
  initialised ones the design says.

:class:`IdleParameters` leaves the model's :meth:`~LoopedMoEModel.idle_parameters` out of the norm (their
optimizer main copies' gradients, in every optimizer megatron builds: fp32, bf16 with fp32 main copies,
distributed) and writes their values back after the update. Adam's moments stay exactly zero (zero gradients),
and Adam's step count stays the run's (one number, as every checkpoint keeps it: docs/checkpoints.md), so the
heads' first update after the switch has the bias correction of a step the run has reached, not of step 1.
Runs without idle parameters (no heads, or heads on from the first step; no late switch) step exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only
    from megatron.core.optimizer import MegatronOptimizer

    from elastic_pretrain.model.looped import LoopedMoEModel

# megatron-core 0.16.1's names for (model parameters, their main copies) in parallel lists of groups:
# the distributed optimizer's fp32 shards (views) and bf16 shards' fp32 copies, Float16Optimizer's fp32 copies.
# An fp32 parameter of FP32Optimizer or Float16Optimizer is its own main copy (in the optimizer's groups).
_PAIRED_GROUPS = (
    ("model_fp32_groups", "shard_fp32_groups"),
    ("model_float16_groups", "shard_fp32_from_float16_groups"),
    ("float16_groups", "fp32_from_float16_groups"),
)


def main_copies(opt: MegatronOptimizer, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The tensors ``opt`` updates in place of ``params`` (those it holds on this rank)."""
    want = {id(p) for p in params}
    out: list[torch.Tensor] = []
    for model_name, main_name in _PAIRED_GROUPS:
        for model_group, main_group in zip(getattr(opt, model_name, []), getattr(opt, main_name, [])):
            out += [main for p, main in zip(model_group, main_group) if id(p) in want and main is not None]
    held = {id(p) for p in opt.get_parameters()}
    out += [p for p in params if id(p) in held]
    return out


def copy_to_main_params(optimizer: MegatronOptimizer, params: list[torch.nn.Parameter]) -> None:
    """After writing model ``params`` in place: the same values into the optimizer's fp32 main copies.

    fp32 models need nothing (megatron's main parameters are the model's, or views of them); bf16 models
    have fp32 main parameters, whole (``Float16OptimizerWithFloat16Params``) or this rank's shard of
    the parameter's range (distributed optimizer). Only ``params`` are touched: reloading every main
    parameter from bf16 would drop the fp32 bits of all the others.
    """
    for p in params:
        main = getattr(p, "main_param", None)
        if main is None or main is p:
            continue
        if not getattr(p, "main_param_sharded", False):
            main.data.copy_(p.data.view_as(main))
            continue
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            try:
                span = opt._get_model_param_range_map(p)["param"]
            except (AttributeError, KeyError):
                continue
            main.data.copy_(p.data.view(-1)[span.start : span.end])
            break


class IdleParameters:
    """Keeps ``net.idle_parameters(passes_run=...)`` out of ``optimizer``'s gradient norm (installed on each of
    its optimizers) and, around a step (:meth:`held`), out of the update. ``passes_run`` is the session's: the
    passes the current phase runs (None: all)."""

    def __init__(self, net: LoopedMoEModel, optimizer: MegatronOptimizer) -> None:
        self.net, self.optimizer = net, optimizer
        self.passes_run: int | None = None
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if getattr(opt, "is_stub_optimizer", False):
                continue
            opt.get_main_grads_for_grad_norm = self._without_idle(opt, opt.get_main_grads_for_grad_norm)

    def params(self) -> list[torch.nn.Parameter]:
        return self.net.idle_parameters(passes_run=self.passes_run)

    def _without_idle(self, opt: MegatronOptimizer, grads_for_norm: Callable[[], list[Any]]) -> Callable[[], list]:
        def filtered() -> list[Any]:
            grads = grads_for_norm()
            idle = main_copies(opt, self.params())
            if not idle:
                return grads
            skip = {id(g) for m in idle for g in (m.grad, getattr(m, "decoupled_grad", None)) if g is not None}
            return [g for g in grads if id(g) not in skip]

        return filtered

    @contextmanager
    def held(self) -> Iterator[None]:
        """Around one optimizer step: the idle parameters (and their main copies) as they were before it."""
        params = self.params()
        saved = [p.detach().clone() for p in params]
        yield
        if not params:
            return
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
        copy_to_main_params(self.optimizer, params)
