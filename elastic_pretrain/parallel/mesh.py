"""Process groups (TP, EP, PP, DP) through megatron-core, seeding, and explicit teardown.

The only module (with ``cpu_compat``) that touches ``megatron.core.parallel_state``; the model
receives a ``TransformerConfig`` and never asks for process groups itself.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from elastic_pretrain.config import ConfigError
from elastic_pretrain.parallel import cpu_compat
from elastic_pretrain.parallel.config import ParallelConfig  # re-exported (light: job validation imports it)
from elastic_pretrain.parallel.device import device

if TYPE_CHECKING:
    from elastic_pretrain.schedule import ExpertLayout

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Where this process sits. ``replica`` identifies the model replica (all TP/PP ranks share it)."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    @property
    def replica(self) -> int:
        return self.dp_rank

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init_mesh(cfg: ParallelConfig, *, seed: int) -> Mesh:
    """Initialise torch.distributed (from torchrun's env, or a 1-process group) and megatron's groups."""
    from megatron.core import parallel_state, tensor_parallel

    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("parallel.backend: nccl needs CUDA; use gloo (or auto) on CPU machines")
    if not dist.is_initialized():
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        if backend == "nccl":
            torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
        timeout = datetime.timedelta(minutes=cfg.timeout_minutes)
        if world == 1 and "MASTER_ADDR" not in os.environ:
            # One process outside torchrun: an in-process store, no TCP port (a "free" port picked
            # up front can be taken by another process before the store binds it).
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    world = dist.get_world_size()
    dp = cfg.data_parallel_size(world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor,
        pipeline_model_parallel_size=cfg.pipeline,
        expert_model_parallel_size=cfg.expert,
        # expert-TP would all_gather uneven sizes, which gloo rejects (notes/megatron-cpu.md)
        expert_tensor_parallel_size=1,
        create_gloo_process_groups=True,
        distributed_timeout_minutes=cfg.timeout_minutes,
    )
    applied = cpu_compat.apply_cpu_patches()
    if applied and dist.get_rank() == 0:
        # the list is for whoever debugs the CPU path (docs/cpu-patches.md), not the default output (issue 33)
        log.debug("CUDA absent: applied megatron-core CPU patches %s", ", ".join(applied))
    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return Mesh(
        rank=dist.get_rank(),
        world_size=world,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=cfg.tensor,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=cfg.expert,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=cfg.pipeline,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=dp,
        device=torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu"),
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def data_parallel_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)


def all_reduce_sum(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """In-place sum over ``group`` (default: data parallel) when it has more than one rank."""
    group = data_parallel_group() if group is None else group
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def all_reduce_max(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """In-place max over ``group`` (default: data parallel) when it has more than one rank."""
    group = data_parallel_group() if group is None else group
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def sequence_shard(full: torch.Tensor, local_len: int, dim: int) -> torch.Tensor:
    """This tensor-parallel rank's slice of ``full`` along the sequence ``dim`` when sequence parallelism
    split it (``local_len`` < full length: the shards are contiguous, in TP-rank order); else ``full``."""
    if full.shape[dim] == local_len:
        return full
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    return full.narrow(dim, rank * local_len, local_len)


def pipeline_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def expert_layout() -> ExpertLayout:
    """The replicas of this rank's expert-parallel group and each replica's depth-group key
    (:class:`~elastic_pretrain.schedule.ExpertLayout`), from one ``all_gather`` at start-up:
    after it every rank computes its group's loop counts locally (no collective per micro-batch)."""
    from megatron.core import parallel_state

    from elastic_pretrain.schedule import ExpertLayout

    replica = parallel_state.get_data_parallel_rank()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ExpertLayout.single(replica)
    ep_ranks = dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group())
    # [replica, EP group's global ranks...]: the same length everywhere (EP groups are equal in size);
    # a device tensor, as NCCL needs (parallel/device.py)
    mine = torch.tensor([replica, *ep_ranks], dtype=torch.int64, device=device())
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    gathered = [(int(row[0]), [int(k) for k in row[1:].tolist()]) for row in rows]
    replica_of = {rank: r for rank, (r, _) in enumerate(gathered)}
    parent = {r: r for r in replica_of.values()}  # union-find: replicas linked by sharing an EP group

    def root(r: int) -> int:
        while parent[r] != r:
            r = parent[r]
        return r

    for _, ranks in gathered:
        roots = sorted({root(replica_of[k]) for k in ranks})
        for other in roots[1:]:
            parent[other] = roots[0]
    key = {r: min(q for q in parent if root(q) == root(r)) for r in parent}
    return ExpertLayout(group=tuple(sorted({replica_of[k] for k in ep_ranks})), key=key)


def expert_group_max(value: int) -> int:
    """Max of ``value`` over this rank's expert-parallel group: the loop count every member of the
    group must join MoE all-to-alls for. Training computes it locally
    (``ScheduleController.step_plans``); this collective is the fallback for hand-built plans and the
    reference the tests compare the local computation with."""
    return expert_group_max_each([value])[0]


def expert_group_max_each(values: list[int]) -> list[int]:
    """:func:`expert_group_max` of several micro-batches in one all-reduce (the pipeline computes them
    all before its schedule starts, so no collective runs between the schedule's p2p calls)."""
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device())  # NCCL reduces device tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def any_rank(flag: bool) -> bool:
    """True on every rank if any rank passed True (used for stop/save decisions at step boundaries)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def every_rank(value: int) -> list[int]:
    """Each rank's ``value``, indexed by rank, on every rank (one all-reduce of world-size ints)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return [value]
    t = torch.zeros(world, dtype=torch.int64, device=device())  # NCCL reduces device tensors only
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def teardown(*, barrier: bool = True) -> None:
    """Barrier, destroy megatron's groups, destroy the default group.

    With torch 2.13 + gloo a finished process otherwise aborts now and then ("terminate called
    without an active exception"); the explicit order below removed it (notes/megatron-cpu.md).
    ``barrier=False`` on the way out of an error: the other ranks may never reach a barrier (one rank's
    bad input), and waiting for them would hang this rank until gloo's timeout.
    """
    from megatron.core import parallel_state

    if dist.is_initialized():
        if barrier:
            dist.barrier()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def describe(mesh: Mesh) -> dict[str, Any]:
    return {
        "world_size": mesh.world_size,
        "tp": mesh.tp_size,
        "ep": mesh.ep_size,
        "pp": mesh.pp_size,
        "dp": mesh.dp_size,
        "device": str(mesh.device),
    }
