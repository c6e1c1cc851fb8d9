"""Model configuration: the reference shape, flattening, and what is shared across loop passes; the run modes."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from elastic_pretrain.config import ConfigError, field


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """A looped flattened-MoE language model.

    The core is given as a *reference shape* (``core_layers`` × ``num_experts`` × ``loops``);
    ``flatten=f`` builds ``core_layers/f`` layers with ``f·num_experts`` experts run ``f·loops``
    times (Foil, seeds/000: "Halve the number of expert layers, double the experts per layer, double the
    passes"): expert parameters and active expert FLOPs per token are unchanged, because the
    expert width and top-k stay the same while layers shrink and passes grow by the same factor.
    """

    vocab_size: int = field(257, doc="Tokenizer vocabulary (byte-level: 256 bytes + EOS). Padded for TP.")
    hidden_size: int = field(64, doc="Residual stream width.")
    num_heads: int = field(4, doc="Attention heads (must divide hidden_size and be divisible by TP).")
    num_query_groups: int | None = field(
        None,
        doc="Grouped-query attention: key/value head groups (must divide num_heads and be divisible by TP); "
        "None: one per head (multi-head attention).",
    )
    qk_norm: bool = field(
        False,
        doc="QK-norm: normalise each head's queries and keys (model.normalization, learned scale) before RoPE "
        "and the dot product (megatron qk_layernorm); keeps attention logits bounded at scale.",
    )
    ffn_hidden_size: int = field(256, doc="FFN width of dense prelude/coda layers.")
    prelude_layers: int = field(0, doc="Layers run once before the loop.")
    core_layers: int = field(2, doc="Core layers of the reference shape (before flattening).")
    coda_layers: int = field(0, doc="Layers run once after the loop (applied at every exit).")
    loops: int = field(2, doc="Passes through the core of the reference shape; L_max = loops * flatten.")
    num_experts: int = field(4, doc="Experts per core layer of the reference shape.")
    moe_top_k: int = field(2, doc="Experts per token (unchanged by flattening).")
    moe_ffn_hidden_size: int = field(64, doc="Width of one expert (unchanged by flattening).")
    flatten: int = field(1, doc="Flattening factor f: core_layers/f layers, f*num_experts experts, f*loops passes.")
    attention: Literal["untied", "tied"] = field(
        "untied", doc="'untied': each pass has its own attention (Foil); 'tied': one attention for all passes."
    )
    edge_mlp: Literal["dense", "moe"] = field("dense", doc="MLP type of prelude and coda layers.")
    normalization: Literal["RMSNorm", "LayerNorm"] = field("RMSNorm", doc="Norm type everywhere.")
    rope_base: int = field(10000, doc="Rotary position embedding base.")
    init_std: float = field(0.02, doc="Std of the normal init of weights.")
    tie_embeddings: bool = field(False, doc="Share input embedding and output projection.")
    moe_aux_loss_coeff: float = field(1e-2, doc="Load-balancing auxiliary loss coefficient (0 disables).")
    moe_z_loss_coeff: float = field(1e-3, doc="Router z-loss coefficient (0 disables).")
    moe_load_balancing: Literal["aux_loss", "seq_aux_loss", "none"] = field(
        "aux_loss", doc="megatron-core load balancing type."
    )
    moe_dispatcher: Literal["alltoall", "allgather", "flex"] = field(
        "alltoall",
        doc="Token dispatcher; alltoall is what mixed-depth EP safety is designed around. flex: DeepEP "
        "(CUDA + TE + deep_ep only; refused elsewhere).",
    )
    fusions: Literal["auto", "on", "off"] = field(
        "auto",
        doc="Fused kernels (bias+SwiGLU, bias-dropout-add, masked softmax, RoPE, cross-entropy, MoE permute and "
        "router). auto: on with CUDA + Transformer Engine, off without; on: refused on machines without them.",
    )
    moe_grouped_gemm: Literal["auto", "on", "off"] = field(
        "auto",
        doc="Experts as Transformer Engine grouped GEMMs (TEGroupedMLP) instead of a per-expert loop. auto: on with "
        "CUDA + TE, off without; on: refused on machines without them.",
    )
    route_replay: bool = field(False, doc="Passes >= 1 reuse pass-0 expert choices (ELR); gates stay live.")
    route_replay_impl: Literal["dispatch", "router"] = field(
        "dispatch",
        doc="How route replay runs (docs/route-replay.md). dispatch: later passes reuse pass 0's routing map, "
        "permutation and split sizes and compute only the k gates from live router logits (no top-k, no aux/z "
        "loss); router: megatron's RouterReplay (the full router runs, only top-k is replaced). alltoall only.",
    )
    kv_training: Literal["same_pass", "last_loop"] = field(
        "same_pass",
        doc="Attention of core pass j to earlier tokens in training: same_pass reads their pass-j K/V; last_loop "
        "their final-pass K/V from a no-grad run, as the ELR last-loop KV cache serves them (docs/kv-training.md).",
    )
    loop_conditioning: bool = field(
        True, doc="Build the ELR loop-count conditioning head (zero-init, switched on at the mixed-depth switch)."
    )
    dtype: Literal["fp32", "bf16"] = field("fp32", doc="Parameter / compute dtype.")
    fp8: Literal["off", "delayed", "tensorwise", "blockwise", "mxfp8"] = field(
        "off",
        doc="FP8 GEMMs (Transformer Engine + CUDA only; needs dtype bf16): megatron-core's recipe — 'delayed' "
        "(amax history), 'tensorwise' (current scaling), 'blockwise' (1x128/128x128 blocks, Hopper), "
        "'mxfp8' (Blackwell). docs/gpu.md.",
    )

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_heads",
            "ffn_hidden_size",
            "core_layers",
            "loops",
            "num_experts",
            "moe_top_k",
            "moe_ffn_hidden_size",
            "flatten",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("prelude_layers", "coda_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
        if (self.hidden_size // self.num_heads) % 2:
            # RoPE rotates each head's channels in pairs: an odd head dimension fails inside every rank (issue 33)
            head = self.hidden_size // self.num_heads
            raise ConfigError(
                f"hidden_size {self.hidden_size} / num_heads {self.num_heads} = head dimension {head}, which rotary "
                f"position embeddings need even: use hidden_size {self.num_heads * (head + 1)} or another num_heads"
            )
        if self.num_query_groups is not None and (self.num_query_groups < 1 or self.num_heads % self.num_query_groups):
            raise ConfigError(
                f"num_query_groups: {self.num_query_groups} must divide num_heads {self.num_heads} "
                "(e.g. num_heads/4), or be null for one group per head"
            )
        if self.core_layers % self.flatten:
            raise ConfigError(
                f"flatten: {self.flatten} does not divide core_layers {self.core_layers}: "
                "use a flatten factor that divides the reference core depth"
            )
        if self.moe_top_k > self.num_experts:
            raise ConfigError(f"moe_top_k: {self.moe_top_k} exceeds num_experts {self.num_experts}")
        if self.fp8 != "off":
            self.check_fp8_layout(tensor=1, tokens=None)
        if self.route_replay and self.route_replay_impl == "dispatch" and self.moe_dispatcher != "alltoall":
            raise ConfigError(
                f"route_replay_impl: dispatch replays the alltoall dispatcher, not {self.moe_dispatcher!r}; "
                "use moe_dispatcher: alltoall, or route_replay_impl: router"
            )

    @property
    def fp8_align(self) -> int:
        """What every FP8 GEMM dimension must be a multiple of (TE: 16; MXFP8's 32-element blocks: 32)."""
        return 32 if self.fp8 == "mxfp8" else 16

    def check_fp8_recompute(self, recompute: str) -> None:
        """Delayed scaling and per-pass recompute do not mix: Transformer Engine stashes each module's FP8
        scaling state per forward call and hands it back first-in first-out to the recomputed forwards,
        but the passes of a loop are recomputed in reverse order while sharing their MLP modules, so a
        re-run pass would quantize with another pass's scales. Current/block scaling has no such state."""
        if self.fp8 == "delayed" and recompute == "pass" and self.max_loops > 1:
            raise ConfigError(
                "model.fp8=delayed with train.recompute=pass: a recomputed pass would reuse another pass's FP8 "
                "scales; use model.fp8=tensorwise (or blockwise/mxfp8), or train.recompute=none/selective"
            )

    def check_fp8_layout(self, *, tensor: int, tokens: int | None) -> None:
        """FP8 GEMMs need bf16 and every GEMM dimension a multiple of :attr:`fp8_align` — the per-rank
        shards under tensor parallelism, and the tokens of one micro-batch per rank (``tokens`` = seq x
        micro-batch / TP under sequence parallelism). Experts are padded by megatron (any token count)."""
        if self.fp8 == "off":
            return
        if self.dtype != "bf16":
            raise ConfigError(f"model.fp8={self.fp8} needs model.dtype=bf16 (got {self.dtype}): set model.dtype=bf16")
        a = self.fp8_align
        dims = {
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "moe_ffn_hidden_size": self.moe_ffn_hidden_size,
        }
        for name, value in dims.items():
            if value % (a * tensor):
                raise ConfigError(
                    f"model.{name}={value} is not a multiple of {a * tensor} (model.fp8={self.fp8} needs every GEMM "
                    f"dimension per tensor-parallel rank to be a multiple of {a}): round it to a multiple of "
                    f"{a * tensor}"
                )
        if tokens is not None and tokens % a:
            raise ConfigError(
                f"model.fp8={self.fp8}: {tokens} tokens per micro-batch and tensor-parallel rank (data.seq_len x "
                f"train.micro_batch_size / parallel.tensor) is not a multiple of {a}: change data.seq_len or "
                "train.micro_batch_size"
            )

    # The built (flattened) shape ------------------------------------------------------------------
    @property
    def core_layers_built(self) -> int:
        return self.core_layers // self.flatten

    @property
    def experts_built(self) -> int:
        return self.num_experts * self.flatten

    @property
    def query_groups(self) -> int:
        """Key/value head groups (``num_heads`` without GQA)."""
        return self.num_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def max_loops(self) -> int:
        """L_max: the deepest loop count the model runs (``loops * flatten``)."""
        return self.loops * self.flatten

    @property
    def num_unique_layers(self) -> int:
        return self.prelude_layers + self.core_layers_built + self.coda_layers

    def check_loops(self, loops: int) -> None:
        if not 1 <= loops <= self.max_loops:
            raise ConfigError(
                f"loops={loops} is outside [1, {self.max_loops}] (L_max = model.loops * model.flatten = "
                f"{self.loops} * {self.flatten}): pick a loop count in that range"
            )

    def check_pipeline(self, stages: int) -> None:
        """What pipeline parallelism of the loop over ``stages`` stages needs (docs/parallelism.md)."""
        if stages == 1:
            return
        if self.core_layers_built % stages:
            raise ConfigError(
                f"parallel.pipeline={stages} must divide the core layers built ({self.core_layers_built} = "
                "model.core_layers / model.flatten): change parallel.pipeline or model.core_layers/flatten"
            )
        if self.tie_embeddings:
            raise ConfigError("model.tie_embeddings is not supported with parallel.pipeline > 1: set it to false")


@dataclasses.dataclass(kw_only=True)
class DeciderConfig:
    """The TaH2 iteration decider: head shape, lookahead labels, loss weighting, inference threshold."""

    hidden_size: int = field(64, doc="Width of the decider's hidden layer.")
    coverage: float = field(
        1.0,
        doc="Labels: 1 (TaH2) labels 'continue' every token one more pass helps (gain CE_j - CE_{j+1} > 0); below 1 "
        "(an ablation) only the largest gains covering that fraction of the total positive gain (0, 1].",
    )
    pos_weight: float = field(1.0, doc="BCE weight of 'continue' labels (> 1 favours running more passes).")
    loss_weight: float = field(0.1, doc="Weight of the decider BCE added to the LM loss.")
    backbone: Literal["frozen", "joint", "per_token"] = field(
        "per_token",
        doc="'per_token' (TaH2's joint post-training, the default): tokens stop where the decider says (state "
        "frozen, still attended to), LM loss at each token's exit, nested lookahead labels pooled over data-parallel "
        "ranks; 'frozen': the BCE does not reach the LM (inputs detached); 'joint': it does, LM loss at L_max.",
    )
    lm_loss: Literal["last", "every_exit"] = field(
        "last",
        doc="backbone 'joint': where the LM loss is taken: 'last' (the exit after L_max passes) or 'every_exit' "
        "(the mean of the CE after each pass 1..L_max: the backbone keeps training every fixed depth, the control "
        "for per-token post-training on the same tokens).",
    )
    threshold: float = field(
        0.5,
        doc="Inference: a token stops at the first pass whose continue prob < threshold (a decider job logs the "
        "mean passes at it).",
    )
    init_from: str | None = field(
        None,
        doc="Decider job: the base run directory or checkpoints/step_<N> to post-train (its newest committed step; "
        "the model shape and loop-conditioning phase come from it).",
    )

    def __post_init__(self) -> None:
        if self.hidden_size < 1:
            raise ConfigError(f"decider.hidden_size: must be >= 1, got {self.hidden_size}")
        if not 0.0 < self.coverage <= 1.0:
            raise ConfigError(
                f"decider.coverage: must be in (0, 1], got {self.coverage} (1 labels every token with a gain, "
                "0.9 the tokens covering 90% of it)"
            )
        if self.pos_weight <= 0:
            raise ConfigError(f"decider.pos_weight: must be > 0, got {self.pos_weight}")
        if self.loss_weight < 0:
            raise ConfigError(f"decider.loss_weight: must be >= 0, got {self.loss_weight}")
        if self.lm_loss == "every_exit" and self.backbone != "joint":
            raise ConfigError(
                f"decider.lm_loss=every_exit trains the backbone at every exit, but decider.backbone={self.backbone} "
                "takes its LM loss elsewhere (frozen: none; per_token: at each token's exit): set backbone: joint "
                "or lm_loss: last"
            )
        if self.threshold < 0:
            raise ConfigError(f"decider.threshold: must be >= 0 (0 = always run L_max), got {self.threshold}")


GhostKind = Literal["moe_calls", "full_passes"]
RecomputeKind = Literal["none", "selective", "pass"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunModes:
    """How the model runs beyond its architecture (``ModelConfig``): chosen by whoever owns the model (``parallel/``,
    the engine, the schedule), given to its constructor or ``set_modes`` (model/looped.py), read by every forward.

    The model's other modes are its config's (``route_replay``, ``kv_training``, ``loop_conditioning``, the exit
    axis) or a forward's arguments (``loops``, ``exits``, ``sync_loops``, ``exit_axis``); docs/architecture.md
    lists them all."""

    ghosts: GhostKind = "moe_calls"
    """How a rank joins the passes its data/expert-parallel partners run beyond its ℓ: ``moe_calls`` (one zero token
    per MoE call: expert parallelism's all-to-alls) or ``full_passes`` (every module call: DeepSpeed ZeRO-3's
    parameter gathers)."""
    recompute: RecomputeKind = "none"
    """``train.recompute``: ``pass`` re-runs each pass (and ghost pass) in backward; ``selective`` is megatron's own
    (in the ``TransformerConfig``), the model does nothing for it."""
    conditioning: bool = False
    """The ELR loop-count conditioning heads are on (the schedule's mixed phase; a stage without heads keeps the
    flag too: every stage must agree on ``LoopedMoEModel.one_exit_per_run``)."""

    def __post_init__(self) -> None:
        for name, kind in (("ghosts", GhostKind), ("recompute", RecomputeKind)):
            value = getattr(self, name)
            if value not in get_args(kind):
                raise ValueError(f"RunModes.{name}={value!r}: use one of {', '.join(get_args(kind))}")
        if not isinstance(self.conditioning, bool):
            raise ValueError(f"RunModes.conditioning={self.conditioning!r}: use True or False")
