"""Memory per rank of a job on its mesh — a pure function of the job (no torch: the CLI and the config command
import it cheaply). ``estimate_memory(job, world_size)`` is the API; ``largest_micro_batch`` searches the
micro-batch size that fits a device. Parameters, gradients and optimizer state are exact counts of what
megatron allocates; activations are a model (fitted on CPU for ``spec="local"``, Korthikanti et al. for
``spec="te"``), plus routing imbalance, all-to-all and NCCL buffers. docs/gpu.md, "Memory estimate".

Shape legend: s sequence, b micro-batch, D hidden, h heads, F expert width, Fd dense FFN width,
E experts, k top-k, N = s·b tokens of one micro-batch, V padded vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Literal

from elastic_pretrain.config import ConfigError
from elastic_pretrain.model.vocab import padded_vocab_size

if TYPE_CHECKING:
    from elastic_pretrain.job import JobConfig

Recompute = Literal["none", "selective", "pass"]
RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "pass")
Spec = Literal["te", "local"]

# Planning MaxVio (max load / mean load − 1) of the most loaded expert-parallel rank: an assumption, not a
# measurement. The routing probe (model/routing.py, ``routing/<layer>/<pass>/maxvio`` in MLflow) measured
# 0.32–0.51 per expert at flatten 2 (the 16-node recipe's) in the flattening experiment
# (docs/results/flattening.json, 3 seeds; 0.6–1.07 at flatten 4); a rank's load averages E / EP experts, so
# an expert's MaxVio bounds its rank's. Replace it with the probe's value of the run being planned.
PLANNING_MAXVIO = 0.5
# NCCL's buffers: NCCL_BUFFSIZE (4 MiB by default) per channel and connected peer. Channels: an assumption
# (NCCL picks 2–32 by topology; NCCL_DEBUG=INFO prints the count); a ring collective connects 2 peers
# (previous, next), an all-to-all every other rank of its group.
NCCL_BUFFSIZE = 4 * 2**20
NCCL_CHANNELS = 16


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes on one rank of pipeline stage ``stage`` (ranks of a stage differ only by shard rounding)."""

    stage: int
    params: int  # parameters held by the rank (dense + its local experts)
    param_bytes: int
    grad_bytes: int  # megatron DDP's gradient buffer (fp32: grad_reduce_in_fp32)
    optimizer_bytes: int  # Adam m, v (+ fp32 master weights under bf16), sharded by the distributed optimizer
    activation_bytes: dict[str, dict[int, int]]  # recompute mode -> ℓ -> bytes saved for backward
    # mode -> ℓ -> bytes the most loaded EP rank saves beyond activation_bytes (routing imbalance)
    imbalance_bytes: dict[str, dict[int, int]]
    dispatch_bytes: int  # the all-to-all's send + receive token buffers of one MoE call (0 at EP 1)
    nccl_bytes: int  # NCCL's buffers: a planning allowance per communicator

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def comm_bytes(self) -> int:
        return self.dispatch_bytes + self.nccl_bytes

    def total(self, loops: int, recompute: str) -> int:
        return (
            self.static_bytes
            + self.activation_bytes[recompute][loops]
            + self.imbalance_bytes[recompute][loops]
            + self.comm_bytes
        )


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-stage memory of a job at ``world_size`` ranks and ``micro_batch_size`` sequences per micro-batch."""

    world_size: int
    micro_batch_size: int
    seq_len: int
    max_loops: int
    spec: Spec
    maxvio: float  # the routing imbalance assumed (MaxVio of the most loaded EP rank)
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

        out = [
            f"memory per rank ({unit}) at world size {self.world_size}, micro-batch {self.micro_batch_size} x "
            f"seq {self.seq_len}, {self.spec} spec" + (f", device {gib(gpu_memory)} {unit}" if gpu_memory else "")
        ]
        for st in self.stages:
            out.append(
                f"stage {st.stage}: {st.params / 1e6:.1f}M params | params {gib(st.param_bytes)} | grads "
                f"{gib(st.grad_bytes)} | optimizer {gib(st.optimizer_bytes)} | static {gib(st.static_bytes)}"
            )
            ells = range(1, self.max_loops + 1)
            out.append("  activations  " + "".join(f"{'l=' + str(ell):>9}" for ell in ells))
            for mode in RECOMPUTE_MODES:
                acts = st.activation_bytes[mode]
                out.append(f"  {mode:<11}  " + "".join(f"{gib(acts[ell]):>9}" for ell in sorted(acts)))
            out.append(
                "  imbalance    "
                + "".join(f"{gib(st.imbalance_bytes['none'][ell]):>9}" for ell in ells)
                + f"   (recompute none; MaxVio {self.maxvio:g}: the most loaded EP rank's expert activations)"
            )
            out.append(
                f"  comm         all-to-all {gib(st.dispatch_bytes)} | NCCL {gib(st.nccl_bytes)} | "
                "DDP 0 (in place in the grad/param buffers)"
            )
            out.append(
                "  total        " + "".join(f"{gib(st.total(ell, 'none')):>9}" for ell in ells) + "   (recompute none)"
            )
        return out


def check_maxvio(maxvio: float, name: str = "maxvio") -> None:
    if not maxvio >= 0:  # NaN too
        raise ConfigError(f"{name}: must be >= 0 (max load / mean load - 1; 0 = perfectly balanced), got {maxvio}")


# ---------------------------------------------------------------------------------------------------
def estimate_memory(
    job: JobConfig,
    world_size: int,
    *,
    micro_batch_size: int | None = None,
    spec: Spec = "te",
    maxvio: float = PLANNING_MAXVIO,
) -> MemoryEstimate:
    """Per-rank memory of ``job`` on ``world_size`` ranks (its mesh: ``job.parallel``); ``maxvio``: the routing
    imbalance assumed for the most loaded expert-parallel rank (max load / mean load − 1)."""
    par, m = job.parallel, job.model
    dp = par.data_parallel_size(world_size)
    edp = par.tensor * dp // par.expert  # expert-data-parallel ranks (expert-TP = 1): shards of expert state
    mbs = job.train.micro_batch_size if micro_batch_size is None else micro_batch_size
    if mbs < 1:
        raise ConfigError(f"micro_batch_size: must be >= 1, got {mbs}")
    check_maxvio(maxvio)
    # a rank cannot receive more than every rank's tokens: at EP 1 the one rank holds all of them, balanced or not
    load = min(1 + maxvio, par.expert)
    nccl = _nccl_bytes(job, world_size, spec)
    stages = []
    for stage in range(par.pipeline):
        dense, expert, fp32 = _param_counts(job, stage, spec)
        el = 2 if m.dtype == "bf16" else 4
        opt_per_param = 12 if m.dtype == "bf16" else 8  # fp32 master copy + Adam m, v
        shard_dense, shard_expert = (dp, edp) if job.train.distributed_optimizer else (1, 1)
        optimizer = opt_per_param * (math.ceil(dense / shard_dense) + math.ceil(expert / shard_expert))
        acts, extra = (_activations(job, stage, mbs, spec, world_size, load=x) for x in (1.0, load))
        imbalance = {mode: {ell: extra[mode][ell] - acts[mode][ell] for ell in acts[mode]} for mode in acts}
        n = dense + expert
        stages.append(
            StageMemory(
                stage=stage,
                params=n,
                param_bytes=el * (n - fp32) + 4 * fp32,
                grad_bytes=4 * n,
                optimizer_bytes=optimizer,
                activation_bytes=acts,
                imbalance_bytes=imbalance,
                dispatch_bytes=_dispatch_bytes(job, mbs, load),
                nccl_bytes=nccl,
            )
        )
    return MemoryEstimate(
        world_size=world_size,
        micro_batch_size=mbs,
        seq_len=job.data.seq_len,
        max_loops=m.max_loops,
        spec=spec,
        maxvio=maxvio,
        stages=tuple(stages),
    )


def largest_micro_batch(
    job: JobConfig,
    world_size: int,
    gpu_memory: int,
    *,
    recompute: str | None = None,
    loops: int | None = None,
    spec: Spec = "te",
    headroom: float = 0.9,
    maxvio: float = PLANNING_MAXVIO,
) -> int:
    """The largest micro-batch size whose peak (at ℓ = ``loops``, default L_max) fits ``headroom`` of
    ``gpu_memory`` bytes (the rest: CUDA context, allocator fragmentation); 0 if none does."""
    mode = recompute or job.train.recompute
    budget = gpu_memory * headroom
    best, lo, hi = 0, 1, 1
    estimate = functools.partial(estimate_memory, job, world_size, spec=spec, maxvio=maxvio)
    while estimate(micro_batch_size=hi).peak(mode, loops) <= budget:
        best, lo, hi = hi, hi, hi * 2
        if hi > 1 << 20:
            return best
    while lo <= hi:  # largest fitting in [best, hi)
        mid = (lo + hi) // 2
        if estimate(micro_batch_size=mid).peak(mode, loops) <= budget:
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


def _activations(
    job: JobConfig, stage: int, mbs: int, spec: Spec, world_size: int, load: float
) -> dict[str, dict[int, int]]:
    """recompute mode -> ℓ -> bytes saved for backward (:func:`_activation_bytes`)."""
    return {
        mode: {
            ell: _activation_bytes(job, stage, ell, mode, mbs, spec, world_size, load=load)
            for ell in range(1, job.model.max_loops + 1)
        }
        for mode in RECOMPUTE_MODES
    }


def _activation_bytes(
    job: JobConfig, stage: int, loops: int, recompute: str, mbs: int, spec: Spec, world_size: int, *, load: float = 1.0
) -> int:
    """Bytes saved for backward on one rank of ``stage`` while the most micro-batches are in flight; ``load``:
    the tokens its experts receive over its share (1 + MaxVio on the most loaded expert-parallel rank)."""
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
        # the fitted N·k·D and N·k·F terms: all of them scaled by the load (the fit does not say which of the
        # N·k·D copies sit on the expert's rank; at EP 1, what the fit measured, load is 1)
        experts = load * (c[2] * el * n * k * d + c[3] * el * n * k * f)
        layer_pass = c[0] * el * n * d + attn_s2 + experts + c[4] * n * e
        if recompute == "selective":  # core attention recomputed: its s² scores are not kept
            layer_pass -= attn_s2
        cb = _LOCAL_BASE[m.dtype]
        base = (
            cb[0] * el * n * d * (first + last) / 2
            + edge * (cb[1] * el * n * d + cb[2] * el * b * h * s * s + cb[3] * el * n * m.ffn_hidden_size)
            + (cb[4] * n * padded_vocab_size(m.vocab_size) if last else 0)
        )
    else:
        # TE + flash attention (bf16 GEMM inputs; no dropout): attention keeps the norm input, the
        # norm output (QKV input), Q, K, V, the attention output (projection input): 6·N·D; the MoE
        # MLP keeps its norm input and output (2·N·D), router logits and probs (fp32), the dispatched
        # tokens (fc1 input, N·k·D), fc1 output (N·k·2F), the SwiGLU output (fc2 input, N·k·F), and the
        # expert outputs weighted by the gate in the unpermute (N·k·D). Routing imbalance scales what sits on
        # the expert's rank (fc1 input, fc1 and SwiGLU outputs); the unpermute is back on the token's own rank.
        lse = 4 * b * h * s  # flash attention's log-sum-exp (fp32)
        experts = load * el * (n * k * d + 3 * n * k * f)
        layer_pass = el * (8 * n * d + n * k * d) + experts + 8 * n * e + lse
        if recompute == "selective":  # Q, K, V and the attention output are recomputed from the norm output
            layer_pass -= el * 4 * n * d
        dense_layer = el * (8 * n * d + 3 * n * m.ffn_hidden_size) + lse
        base = (
            el * n * d * (first + last)  # embedding output / final norm input
            + edge * dense_layer
            + (4 * n * padded_vocab_size(m.vocab_size) + el * n * d if last else 0)
        )  # CE softmax (fp32), head in
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


def _dispatch_bytes(job: JobConfig, mbs: int, load: float) -> int:
    """megatron's all-to-all dispatcher (MoEAlltoAllTokenDispatcher) at EP > 1: the tokens permuted by
    destination rank (the send buffer, N·k·D) and the all-to-all's output (the receive buffer, N·k·D times
    the load on the most loaded rank), in the activation dtype; neither is saved for backward (the fc1 input,
    sorted by local expert, is: activations), and one MoE call's are live at a time (the combine's and the
    backward's are the same sizes). Sequence parallelism splits the tokens by TP (expert-TP 1)."""
    m, par = job.model, job.parallel
    if par.expert == 1:  # no all-to-all: the permuted tokens are the fc1 input, counted in activations
        return 0
    el = 2 if m.dtype == "bf16" else 4
    tokens = job.data.seq_len * mbs * m.moe_top_k / par.tensor
    return int(el * tokens * m.hidden_size * (1 + load))


def _nccl_bytes(job: JobConfig, world_size: int, spec: Spec) -> int:
    """NCCL's buffers: :data:`NCCL_BUFFSIZE` x :data:`NCCL_CHANNELS` x peers for each communicator a rank
    uses in training (the world group: stop flags, straggler report; data-parallel and expert-data-parallel
    gradient reduction; tensor; pipeline send/receive; the expert all-to-all). None under gloo."""
    par = job.parallel
    if par.backend == "gloo" or (par.backend == "auto" and spec == "local"):  # auto: nccl on GPUs (te spec)
        return 0
    dp = par.data_parallel_size(world_size)
    rings = [world_size, dp, par.tensor * dp // par.expert, par.tensor, par.pipeline]
    peers = sum(2 for size in rings if size > 1) + (par.expert - 1)  # all-to-all: every other rank of EP
    return NCCL_BUFFSIZE * NCCL_CHANNELS * peers
