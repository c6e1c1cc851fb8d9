"""The numerics of one optimizer step: megatron-core schedule, optimizer, LR (validation: ``eval/loss.py``).

Losses are per-token means over the micro-batches of one step; every supervised exit of a
micro-batch (the full-depth anchor, and the truncated depth under telescopic training) adds its own
per-token mean. Per-loop-count sums and counts are returned separately for logging.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

from elastic_pretrain.model.routing import RoutingProbe
from elastic_pretrain.parallel.device import device, to_device
from elastic_pretrain.parallel.mesh import (
    all_reduce_max,
    all_reduce_sum,
    data_parallel_group,
    pipeline_group,
)
from elastic_pretrain.parallel.overlap import overlapped_step, start_param_gather
from elastic_pretrain.parallel.pipeline import MicroBatch, Pipeline, _loss_func, group_loops, run_pipeline
from elastic_pretrain.tracking import names
from elastic_pretrain.train.faults import guarded_step
from elastic_pretrain.train.idle import IdleParameters
from elastic_pretrain.train.mfu import DepthCounts, ghost_time_share
from elastic_pretrain.train.step_timing import StepSpan, open_span

if TYPE_CHECKING:  # annotations only
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from elastic_pretrain.model.looped import LoopedMoEModel


@dataclasses.dataclass
class StepResult:
    loss: float  # objective (per-token mean, summed over supervised exits), mean over DP
    loss_by_loops: dict[int, float]  # per-token CE at each supervised exit, over DP
    grad_norm: float
    lr: float
    skipped: bool
    aux: dict[str, float]
    routing: dict[tuple[int, int], dict[str, float]] = dataclasses.field(default_factory=dict)
    depth: DepthCounts | None = None  # passes, exits, ghost passes per micro-batch over all replicas (MFU)
    span: StepSpan | None = None  # CUDA: the step's event pair, read by the straggler report (train/step_timing.py)


def _forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module) -> tuple[Any, Any]:
    mb = next(data_iterator)
    inputs, labels = mb.tokens_BT1[:, :-1].contiguous(), mb.tokens_BT1[:, 1:].contiguous()
    sync_loops = group_loops([mb])[0]  # EP-safe mixed depth (see LoopedMoEModel.run_loops)
    losses = model(
        inputs, labels=labels, loops=mb.plan.loops, exits=mb.plan.exits, sync_loops=sync_loops, exit_axis=mb.plan.axis
    )
    return losses, partial(_loss_func, mb.plan)


def _reduce_by_loops(reports: list[dict], max_loops: int) -> tuple[float, dict[int, float]]:
    """Sum per-exit CE over micro-batches and DP ranks → per-token means (from the last pipeline stage).

    The sums stay on the device until one host transfer per step (issue 31 item 2: a host sync per
    exit and micro-batch stalled the launch queue on CUDA). Float64 throughout, as before."""
    dev = device()
    sums = torch.zeros(max_loops, dtype=torch.float64, device=dev)
    counts = [0.0] * max_loops
    objective = torch.zeros((), dtype=torch.float64, device=dev)
    for rep in reports:
        for e, (s, n) in rep["by_exit"].items():
            s64 = torch.as_tensor(s, dtype=torch.float64, device=dev)
            sums[e - 1] += s64
            counts[e - 1] += float(n)
            objective = objective + s64 / n
    # the same key space on every DP rank: one all-reduce. The objective's mean over every micro-batch of
    # the step (all replicas): replicas may run different numbers of them (schedule.balance: compute), so
    # sum and count, not a mean of per-replica means
    packed = torch.cat(
        [objective.view(1), sums, torch.tensor([len(reports), *counts], dtype=torch.float64, device=dev)]
    )
    all_reduce_sum(packed)
    all_reduce_sum(packed, pipeline_group())  # only the last stage has reports; the others add zeros
    total, sum_L, micro, count_L = _unpack(packed.tolist(), max_loops)
    by_loops = {k + 1: sum_L[k] / count_L[k] for k in range(max_loops) if count_L[k] > 0}
    return total / max(micro, 1.0), by_loops


def _unpack(values: list[float], n: int) -> tuple[float, list[float], float, list[float]]:
    return values[0], values[1 : 1 + n], values[1 + n], values[2 + n :]


def _moe_aux(num_micro: int) -> dict[str, float]:
    tracker = get_moe_layer_wise_logging_tracker()
    names_, stats = [], []
    for name, entry in sorted(tracker.items()):
        # indexed by global layer number: pipeline stages fill disjoint entries
        values = all_reduce_sum(entry["values"].clone(), pipeline_group())
        names_.append(name)
        stats.append(torch.stack([values.sum().double(), (values != 0).sum().double()]))
    clear_aux_losses_tracker()
    if not stats:
        return {}
    host = torch.stack(stats).tolist()  # one host transfer for every entry
    return {f"moe/{name}": total / (int(layers) or 1) / num_micro for name, (total, layers) in zip(names_, host)}


def reduce_routing(probe: RoutingProbe | None) -> dict[tuple[int, int], dict[str, float]]:
    """Routing statistics summed over DP ranks (each rank saw its own tokens), as means."""
    if probe is None:
        return {}
    packed = to_device(torch.cat([probe.sums_KLS.flatten(), probe.counts_KL.flatten()]))
    all_reduce_sum(packed)
    all_reduce_sum(packed, pipeline_group())  # each pipeline stage filled the rows of its own core layers
    n = probe.sums_KLS.numel()
    probe.sums_KLS = packed[:n].view_as(probe.sums_KLS)
    probe.counts_KL = packed[n:].view_as(probe.counts_KL)
    return probe.means()


class TrainStep:
    """Owns the numerics: forward/backward over micro-batches, optimizer step, LR schedule."""

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        *,
        seq_len: int,
        micro_batch_size: int,
        max_loops: int,
        pipeline: Pipeline | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.pipeline = model, optimizer, scheduler, pipeline
        self.max_loops = max_loops
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.forward_backward = get_forward_backward_func()
        self.forward_step: Any = _forward_step  # a decider job swaps in its own (train/decider.py)
        self.veto: Callable[..., bool] | None = None  # FaultMonitor.veto(found_inf, grad_norm, loss=...)
        # parameters the phase never runs (heads while off, unrun passes): out of the norm and the update
        self.idle = IdleParameters(model.module, optimizer)

    def __call__(self, micro_batches: list[MicroBatch], *, probe_routing: bool = False) -> StepResult:
        return measured_step(
            self.model.module, self._step, micro_batches, probe_routing=probe_routing, seq_len=self.seq_len
        )

    def _step(self, micro_batches: list[MicroBatch]) -> StepResult:
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.pipeline is None:
            with overlapped_step(self.model, self.forward_step, len(micro_batches)) as forward_step:
                reports = self.forward_backward(
                    forward_step_func=forward_step,
                    data_iterator=iter(micro_batches),
                    model=[self.model],
                    num_microbatches=len(micro_batches),
                    seq_length=self.seq_len,
                    micro_batch_size=self.micro_batch_size,
                    forward_only=False,
                )
        else:
            reports = run_pipeline(self.pipeline, micro_batches, seq_len=self.seq_len, training=True)
        loss, by_loops, extra = self.reduce(reports)
        with self.idle.held():
            if self.veto is None:
                ok, grad_norm, _ = self.optimizer.step()
            else:  # the fault policy sees the loss and gradient norm before the update (train/faults.py)
                ok, grad_norm = guarded_step(self.optimizer, partial(self.veto, loss=loss))
        if ok:  # a dropped update leaves the LR schedule where it was, as megatron's own skipped steps do
            self.scheduler.step(increment=1)
        start_param_gather(self.model)  # parallel.param_gather=overlap: awaited by the next forward's pre-hooks
        return StepResult(
            loss=loss,
            loss_by_loops=by_loops,
            grad_norm=float(grad_norm or 0.0),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            skipped=not ok,
            aux={**_moe_aux(len(micro_batches)), **extra},
        )

    def reduce(self, reports: list[dict]) -> tuple[float, dict[int, float], dict[str, float]]:
        """(objective, per-token CE per exit, extra metrics) over micro-batches and DP ranks."""
        return *_reduce_by_loops(reports, self.max_loops), {}


def measured_step(
    net: LoopedMoEModel,
    step: Callable[[list[MicroBatch]], StepResult],
    micro_batches: list[MicroBatch],
    *,
    probe_routing: bool,
    seq_len: int,
) -> StepResult:
    """One optimizer step through ``step`` (either engine's numerics) with what every engine reports
    around it: micro-batches on the device, the routing probe, depth counts, depth efficiency and balance,
    and the estimated time idled in ghost passes (docs/elastic-depth.md, "Depth efficiency")."""
    t0, span = time.perf_counter(), open_span()
    # the data loader's batches are host tensors: pinned, copied without blocking (parallel/device.py)
    micro_batches = [dataclasses.replace(mb, tokens_BT1=to_device(mb.tokens_BT1)) for mb in micro_batches]
    if probe_routing:
        net.start_routing_probe()
    try:
        result = step(micro_batches)
    finally:
        probe = net.stop_routing_probe()
    result.routing = reduce_routing(probe) if probe_routing else {}
    result.depth = depth_counts(micro_batches)
    share = ghost_time_share(net.cfg, result.depth, seq_len=seq_len)
    result.aux.update(
        {
            names.DEPTH_EFFICIENCY: result.depth.efficiency,
            names.DEPTH_BALANCE: result.depth.balance,
            names.GHOST_TIME_S: share * (time.perf_counter() - t0),
        }
    )
    if span is not None:
        span.close()
    result.span = span
    return result


def depth_counts(micro_batches: list[MicroBatch]) -> DepthCounts:
    """Passes, supervised exits and ghost passes per micro-batch, means over every data-parallel replica
    (the TP ranks and pipeline stages of a replica run the same plans; replicas draw their own ℓ)."""
    loops = [mb.plan.loops for mb in micro_batches]
    sync = group_loops(micro_batches)  # the passes each micro-batch's MoE calls ran for (ghosts beyond ℓ)
    local = [
        sum(loops),
        sum(len(mb.plan.exits) for mb in micro_batches),
        sum(s - n for s, n in zip(sync, loops)),
        len(micro_batches),
    ]
    summed = all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=device()))
    slowest_1 = all_reduce_max(torch.tensor([float(sum(sync))], dtype=torch.float64, device=device()))
    *packed, slowest = torch.cat([summed, slowest_1]).tolist()  # one host transfer
    replicas = dist.get_world_size(data_parallel_group()) if dist.is_initialized() else 1
    balance = (packed[0] + packed[2]) / replicas / slowest if slowest else 1.0
    return DepthCounts(
        loops=packed[0] / packed[3], exits=packed[1] / packed[3], ghost_passes=packed[2] / packed[3], balance=balance
    )
