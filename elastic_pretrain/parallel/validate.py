"""Will this job's layout work at this world size? Every divisibility rule megatron-core and the looped
model impose, checked from the config alone (no torch, no GPU).

``elastic-pretrain config JOB --world-size N`` and ``submit`` (nodes × processes per node) run it, so a
128-GPU job's layout mistakes show up on a laptop as one line naming the fix, not minutes into a cluster
allocation. The rules and where each comes from: docs/configuration.md, "Checking a layout for a cluster".
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from elastic_pretrain.config import ConfigError
from elastic_pretrain.model.vocab import VOCAB_DIVISIBLE_BY, padded_vocab_size
from elastic_pretrain.parallel.config import check_micro_batches

if TYPE_CHECKING:
    from elastic_pretrain.job import JobConfig


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a job maps onto ``world_size`` ranks."""

    world_size: int
    tensor: int
    pipeline: int
    expert: int
    data: int
    micro_batches: int  # per optimizer step and data-parallel rank
    sequence_parallel: bool
    padded_vocab: int

    @property
    def expert_data(self) -> int:
        """Replicas of each expert shard (expert-data-parallel size)."""
        return self.tensor * self.data // self.expert

    def describe(self) -> str:
        sp = "on" if self.sequence_parallel else "off"
        return (
            f"world {self.world_size} = TP {self.tensor} x PP {self.pipeline} x DP {self.data}; EP {self.expert} "
            f"(expert-DP {self.expert_data}); {self.micro_batches} micro-batch(es) per step and replica; "
            f"sequence parallel {sp}; padded vocabulary {self.padded_vocab}"
        )


def check_layout(job: JobConfig, world_size: int) -> Layout:
    """The job's :class:`Layout` at ``world_size`` ranks; the first broken rule raises :class:`ConfigError`."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    par, model = job.parallel, job.model
    if job.data.tokenizer.kind == "byte":  # a tokenizer file (hf, tiktoken) is checked when training starts
        from elastic_pretrain.data.tokenizer import ByteTokenizer

        job.check_vocab(ByteTokenizer.vocab_size)
    tp, pp, ep = par.tensor, par.pipeline, par.expert
    dp = par.data_parallel_size(world_size)  # world % (TP*PP), EP | TP*DP
    _check_tensor(job, tp)
    sp = _check_sequence_parallel(job, tp)
    if model.experts_built % ep:
        raise ConfigError(
            f"parallel.expert={ep} does not divide the experts built ({model.experts_built} = model.num_experts "
            f"{model.num_experts} x model.flatten {model.flatten}): pick an expert size that divides "
            f"{model.experts_built}"
        )
    model.check_pipeline(pp)
    micro = job.train.micro_batches(dp)  # global batch % (micro batch * DP)
    check_micro_batches(micro, pp)
    return Layout(
        world_size=world_size,
        tensor=tp,
        pipeline=pp,
        expert=ep,
        data=dp,
        micro_batches=micro,
        sequence_parallel=sp,
        padded_vocab=padded_vocab_size(model.vocab_size, tp),
    )


def _check_tensor(job: JobConfig, tp: int) -> None:
    model = job.model
    if tp == 1:
        return
    if VOCAB_DIVISIBLE_BY % tp:
        raise ConfigError(
            f"parallel.tensor={tp} does not divide the vocabulary padding multiple {VOCAB_DIVISIBLE_BY}: "
            "use a power of two up to 128"
        )
    for value, what in (
        (model.num_heads, "model.num_heads"),
        (model.query_groups, "model.num_query_groups (key/value heads)"),
        (model.ffn_hidden_size, "model.ffn_hidden_size"),
    ):
        if value % tp:
            raise ConfigError(f"parallel.tensor={tp} does not divide {what}={value}: use a tensor size that divides it")


def _check_sequence_parallel(job: JobConfig, tp: int) -> bool:
    par = job.parallel
    sp = par.use_sequence_parallel()
    if tp > 1 and not sp:
        raise ConfigError(
            f"parallel.sequence_parallel=off with parallel.tensor={tp}: megatron needs sequence parallelism for "
            "MoE layers under tensor parallelism: set parallel.sequence_parallel=auto"
        )
    if sp and tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel=on with parallel.tensor=1 splits nothing: set it to auto (or raise tensor)"
        )
    if sp and job.data.seq_len % tp:
        raise ConfigError(
            f"data.seq_len={job.data.seq_len} is not divisible by parallel.tensor={tp}, which sequence "
            "parallelism splits it by: use a sequence length that is a multiple of the tensor size"
        )
    return sp


# Share of a GPU's memory the estimate may fill: the rest is the CUDA context and allocator fragmentation
# (routing imbalance, the all-to-all's buffers and NCCL's are in the estimate: parallel/memory.py).
MEMORY_HEADROOM = 0.9


def check_memory(job: JobConfig, world_size: int, gpu_memory: int | None) -> str:
    """One line with the memory estimate per rank at L_max; with ``gpu_memory`` (bytes), a job whose
    estimate exceeds :data:`MEMORY_HEADROOM` of it raises :class:`ConfigError` naming a setting that fits."""
    from elastic_pretrain.parallel.memory import Spec, estimate_memory, largest_micro_batch

    mode = job.train.recompute
    spec: Spec = "te" if job.slurm.gpus_per_node or gpu_memory else "local"
    peak = estimate_memory(job, world_size, spec=spec).peak(mode)
    where = (
        f"at ℓ = L_max = {job.model.max_loops}, micro-batch {job.train.micro_batch_size} x "
        f"{job.data.seq_len}, train.recompute={mode}"
    )
    if gpu_memory is None:
        return f"memory per rank: {_size(peak)} {where} (set slurm.gpu_memory to check it)"
    budget = MEMORY_HEADROOM * gpu_memory
    line = f"memory per rank: {_size(peak)} {where}, of {_size(gpu_memory)} per GPU ({100 * peak / gpu_memory:.0f}%)"
    if peak <= budget:
        return line
    dp = job.parallel.data_parallel_size(world_size)
    fits = largest_micro_batch(job, world_size, gpu_memory, recompute=mode, spec=spec, headroom=MEMORY_HEADROOM)
    sizes = [m for m in range(fits, 0, -1) if job.train.global_batch_size % (m * dp) == 0]
    if sizes:
        fix = f"set train.micro_batch_size={sizes[0]}"
    elif (
        mode != "pass"
        and largest_micro_batch(job, world_size, gpu_memory, recompute="pass", spec=spec, headroom=MEMORY_HEADROOM)
        >= job.train.micro_batch_size
    ):
        fix = "set train.recompute=pass (each loop pass recomputed in backward)"
    else:
        fix = "shard more (raise parallel.tensor or parallel.expert) or use GPUs with more memory"
    raise ConfigError(
        f"memory estimate {_size(peak)} per rank {where} exceeds {MEMORY_HEADROOM:.0%} of "
        f"slurm.gpu_memory={job.slurm.gpu_memory or f'{gpu_memory / 2**30:.0f}GiB'}: {fix}"
    )


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
