"""Memory per rank of a job on its mesh: parameters, gradients, optimizer state, activations per ℓ and
recompute mode — a pure function of the job (no torch: the CLI and the config command import it cheaply).

``estimate_memory(job, world_size)`` is the API (``elastic-pretrain estimate`` and
``elastic-pretrain config --world-size`` print it); ``largest_micro_batch`` searches the micro-batch
size that fits a device. docs/gpu.md ("Memory estimate") explains the model and what it leaves out.

Shape legend: s sequence, b micro-batch, D hidden, h heads, F expert width, Fd dense FFN width,
E experts, k top-k, N = s·b tokens of one micro-batch, V padded vocabulary.

Parameters, gradients and optimizer state are exact counts of what megatron allocates (checked against
the built model in tests/parallel/test_memory.py). Activations are a model of the bytes saved for
backward:
- ``spec="local"`` (megatron's torch modules, what runs on CPU): coefficients fitted to bytes counted
  with ``torch.autograd.graph.saved_tensors_hooks`` on the CPU model (the attention scores s² are
  materialised);
- ``spec="te"`` (Transformer Engine + flash attention, what runs on GPUs): Korthikanti et al. (2022)'s
  per-layer count without dropout masks and without the s² terms; the GPU check (bench/gpu_check.sh)
  prints it beside the measured peak.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Literal

from elastic_pretrain.config import ConfigError
from elastic_pretrain.model.vocab import padded_vocab_size

if TYPE_CHECKING:
    from elastic_pretrain.job import JobConfig

Recompute = Literal["none", "selective", "pass"]
RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "pass")
Spec = Literal["te", "local"]


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes on one rank of pipeline stage ``stage`` (ranks of a stage differ only by shard rounding)."""

    stage: int
    params: int  # parameters held by the rank (dense + its local experts)
    param_bytes: int
    grad_bytes: int  # megatron DDP's gradient buffer (fp32: grad_reduce_in_fp32)
    optimizer_bytes: int  # Adam m, v (+ fp32 master weights under bf16), sharded by the distributed optimizer
    activation_bytes: dict[str, dict[int, int]]  # recompute mode -> ℓ -> bytes saved for backward

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def total(self, loops: int, recompute: str) -> int:
        return self.static_bytes + self.activation_bytes[recompute][loops]


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-stage memory of a job at ``world_size`` ranks and ``micro_batch_size`` sequences per micro-batch."""

    world_size: int
    micro_batch_size: int
    seq_len: int
    max_loops: int
    spec: Spec
    stages: tuple[StageMemory, ...]

    def peak(self, recompute: str, loops: int | None = None) -> int:
        """The most loaded rank's bytes at ℓ = ``loops`` (default L_max)."""
        ell = self.max_loops if loops is None else loops
        return max(st.total(ell, recompute) for st in self.stages)

    def lines(self, gpu_memory: int | None = None) -> list[str]:
        """A human table (GiB, or MiB for small jobs): one block per pipeline stage."""
        unit = "GiB" if max(self.peak(mode) for mode in RECOMPUTE_MODES) >= 2**30 else "MiB"

        def gib(n: int) -> str:
            return f"{n / (2**30 if unit == 'GiB' else 2**20):.2f}"

        out = [f"memory per rank ({unit}) at world size {self.world_size}, micro-batch {self.micro_batch_size} x "
               f"seq {self.seq_len}, {self.spec} spec" + (f", device {gib(gpu_memory)} {unit}" if gpu_memory else "")]
        for st in self.stages:
            out.append(f"stage {st.stage}: {st.params / 1e6:.1f}M params | params {gib(st.param_bytes)} | grads "
                       f"{gib(st.grad_bytes)} | optimizer {gib(st.optimizer_bytes)} | static {gib(st.static_bytes)}")
            out.append("  activations  " + "".join(f"{'l=' + str(ell):>9}" for ell in range(1, self.max_loops + 1)))
            for mode in RECOMPUTE_MODES:
                acts = st.activation_bytes[mode]
                out.append(f"  {mode:<11}  " + "".join(f"{gib(acts[ell]):>9}" for ell in sorted(acts)))
            out.append("  total        " + "".join(
                f"{gib(st.total(ell, 'none')):>9}" for ell in range(1, self.max_loops + 1)) + "   (recompute none)")
        return out


def parse_bytes(text: str) -> int:
    """'80GiB', '141GB', '80G', '1.5TiB', '12345' → bytes (GB = 10^9, GiB and bare G = 2^30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ConfigError(f"--gpu-memory: cannot read {text!r}: write a size such as 80GiB, 141GB or 96G")
    value, unit, suffix = float(m.group(1)), m.group(2).upper(), m.group(3).lower()
    power = "KMGT".index(unit) + 1 if unit else 0
    base = 1000 if suffix == "b" and unit else 1024
    return int(value * base**power)


# ---------------------------------------------------------------------------------------------------
def estimate_memory(job: JobConfig, world_size: int, *, micro_batch_size: int | None = None,
                    spec: Spec = "te") -> MemoryEstimate:
    """Per-rank memory of ``job`` on ``world_size`` ranks (its mesh: ``job.parallel``)."""
    par, m = job.parallel, job.model
    dp = par.data_parallel_size(world_size)
    edp = par.tensor * dp // par.expert  # expert-data-parallel ranks (expert-TP = 1): shards of expert state
    mbs = job.train.micro_batch_size if micro_batch_size is None else micro_batch_size
    if mbs < 1:
        raise ConfigError(f"micro_batch_size: must be >= 1, got {mbs}")
    stages = []
    for stage in range(par.pipeline):
        dense, expert, fp32 = _param_counts(job, stage, spec)
        el = 2 if m.dtype == "bf16" else 4
        opt_per_param = (12 if m.dtype == "bf16" else 8)  # fp32 master copy + Adam m, v
        shard_dense, shard_expert = (dp, edp) if job.train.distributed_optimizer else (1, 1)
        optimizer = opt_per_param * (math.ceil(dense / shard_dense) + math.ceil(expert / shard_expert))
        acts: dict[str, dict[int, int]] = {mode: {ell: _activation_bytes(job, stage, ell, mode, mbs, spec, world_size)
                       for ell in range(1, m.max_loops + 1)} for mode in RECOMPUTE_MODES}
        n = dense + expert
        stages.append(StageMemory(stage=stage, params=n, param_bytes=el * (n - fp32) + 4 * fp32, grad_bytes=4 * n,
                                  optimizer_bytes=optimizer, activation_bytes=acts))
    return MemoryEstimate(world_size=world_size, micro_batch_size=mbs, seq_len=job.data.seq_len,
                          max_loops=m.max_loops, spec=spec, stages=tuple(stages))


def largest_micro_batch(job: JobConfig, world_size: int, gpu_memory: int, *, recompute: str | None = None,
                        loops: int | None = None, spec: Spec = "te", headroom: float = 0.9) -> int:
    """The largest micro-batch size whose peak (at ℓ = ``loops``, default L_max) fits ``headroom`` of
    ``gpu_memory`` bytes (the rest: CUDA context, allocator fragmentation, NCCL buffers); 0 if none does."""
    mode = recompute or job.train.recompute
    budget = gpu_memory * headroom
    best, lo, hi = 0, 1, 1
    while estimate_memory(job, world_size, micro_batch_size=hi, spec=spec).peak(mode, loops) <= budget:
        best, lo, hi = hi, hi, hi * 2
        if hi > 1 << 20:
            return best
    while lo <= hi:  # largest fitting in [best, hi)
        mid = (lo + hi) // 2
        if estimate_memory(job, world_size, micro_batch_size=mid, spec=spec).peak(mode, loops) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


# ---------------------------------------------------------------------------------------------------
def _param_counts(job: JobConfig, stage: int, spec: Spec) -> tuple[int, int, int]:
    """(dense, expert, of them kept in fp32 whatever model.dtype) parameters on one rank of ``stage``:
    the torch heads (loop conditioning, decider) are fp32, and so are the norms of the local spec."""
    m, par = job.model, job.parallel
    tp, ep, d = par.tensor, par.expert, m.hidden_size
    norm = d if m.normalization == "RMSNorm" else 2 * d
    d_h = d // m.num_heads
    qk_norm = 2 * (norm // d) * d_h if m.qk_norm else 0  # QK-norm: one norm of width d_h on Q, one on K
    # input norm, fused QKV ((h + 2 groups) heads: GQA), output projection
    attn = norm + d * (m.num_heads + 2 * m.query_groups) * d_h // tp + d // tp * d + qk_norm
    dense_mlp = norm + d * 2 * m.ffn_hidden_size // tp + m.ffn_hidden_size // tp * d  # SwiGLU fc1, fc2
    router = m.experts_built * d
    experts = m.experts_built // ep * 3 * d * m.moe_ffn_hidden_size  # local experts (expert-TP 1): fc1 2F, fc2
    first, last = stage == 0, stage == par.pipeline - 1
    dense = expert = fp32 = 0
    edge_layers = (m.prelude_layers if first else 0) + (m.coda_layers if last else 0)
    if m.edge_mlp == "moe":
        dense += edge_layers * (attn + norm + router)
        expert += edge_layers * experts
    else:
        dense += edge_layers * (attn + dense_mlp)
    passes = 1 if m.attention == "tied" else m.max_loops
    core = m.core_layers_built // par.pipeline
    dense += core * (passes * attn + norm + router)
    expert += core * experts
    norms = 2 * edge_layers + core * (passes + 1) + (1 if last else 0)
    vocab = padded_vocab_size(m.vocab_size) // tp * d
    if first:
        dense += vocab
        if m.loop_conditioning:
            dense += (2 * m.max_loops + 1) * d + d * d
            fp32 += (2 * m.max_loops + 1) * d + d * d
        if job.decider is not None:
            hd = job.decider.hidden_size
            dense += 4 * d + 2 * d * hd + hd + m.max_loops * hd + hd + 1
            fp32 += 4 * d + 2 * d * hd + hd + m.max_loops * hd + hd + 1
    if last:
        dense += norm + (0 if m.tie_embeddings else vocab)
    if spec == "local":
        fp32 += norms * norm
    return dense, expert, fp32


# Bytes saved for backward per element count, local spec (megatron's torch modules), fitted on CPU.
# Per (core layer, pass): [N·D, b·h·s², N·k·D, N·k·F] in units of the dtype's bytes, + [N·E] bytes.
_LOCAL_PASS = {"fp32": (2.84, 0.99, 5.68, 6.79, 4.08), "bf16": (4.08, 2.86, 8.16, 5.9, 0.0)}
# Base: [N·D (embedding + head norm), per dense edge layer N·D, b·h·s², N·Fd] in dtype units, + N·V bytes.
_LOCAL_BASE = {"fp32": (2.67, 12.83, 0.36, 5.19, 4.95), "bf16": (5.76, 16.97, 3.01, 4.96, 3.94)}


def _activation_bytes(job: JobConfig, stage: int, loops: int, recompute: str, mbs: int, spec: Spec,
                      world_size: int) -> int:
    """Bytes saved for backward on one rank of ``stage`` while the most micro-batches are in flight."""
    m, par = job.model, job.parallel
    tp = par.tensor
    s, b, d, h = job.data.seq_len, mbs, m.hidden_size, m.num_heads
    n = s * b
    el = 2 if m.dtype == "bf16" else 4
    k, f, e = m.moe_top_k, m.moe_ffn_hidden_size, m.experts_built
    first, last = stage == 0, stage == par.pipeline - 1
    edge = (m.prelude_layers if first else 0) + (m.coda_layers if last else 0)
    if spec == "local":
        c = _LOCAL_PASS[m.dtype]
        attn_s2 = c[1] * el * b * h * s * s
        layer_pass = c[0] * el * n * d + attn_s2 + c[2] * el * n * k * d + c[3] * el * n * k * f + c[4] * n * e
        if recompute == "selective":  # core attention recomputed: its s² scores are not kept
            layer_pass -= attn_s2
        cb = _LOCAL_BASE[m.dtype]
        base = (cb[0] * el * n * d * (first + last) / 2
                + edge * (cb[1] * el * n * d + cb[2] * el * b * h * s * s + cb[3] * el * n * m.ffn_hidden_size)
                + (cb[4] * n * padded_vocab_size(m.vocab_size) if last else 0))
    else:
        # TE + flash attention (bf16 GEMM inputs; no dropout): attention keeps the norm input, the
        # norm output (QKV input), Q, K, V, the attention output (projection input): 6·N·D; the MoE
        # MLP keeps its norm input and output (2·N·D), router logits and probs (fp32), the dispatched
        # tokens (fc1 input, N·k·D), fc1 output (N·k·2F), the SwiGLU output (fc2 input, N·k·F), and the
        # expert outputs weighted by the gate in the unpermute (N·k·D).
        lse = 4 * b * h * s  # flash attention's log-sum-exp (fp32)
        layer_pass = el * (8 * n * d + 2 * n * k * d + 3 * n * k * f) + 8 * n * e + lse
        if recompute == "selective":  # Q, K, V and the attention output are recomputed from the norm output
            layer_pass -= el * 4 * n * d
        dense_layer = el * (8 * n * d + 3 * n * m.ffn_hidden_size) + lse
        base = (el * n * d * (first + last)  # embedding output / final norm input
                + edge * dense_layer
                + (4 * n * padded_vocab_size(m.vocab_size) + el * n * d if last else 0))  # CE softmax (fp32), head in
    layer_pass, base = layer_pass / tp, base / tp  # sequence parallelism (on with TP) splits every term
    core = m.core_layers_built // par.pipeline
    hidden = el * n * d / tp  # one pass's input: all that recompute=pass keeps of it
    exits = 1  # the anchor exit; telescopic training adds one more head per micro-batch (small next to passes)
    if par.pipeline == 1:
        # recompute=pass: each pass's input, + one pass live again while its backward runs
        acts = loops * hidden + core * layer_pass if recompute == "pass" else loops * core * layer_pass
        return int(acts + exits * base)
    # Interleaved pipeline: stage s holds (P - s - 1)·2 + (v - 1)·P + 1 chunks in flight (megatron's
    # warm-up count), chunk j of a micro-batch = pass j of this stage's core layers; of L_max chunks only
    # ℓ run layers (the rest are identity views)
    v = m.max_loops
    micro = max(1, job.train.global_batch_size // (mbs * par.data_parallel_size(world_size)))  # per step, replica
    in_flight = min(micro * v, (par.pipeline - stage - 1) * 2 + (v - 1) * par.pipeline + 1)
    real = in_flight * loops / v
    per_chunk = hidden if recompute == "pass" else core * layer_pass
    acts = real * per_chunk + (core * layer_pass if recompute == "pass" else 0)
    micro_in_flight = math.ceil(in_flight / v)
    return int(acts + micro_in_flight * base)
