"""Incremental decoding for the looped model (one process: TP = 1, EP = 1), with two KV-cache policies.

Shape legend: B batch, S new tokens of this step, P cached (past) tokens, D hidden, G key/value
groups, H query heads, d head width, V vocabulary. megatron layers are sequence-first (``h_SBD``).

Everything runs the model's own modules: the input norm, megatron's ``SelfAttention``
(``get_query_key_value_tensors``, ``linear_proj``), RoPE from ``model.rotary_pos_emb`` through
megatron's ``apply_rotary_pos_emb``, the layer's bias-dropout-add, the shared MoE MLP half
(``_forward_mlp``, with route replay wired exactly as in ``CoreLayer.forward``), the coda, final norm
and output layer. Only the score/softmax/value product is written here, because it has to read K/V
from a cache: a plain causal softmax attention with the layer's own softmax scale.

KV-cache policies (``kv_cache``):

- ``per-loop``: every (core layer i, pass j) keeps its own K/V cache, like an unrolled stack of
  p + k·ℓ + c layers. Exact: token-by-token logits equal ``model(ids, loops=ℓ)``. Memory grows with ℓ.
- ``last-loop`` (ELR): one cache per core layer, written by each token's *last* pass. Every pass j of
  a new token attends to the past tokens' last-pass K/V plus its own pass-j K/V. Memory per token is
  that of a p + k + c layer model, whatever ℓ. Not the training-time attention pattern (there, pass j
  attends to pass-j K/V), so it has a quality gap, measured by :func:`teacher_forced_loss`; with ℓ = 1
  the two policies coincide.

Adaptive depth (``stop``, e.g. the TaH2 iteration decider in ``model/decider.py``): after pass j a
token whose stop mask is set keeps its hidden state frozen; its K/V of the last pass it ran keep
serving later passes of other tokens (in ``per-loop`` they are written into the caches of the passes
it skipped; in ``last-loop`` they are what the cache holds anyway). Within one step of several tokens
(a prefill, or teacher-forced evaluation) the tokens of the step see each other causally.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch import Tensor

from elastic_pretrain.model.config import ModelConfig

if TYPE_CHECKING:
    from elastic_pretrain.model.looped import CoreLayer, LoopedMoEModel

KVPolicy = Literal["per-loop", "last-loop"]
KV_POLICIES: tuple[KVPolicy, ...] = ("per-loop", "last-loop")
# (h_SBD after pass j, token embedding e_SBD, pass j) -> stop mask [S, B] (True = this token stops here)
StopFn = Callable[[Tensor, Tensor, int], Tensor]
CacheKey = tuple[str, int] | tuple[str, int, int]
CachePart = Literal["all", "core"]


def kv_bytes_per_token(
    cfg: ModelConfig, policy: KVPolicy, loops: int, *, query_groups: int | None = None, dtype_bytes: int = 4
) -> int:
    """K and V bytes one cached token holds: 2·G·d·bytes per cached layer application.

    ``per-loop`` caches p + k·ℓ + c layer applications, ``last-loop`` p + k + c.
    """
    cfg.check_loops(loops)
    groups = cfg.num_heads if query_groups is None else query_groups
    core = cfg.core_layers_built * (loops if policy == "per-loop" else 1)
    layers = cfg.prelude_layers + core + cfg.coda_layers
    return 2 * groups * (cfg.hidden_size // cfg.num_heads) * dtype_bytes * layers


class KVCache:
    """K/V of past tokens per cached layer application, ``[P, B, G, d]`` each."""

    def __init__(self, policy: KVPolicy) -> None:
        if policy not in KV_POLICIES:
            raise ValueError(f"kv_cache: {policy!r} is not one of {KV_POLICIES}")
        self.policy = policy
        self.k: dict[CacheKey, Tensor] = {}
        self.v: dict[CacheKey, Tensor] = {}
        self.length = 0

    def core_key(self, layer: int, pass_idx: int) -> CacheKey:
        return ("core", layer, pass_idx) if self.policy == "per-loop" else ("core", layer)

    def get(self, key: CacheKey) -> tuple[Tensor, Tensor] | None:
        return (self.k[key], self.v[key]) if key in self.k else None

    def append(self, key: CacheKey, k_SBGd: Tensor, v_SBGd: Tensor) -> None:
        if key in self.k:
            self.k[key] = torch.cat([self.k[key], k_SBGd])
            self.v[key] = torch.cat([self.v[key], v_SBGd])
        else:
            self.k[key], self.v[key] = k_SBGd, v_SBGd

    def nbytes(self, part: CachePart = "all") -> int:
        """Bytes the cache holds: every layer's, or (``part="core"``) the looped core layers' only."""
        keys = [key for key in self.k if part == "all" or key[0] == part]
        return sum(t.numel() * t.element_size() for key in keys for t in (self.k[key], self.v[key]))

    def bytes_per_token(self, part: CachePart = "all") -> float:
        """Measured cache bytes per cached token of one sequence (``part="core"``: the core layers' share)."""
        if not self.k or self.length == 0:
            return 0.0
        batch = next(iter(self.k.values())).shape[1]
        return self.nbytes(part) / (self.length * batch)


# ---------------------------------------------------------------------------------------------------
# One attention half against a cache
def cached_attention(
    layer: Any,
    h_SBD: Tensor,
    rope_S11d: Tensor,
    past: tuple[Tensor, Tensor] | None,
    frozen: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The attention half of a megatron ``TransformerLayer`` for S new tokens after P cached ones.

    Returns the hidden state after attention + residual and the K/V the step contributed
    (``[S, B, G, d]``). ``frozen = (mask_SB, k_SBGd, v_SBGd)`` replaces the K/V of masked tokens
    (stopped by adaptive depth) with their frozen K/V.
    """
    attn = layer.self_attention
    residual = h_SBD
    x_SBD = layer.input_layernorm(h_SBD)
    q_SBHd, k_SBGd, v_SBGd = attn.get_query_key_value_tensors(x_SBD, None)
    cp = attn.pg_collection.cp
    q_SBHd = apply_rotary_pos_emb(q_SBHd, rope_S11d, config=attn.config, cp_group=cp)
    k_SBGd = apply_rotary_pos_emb(k_SBGd, rope_S11d, config=attn.config, cp_group=cp)
    if frozen is not None:
        mask = frozen[0][:, :, None, None]
        k_SBGd = torch.where(mask, frozen[1], k_SBGd)
        v_SBGd = torch.where(mask, frozen[2], v_SBGd)
    keys, values = (k_SBGd, v_SBGd) if past is None else (torch.cat([past[0], k_SBGd]), torch.cat([past[1], v_SBGd]))
    ctx_SBD = causal_softmax_attention(q_SBHd, keys, values, scale=attn.core_attention.softmax_scale)
    out_with_bias = attn.linear_proj(ctx_SBD)
    with layer.bias_dropout_add_exec_handler():
        h_SBD = layer.self_attn_bda(layer.training, layer.config.bias_dropout_fusion)(
            out_with_bias, residual, layer.hidden_dropout
        )
    return h_SBD, k_SBGd, v_SBGd


def causal_softmax_attention(q_SBHd: Tensor, k_KBGd: Tensor, v_KBGd: Tensor, *, scale: float) -> Tensor:
    """softmax(q kᵀ · scale) v, query s (the last S of K positions) seeing keys 0..K−S+s. → ``[S, B, H·d]``."""
    s, b, h, d = q_SBHd.shape
    n_keys, groups = k_KBGd.shape[0], k_KBGd.shape[2]
    q = q_SBHd.permute(1, 2, 0, 3)  # B H S d
    k = k_KBGd.permute(1, 2, 0, 3).repeat_interleave(h // groups, dim=1)
    v = v_KBGd.permute(1, 2, 0, 3).repeat_interleave(h // groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    pos_q = torch.arange(n_keys - s, n_keys, device=q.device)[:, None]
    allowed = torch.arange(n_keys, device=q.device)[None, :] <= pos_q
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).to(v.dtype)
    return torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, h * d)


def core_mlp(core: CoreLayer, h_SBD: Tensor, pass_idx: int, replay: bool) -> Tensor:
    """The shared MoE MLP half of core layer i at pass j, with route replay as in ``CoreLayer.forward``."""
    router = getattr(core.shared_mlp, "router", None)
    rr = getattr(router, "router_replay", None)
    if replay and rr is not None:  # ELR route replay: pass 0 records, later passes reuse its top-k
        if pass_idx == 0:
            rr.clear_indices()
            rr.set_router_replay_action(RouterReplayAction.RECORD)
        else:
            rr.target_topk_idx = rr.recorded_topk_idx
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        out: Tensor = core.full_layer._forward_mlp(h_SBD)
        return out
    finally:
        if rr is not None:
            rr.clear_router_replay_action()


# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepOutput:
    logits_BSV: Tensor
    passes_BS: Tensor  # core passes each token ran
    hidden_BSD: Tensor | None = None  # final-norm output (for callers that need it)


class LoopedDecoder:
    """Stateful incremental decoder: feed tokens with :meth:`step`, read logits of each fed token.

    ``loops`` is the number of passes (fixed depth), or the cap under adaptive depth (``stop``); the
    loop-conditioning target (when active) is ``loops``.
    """

    def __init__(
        self,
        model: LoopedMoEModel,
        *,
        loops: int | None = None,
        kv_cache: KVPolicy = "per-loop",
        stop: StopFn | None = None,
    ) -> None:
        tconf = model.config
        if tconf.tensor_model_parallel_size != 1 or tconf.expert_model_parallel_size != 1:
            raise ValueError("incremental decoding runs on one process: tensor and expert parallel size must be 1")
        self.model = model
        self.loops = model.cfg.max_loops if loops is None else loops
        model.cfg.check_loops(self.loops)
        self.cache = KVCache(kv_cache)
        self.stop = stop

    @property
    def position(self) -> int:
        return self.cache.length

    @torch.no_grad()
    def step(self, ids_BS: Tensor) -> StepOutput:
        """Logits ``[B, S, V]`` of the S new tokens. ``last-loop`` runs them one by one (each token's
        later passes need the *last-pass* K/V of every earlier token, so a step cannot be parallel)."""
        if ids_BS.dim() != 2 or ids_BS.shape[1] < 1:
            raise ValueError(f"step expects token ids [B, S>=1], got shape {tuple(ids_BS.shape)}")
        if self.cache.policy == "last-loop" and ids_BS.shape[1] > 1:
            outs = [self._chunk(ids_BS[:, t : t + 1]) for t in range(ids_BS.shape[1])]
            return StepOutput(torch.cat([o.logits_BSV for o in outs], 1), torch.cat([o.passes_BS for o in outs], 1))
        return self._chunk(ids_BS)

    @torch.no_grad()
    def prefill(self, ids_BS: Tensor) -> StepOutput:
        """Parallel prefill of a prompt (first call only): its S tokens in one step, with per-loop semantics
        among them (pass j attends to the prompt's pass-j K/V); the cache keeps what its policy keeps —
        under ``last-loop`` only each prompt token's last-pass K/V."""
        if self.cache.length:
            raise ValueError("prefill: the decoder has already seen tokens; prefill the prompt first, then step")
        if ids_BS.dim() != 2 or ids_BS.shape[1] < 1:
            raise ValueError(f"prefill expects token ids [B, S>=1], got shape {tuple(ids_BS.shape)}")
        return self._chunk(ids_BS)

    def _chunk(self, ids_BS: Tensor) -> StepOutput:
        model, cache = self.model, self.cache
        p0, s = cache.length, ids_BS.shape[1]
        rope = model.rotary_pos_emb(p0 + s)[p0:]
        emb_SBD = model.embedding(input_ids=ids_BS, position_ids=None)
        h_SBD = self._edge(model.prelude, "prelude", emb_SBD, rope)
        h_SBD, passes_SB = self._core(h_SBD, emb_SBD, rope)
        h_SBD = model.final_layernorm(self._edge(model.coda, "coda", h_SBD, rope))
        cache.length += s
        logits_SBV = model.logits(h_SBD)[..., : model.cfg.vocab_size]
        return StepOutput(logits_SBV.transpose(0, 1).contiguous(), passes_SB.t().contiguous())

    def _edge(self, layers: Iterable[Any], name: str, h_SBD: Tensor, rope: Tensor) -> Tensor:
        for i, layer in enumerate(layers):
            h_SBD, k, v = cached_attention(layer, h_SBD, rope, self.cache.get((name, i)))
            self.cache.append((name, i), k, v)
            h_SBD = layer._forward_mlp(h_SBD)
        return h_SBD

    def _core(self, h_SBD: Tensor, emb_SBD: Tensor, rope: Tensor) -> tuple[Tensor, Tensor]:
        model, cache = self.model, self.cache
        cores = model.core_layers()
        conditioning = model.loop_conditioning if model.conditioning_active else None
        active_SB = torch.ones(h_SBD.shape[:2], dtype=torch.bool, device=h_SBD.device)
        passes_SB = torch.zeros(h_SBD.shape[:2], dtype=torch.long, device=h_SBD.device)
        last: list[tuple[Tensor, Tensor] | None] = [None] * len(cores)  # each token's latest K/V per layer
        per_pass: dict[CacheKey, tuple[Tensor, Tensor]] = {}
        for j in range(self.loops):
            if not bool(active_SB.any()):
                break
            x_SBD = h_SBD if conditioning is None else h_SBD + conditioning(self.loops, j).to(h_SBD.dtype)
            for i, core in enumerate(cores):
                prev = last[i]
                frozen = None if prev is None or bool(active_SB.all()) else (~active_SB, prev[0], prev[1])
                x_SBD, k, v = cached_attention(
                    core.attention_for(j), x_SBD, rope, cache.get(cache.core_key(i, j)), frozen
                )
                x_SBD = core_mlp(core, x_SBD, j, model.cfg.route_replay)
                last[i] = (k, v)
                per_pass[("core", i, j)] = (k, v)
            h_SBD = torch.where(active_SB[..., None], x_SBD, h_SBD)  # stopped tokens stay frozen
            passes_SB += active_SB.long()
            if self.stop is not None and j + 1 < self.loops:
                active_SB = active_SB & ~self.stop(h_SBD, emb_SBD, j)
        for i in range(len(cores)):
            final = last[i]
            assert final is not None
            if cache.policy == "last-loop":
                cache.append(("core", i), *final)
            else:  # passes a token skipped hold its frozen K/V (what the others attended to)
                for j in range(self.loops):
                    cache.append(("core", i, j), *per_pass.get(("core", i, j), final))
        return h_SBD, passes_SB


# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TeacherForced:
    """Teacher-forced held-out result of one decoding configuration."""

    policy: KVPolicy
    loops: int
    loss: float
    mean_passes: float
    tokens: int
    kv_bytes_per_token: float
    accuracy: float = float("nan")  # next-token argmax accuracy
    core_kv_bytes_per_token: float = float("nan")  # the looped core layers' share of kv_bytes_per_token
    # core passes per scored token, [N, scored positions] on the host (``keep_passes=True`` only)
    passes_NT: Tensor | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@torch.no_grad()
def teacher_forced_loss(
    model: LoopedMoEModel,
    tokens_NT1: Tensor,
    *,
    loops: int | None = None,
    kv_cache: KVPolicy = "per-loop",
    stop: StopFn | None = None,
    batch_size: int = 8,
    prompt_len: int = 0,
    keep_passes: bool = False,
) -> TeacherForced:
    """Mean per-token CE of ``tokens[:, 1:]`` decoding ``tokens[:, :-1]`` under a cache policy.

    ``per-loop`` feeds each sequence as one step (exactly the model's forward at fixed depth);
    ``last-loop`` decodes token by token (see :meth:`LoopedDecoder.step`). ``prompt_len`` P > 0: the
    first P tokens are a prompt, prefilled in parallel (:meth:`LoopedDecoder.prefill`), and only the
    continuation ``tokens[:, P:]`` is scored. ``keep_passes``: also return each scored token's passes
    (``passes_NT``, aligned with the scored labels: without a prompt, position t predicts ``tokens[:, t + 1]``).
    """
    if not 0 <= prompt_len < tokens_NT1.shape[1] - 1:
        raise ValueError(f"prompt_len: {prompt_len} leaves no continuation to score in {tokens_NT1.shape[1]} tokens")
    was_training = model.training
    model.eval()
    total, count, passes, kv_bytes, core_bytes, correct = 0.0, 0, 0.0, 0.0, 0.0, 0
    kept: list[Tensor] = []
    try:
        for start in range(0, tokens_NT1.shape[0], batch_size):
            chunk = tokens_NT1[start : start + batch_size].to(_device(model))  # host rows → the model's device
            dec = LoopedDecoder(model, loops=loops, kv_cache=kv_cache, stop=stop)
            if prompt_len:
                first = dec.prefill(chunk[:, :prompt_len])
                rest = dec.step(chunk[:, prompt_len:-1])
                out = StepOutput(
                    torch.cat([first.logits_BSV[:, -1:], rest.logits_BSV], 1),
                    torch.cat([first.passes_BS[:, -1:], rest.passes_BS], 1),
                )
            else:
                out = dec.step(chunk[:, :-1])
            labels = chunk[:, 1 + max(prompt_len - 1, 0) :]
            ce = F.cross_entropy(out.logits_BSV.float().flatten(0, 1), labels.flatten(), reduction="sum")
            total += float(ce)
            correct += int((out.logits_BSV.argmax(-1) == labels).sum())
            count += labels.numel()
            passes += float(out.passes_BS.double().sum())
            if keep_passes:
                kept.append(out.passes_BS.cpu())
            kv_bytes, core_bytes = dec.cache.bytes_per_token(), dec.cache.bytes_per_token("core")
    finally:
        model.train(was_training)
    ell = model.cfg.max_loops if loops is None else loops
    return TeacherForced(
        policy=kv_cache,
        loops=ell,
        loss=total / count,
        mean_passes=passes / count,
        tokens=count,
        kv_bytes_per_token=kv_bytes,
        accuracy=correct / count,
        core_kv_bytes_per_token=core_bytes,
        passes_NT=torch.cat(kept) if keep_passes else None,
    )


# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Generation:
    tokens_BT: Tensor  # prompt + generated
    passes_BN: Tensor  # core passes per generated token
    kv_bytes_per_token: float


@torch.no_grad()
def generate(
    model: LoopedMoEModel,
    prompt_ids: Tensor | list[int],
    *,
    loops: int | Literal["auto"] | None = None,
    max_new_tokens: int = 64,
    kv_cache: KVPolicy = "last-loop",
    temperature: float = 0.0,
    stop: StopFn | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Greedy (``temperature`` 0) or sampled decoding at ``loops`` passes, or ``"auto"``: up to L_max
    passes per token, stopping where ``stop`` says (the decider: ``IterationDecider.stopper``).

    Sequences stop being extended after ``eos_id`` (they are padded with it).
    """
    ids_BP = torch.tensor([prompt_ids], dtype=torch.long) if isinstance(prompt_ids, list) else prompt_ids
    ids_BP = ids_BP.to(_device(model))  # every tensor below lives where the model does
    if ids_BP.dim() != 2 or ids_BP.shape[1] < 1:
        raise ValueError("prompt_ids: need at least one token ([B, P] or a list of ids)")
    if loops == "auto":
        if stop is None:
            raise ValueError("loops='auto' needs a stop function (the iteration decider: decider.stopper(threshold))")
        depth = None
    else:
        depth, stop = loops, None
    was_training = model.training
    model.eval()
    try:
        dec = LoopedDecoder(model, loops=depth, kv_cache=kv_cache, stop=stop)
        out = dec.step(ids_BP)
        tokens, passes = [ids_BP], []
        done = torch.zeros(ids_BP.shape[0], dtype=torch.bool, device=ids_BP.device)
        for n in range(max_new_tokens):
            nxt_B = _sample(out.logits_BSV[:, -1].float(), temperature, generator)
            if eos_id is not None:
                nxt_B = torch.where(done, torch.full_like(nxt_B, eos_id), nxt_B)
                done = done | (nxt_B == eos_id)
            tokens.append(nxt_B[:, None])
            if n + 1 == max_new_tokens or bool(done.all()):
                break
            out = dec.step(nxt_B[:, None])
            passes.append(out.passes_BS)
    finally:
        model.train(was_training)
    passes_BN = (
        torch.cat(passes, 1) if passes else torch.zeros(ids_BP.shape[0], 0, dtype=torch.long, device=ids_BP.device)
    )
    return Generation(torch.cat(tokens, 1), passes_BN, dec.cache.bytes_per_token())


def _sample(logits_BV: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    if temperature <= 0:
        return logits_BV.argmax(-1)
    probs = torch.softmax(logits_BV / temperature, dim=-1)
    if generator is not None and generator.device != probs.device:  # a seeded CPU generator, a CUDA model:
        return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(probs.device)  # same draws
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _device(model: LoopedMoEModel) -> torch.device:
    return model.embedding.word_embeddings.weight.device
