"""Gradient reduction (and parameter all-gather) overlapped with backward under a changing loop count.

megatron-core's ``overlap_grad_reduce`` / ``overlap_param_gather`` assume every step's micro-batches touch
the same parameters equally often and reach modules in the same order; mixed depth breaks both.
:class:`DepthOverlapDDP` keeps megatron's buffers, buckets and collectives and replaces only *when* a bucket
starts: expected hooks counted from the step's own forwards, buckets started in one fixed order on every rank,
and a hook beyond the count raises rather than risk a partial reduction.
docs/elastic-depth.md, "Gradient-reduction overlap under varying ℓ"; docs/gpu.md, "Parameter all-gather overlapped".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from elastic_pretrain.model.recompute import current_scope

if TYPE_CHECKING:  # annotations only
    from megatron.core.optimizer import MegatronOptimizer

# bucket_size_for: buckets per rank to aim for, and the bounds (parameters) it is clamped to
BUCKETS_PER_RANK = 16
RING_CHUNK_FLOOR = 1 << 18  # parameters per rank's ring chunk: 1 MiB of fp32 gradient
MEGATRON_FLOOR, MEGATRON_PER_RANK = 40_000_000, 1_000_000  # megatron's default: max(40 M, 1 M x DP)


def bucket_size_for(params_per_rank: int, dp: int) -> int:
    """Parameters per DP bucket under overlap: ``clamp(params_per_rank / 16, 2^18 x dp, max(40 M, 1 M x dp))``.

    About 16 buckets per rank (both lanes together): the first reduction starts after ~1/16 of backward
    and only the last bucket's (≈ 1/16 of the traffic, unless one parameter is larger: the embedding) is
    exposed after it. Floor: a ring reduce-scatter sends each rank ``bucket / dp`` elements per step; at
    2^18 fp32 gradients (1 MiB) a message is bandwidth- rather than latency-bound. Ceiling: megatron's own
    default, never larger buckets than it validated at scale (at large DP the floor may exceed
    the ceiling's 40 M: the floor wins). docs/gpu.md has the figures of the GPU recipes."""
    if params_per_rank < 1 or dp < 1:
        raise ValueError(f"bucket_size_for: params_per_rank and dp must be >= 1, got {params_per_rank}, {dp}")
    hi = max(MEGATRON_FLOOR, MEGATRON_PER_RANK * dp)
    lo = min(RING_CHUNK_FLOOR * dp, hi)
    return min(max(-(-params_per_rank // BUCKETS_PER_RANK), lo), hi)


class GradLedger:
    """Expected and received gradient-ready hooks of one step, and which buckets have started."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp
        # one lane per process group: the dense buckets and the expert-parallel ones, each in megatron's order
        self.lanes: list[list[_ParamAndGradBucketGroup]] = [
            list(ddp.bucket_groups),
            list(ddp.expert_parallel_bucket_groups),
        ]
        self.where: dict[torch.nn.Parameter, tuple[int, int]] = {}
        for lane, groups in enumerate(self.lanes):
            for k, group in enumerate(groups):
                for p in group.params:
                    self.where[p] = (lane, k)
        self.names = {p: n for n, p in ddp.module.named_parameters()}
        self.in_step = False
        self.overlapped = 0
        self._reset(calls=0)
        self._hooks = [
            m.register_forward_pre_hook(self._make_use_hook(owned))
            for m in ddp.module.modules()
            if (owned := tuple(p for p in m.parameters(recurse=False) if p in self.where))
        ]

    def _reset(self, calls: int) -> None:
        self.calls_left = calls
        self.armed = False
        self.context = 0  # the forward_step call now running (0: none)
        self.seen: set[tuple[int, int, int]] = set()  # (outer context, checkpoint scope, id(param))
        self.expected: dict[torch.nn.Parameter, int] = dict.fromkeys(self.where, 0)
        self.fired: dict[torch.nn.Parameter, int] = dict.fromkeys(self.where, 0)
        self.open: list[list[int]] = [[0] * len(groups) for groups in self.lanes]  # params not final yet
        self.started = [0] * len(self.lanes)  # buckets started, per lane (a prefix of its order)

    def begin(self, calls: int) -> None:
        """A new step whose schedule will call ``forward_step`` ``calls`` times (micro-batches × chunks)."""
        self._reset(calls)
        self.in_step = True

    def watch(self, forward_step: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_step`` marking each call as a context of its own, arming after the last call."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.context += 1
            try:
                return forward_step(*args, **kwargs)
            finally:
                self.calls_left -= 1
                if self.in_step and self.calls_left == 0:
                    self.arm()

        return counted

    def _make_use_hook(self, owned: tuple[torch.nn.Parameter, ...]) -> Callable[..., None]:
        def used(module: torch.nn.Module, args: Any) -> None:
            if not self.in_step or self.armed or torch._C._current_graph_task_id() != -1:
                return  # outside a step, or a checkpoint's re-run inside backward (counted at its forward)
            scope = current_scope()
            if scope == 0 and not torch.is_grad_enabled():
                return  # a no-grad computation (routing probe, KV capture): builds no graph
            for p in owned:
                key = (self.context, scope, id(p))
                if key not in self.seen:
                    self.seen.add(key)
                    self.expected[p] += 1

        return used

    def arm(self) -> None:
        """Every context of the step is known: find the final parameters and start what may start."""
        self.armed = True
        for p, (lane, k) in self.where.items():
            self.open[lane][k] += int(self.fired[p] < self.expected[p])
        for lane in range(len(self.lanes)):
            self._start_ready(lane)

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """Called from the gradient-ready hook, after the gradient went into ``main_grad``."""
        if not self.in_step:
            return
        lane, k = self.where[param]
        self.fired[param] += 1
        # a forward always precedes its backward, so a correct count is never behind the hooks
        if self.fired[param] > self.expected[param]:
            raise RuntimeError(
                f"parallel.grad_reduce=overlap: {self.names.get(param, '?')} got {self.fired[param]} gradients, "
                f"more than the {self.expected[param]} uses counted in this step's forwards (its bucket's "
                "reduction may have started: parallel/overlap.py missed a use); run with "
                "parallel.grad_reduce=after_backward and report it"
            )
        if self.armed and self.fired[param] == self.expected[param]:
            self.open[lane][k] -= 1
            self._start_ready(lane)

    def _start_ready(self, lane: int) -> None:
        groups, open_ = self.lanes[lane], self.open[lane]
        while self.started[lane] < len(groups) and open_[self.started[lane]] == 0:
            groups[self.started[lane]].start_grad_sync(force_all_reduce=self.ddp.force_all_reduce)
            self.started[lane] += 1

    def finish(self, force_all_reduce: bool | None) -> None:
        """Start every bucket not started yet (same order on every rank), then wait for all of them."""
        self.overlapped = sum(self.started)  # started during backward (tests check that overlap happened)
        for lane, groups in enumerate(self.lanes):
            for group in groups[self.started[lane] :]:
                group.start_grad_sync(force_all_reduce=force_all_reduce)
            self.started[lane] = len(groups)
        for groups in self.lanes:
            for group in groups:
                if group.param_gather_handle is not None:  # a bucket no forward used: done before the
                    group.param_gather_handle.wait()  # optimizer writes its shard of that buffer
                    group.param_gather_handle = None
                group.param_gather_dispatched = False
                if group.grad_reduce_handle is not None:
                    group.grad_reduce_handle.wait()
                    group.grad_reduce_handle = None
        self.in_step = False


class DepthOverlapDDP(DistributedDataParallel):
    """megatron's DDP with ``overlap_grad_reduce`` whose buckets start from a :class:`GradLedger`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.ddp_config.overlap_grad_reduce or self.ddp_config.num_distributed_optimizer_instances != 1:
            raise ValueError("DepthOverlapDDP needs overlap_grad_reduce=True and one distributed-optimizer instance")
        self.ledger = GradLedger(self)
        self.gathers = bool(self.use_forward_hook)  # megatron's: distributed optimizer + overlap_param_gather
        for groups in self.ledger.lanes:  # built whole on every rank: nothing to gather before the first step
            for group in groups:
                group.param_gather_dispatched = self.gathers

    def start_param_gather(self) -> None:
        """Start every bucket's all-gather not started since the last reduction, in one fixed order on
        every rank: dense, then expert-parallel, each in forward order (the first layers' bucket first)."""
        for groups in self.ledger.lanes:
            for group in reversed(groups):
                if not group.param_gather_dispatched:
                    group.start_param_sync()

    def finish_param_gather(self) -> None:
        """Every parameter current on every rank (start what is pending, wait for all)."""
        self.start_param_gather()
        for groups in self.ledger.lanes:
            for group in groups:
                group.finish_param_sync(skip_next_bucket_dispatch=True)

    def _make_forward_pre_hook(self) -> Callable[..., None]:
        """Wait for the module's buckets (megatron's hook would also start the next bucket, in an order set
        by which modules this rank's forward reaches first)."""

        def hook(module: torch.nn.Module, *unused: Any) -> None:
            for p in module.parameters(recurse=False):
                group = self.param_to_bucket_group.get(p)
                if group is None:
                    continue
                if not group.param_gather_dispatched:  # not reached in training (started after each step)
                    self.start_param_gather()
                group.finish_param_sync(skip_next_bucket_dispatch=True)

        return hook

    def _make_backward_post_hook(self, param: torch.nn.Parameter) -> Callable[..., None]:
        """megatron's hook (gradient into ``main_grad``), reporting to the ledger instead of the bucket's
        golden counts."""

        p: Any = param  # megatron's attributes: main_grad, grad_added_to_main_grad

        def hook(*unused: Any) -> None:
            if p not in self.param_to_bucket_group:
                return
            assert p.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
            if not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False):
                p.main_grad.add_(p.grad.data)
            p.grad = None
            self.ledger.grad_ready(p)

        return hook

    def start_grad_sync(self, *unused: Any) -> None:
        raise RuntimeError("DepthOverlapDDP starts its buckets itself: leave config.grad_sync_func unset")

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        self.ledger.finish(force_all_reduce)


@contextlib.contextmanager
def overlapped_step(
    model: DistributedDataParallel, forward_step: Callable[..., Any], calls: int
) -> Iterator[Callable[..., Any]]:
    """The ``forward_step`` to hand the schedule: counted by ``model``'s ledger when it overlaps gradient
    reduction (``calls``: forward_step calls of the step, micro-batches × pipeline chunks), else as is."""
    if not isinstance(model, DepthOverlapDDP):
        yield forward_step
        return
    model.ledger.begin(calls)
    yield model.ledger.watch(forward_step)


def start_param_gather(model: DistributedDataParallel) -> None:
    """After the optimizer step: start the parameter all-gathers, to be awaited by the next forward
    (``parallel.param_gather: overlap``; a no-op otherwise — the optimizer step gathered them)."""
    if isinstance(model, DepthOverlapDDP) and model.gathers:
        model.start_param_gather()


def settle_param_gather(optimizer: MegatronOptimizer | None) -> None:
    """Before reading or writing parameters outside a forward: every gather of ``optimizer``'s models done."""
    for chunk in getattr(optimizer, "model_chunks", []):
        if isinstance(chunk, DepthOverlapDDP) and chunk.gathers:
            chunk.finish_param_gather()
