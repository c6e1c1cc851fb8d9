"""Will this job's layout work at this world size? Every divisibility rule megatron-core and the looped
model impose, checked from the config alone (no torch, no GPU): ``elastic-pretrain config JOB
--world-size N`` and ``submit`` (nodes × processes per node) run it, so a 128-GPU job's layout mistakes
show up on a laptop as one line naming the fix, not minutes into a cluster allocation.

The rules, and where each comes from:

* world = TP × PP × DP (megatron ``initialize_model_parallel``);
* experts: EP divides TP × DP (expert-data-parallel groups; expert TP is 1) and the built expert count
  (``MoELayer``: ``num_moe_experts % ep_size == 0``);
* attention: TP divides the heads (``TransformerConfig``) and the key/value groups (GQA: each TP rank
  holds whole groups);
* MLPs: TP divides the dense FFN width (column-parallel fc1, row-parallel fc2);
* vocabulary: TP divides the fixed padding multiple (``VOCAB_DIVISIBLE_BY``), so the padded vocabulary
  splits evenly and checkpoints move between TP sizes;
* sequence parallelism: on with TP > 1 for MoE (megatron's MoE + TP requirement), and then TP divides
  the sequence length (the scatter splits the sequence dimension);
* pipeline: PP divides the core layers built and at least PP micro-batches per step
  (``parallel/pipeline.py``), no tied embeddings;
* batch: global batch = micro-batch × DP × micro-batches per step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from elastic_pretrain.config import ConfigError
from elastic_pretrain.parallel.config import VOCAB_DIVISIBLE_BY, check_micro_batches, padded_vocab_size

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
    return Layout(world_size=world_size, tensor=tp, pipeline=pp, expert=ep, data=dp, micro_batches=micro,
                  sequence_parallel=sp, padded_vocab=padded_vocab_size(model.vocab_size, tp))


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
            raise ConfigError(
                f"parallel.tensor={tp} does not divide {what}={value}: use a tensor size that divides it"
            )


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
