"""A standalone PyTorch implementation of elastic-pretrain's looped flattened-MoE language model.

Copied next to the weights by ``elastic-pretrain export`` and loaded by
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``. It imports torch and
transformers only (no megatron, no elastic_pretrain) and re-implements what megatron-core computes
for the project's model (local layer spec), so its logits equal the training code's:

    embedding -> prelude (once) -> core (ℓ passes) -> coda -> final norm -> lm_head

- Attention: pre-norm, fused QKV laid out per key/value group as megatron does
  (``[G, (H/G + 2)·d]``: the group's queries, its key, its value), RoPE applied megatron's way
  (non-interleaved halves, ``cat(freqs, freqs)``, positions from 0), causal softmax with scale 1/√d.
- Core layer i at pass j: its own attention ``core.i.passes.j`` (one per pass; all passes share
  ``passes.0`` when attention is tied) and the MoE MLP of ``passes.0``, shared by every pass.
- MoE: router logits ``x Wᵀ``; top-k with megatron's score functions (softmax after top-k, or
  before it; sigmoid normalised over the top-k), optional scaling; SwiGLU experts whose activation
  is scaled by the gate before the down projection; ELR route replay (passes ≥ 1 reuse the experts
  pass 0 chose, with gates from the live logits).
- ELR loop-count conditioning (``loop_conditioning``): ``out(silu(target_emb[ℓ] + pass_emb[j]))``
  added to the residual at the entry of pass j.
- TaH2 iteration decider (``loops="auto"``): after pass j a token stops when
  ``sigmoid(decider(h, e, j)) < decider_threshold``; its state freezes and its K/V of the last pass it
  ran serve the later passes of other tokens.
- KV caches (``kv_cache``): ``per-loop`` keeps one cache per (core layer, pass) — exactly the
  full-sequence forward; ``last-loop`` (ELR) one per core layer, written by each token's last pass.

Shape legend: B batch, S new tokens, P past tokens, K key positions (P + S), D hidden, H query heads,
G key/value groups, d head width, E experts, V vocabulary, N tokens (B·S flattened).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_elastic import KV_POLICIES, ElasticLoopedConfig


def _norm(cfg: ElasticLoopedConfig) -> nn.Module:
    if cfg.normalization == "RMSNorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(t_BSHd: Tensor, freqs_Sd: Tensor) -> Tensor:
    """megatron's ``_apply_rotary_pos_emb_bshd`` (cos/sin in fp32, cast to the input dtype)."""
    f = freqs_Sd[None, :, None, :]
    return t_BSHd * torch.cos(f).to(t_BSHd.dtype) + _rotate_half(t_BSHd) * torch.sin(f).to(t_BSHd.dtype)


class LoopedKVCache:
    """K/V of past tokens per cached layer application, ``[B, P, G, d]`` each (see the module doc)."""

    def __init__(self, policy: str) -> None:
        if policy not in KV_POLICIES:
            raise ValueError(f"kv_cache: {policy!r} is not one of {KV_POLICIES}")
        self.policy = policy
        self.k: dict[tuple[Any, ...], Tensor] = {}
        self.v: dict[tuple[Any, ...], Tensor] = {}
        self.length = 0

    def core_key(self, layer: int, pass_idx: int) -> tuple[Any, ...]:
        return ("core", layer, pass_idx) if self.policy == "per-loop" else ("core", layer)

    def get(self, key: tuple[Any, ...]) -> tuple[Tensor, Tensor] | None:
        return (self.k[key], self.v[key]) if key in self.k else None

    def append(self, key: tuple[Any, ...], k_BSGd: Tensor, v_BSGd: Tensor) -> None:
        if key in self.k:
            self.k[key] = torch.cat([self.k[key], k_BSGd], dim=1)
            self.v[key] = torch.cat([self.v[key], v_BSGd], dim=1)
        else:
            self.k[key], self.v[key] = k_BSGd, v_BSGd

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))


class SelfAttention(nn.Module):
    def __init__(self, cfg: ElasticLoopedConfig) -> None:
        super().__init__()
        self.h, self.g, self.d = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
        self.linear_qkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.g) * self.d, bias=False)
        self.linear_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)

    def qkv(self, x_BSD: Tensor, freqs_Sd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, s, _ = x_BSD.shape
        per_group = self.h // self.g
        mixed = self.linear_qkv(x_BSD).view(b, s, self.g, (per_group + 2) * self.d)
        q, k, v = torch.split(mixed, [per_group * self.d, self.d, self.d], dim=-1)
        q_BSHd = q.reshape(b, s, self.h, self.d)
        return apply_rope(q_BSHd, freqs_Sd), apply_rope(k, freqs_Sd), v


def causal_attention(q_BSHd: Tensor, k_BKGd: Tensor, v_BKGd: Tensor, key_mask_BK: Tensor | None) -> Tensor:
    """softmax(q kᵀ/√d) v; query s (the last S of K positions) sees keys 0..K−S+s. → ``[B, S, H·d]``."""
    b, s, h, d = q_BSHd.shape
    n_keys, groups = k_BKGd.shape[1], k_BKGd.shape[2]
    q = q_BSHd.transpose(1, 2)
    k = k_BKGd.transpose(1, 2).repeat_interleave(h // groups, dim=1)
    v = v_BKGd.transpose(1, 2).repeat_interleave(h // groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * (d**-0.5)
    pos_q = torch.arange(n_keys - s, n_keys, device=q.device)[:, None]
    allowed = torch.arange(n_keys, device=q.device)[None, :] <= pos_q  # [S, K]
    if key_mask_BK is not None:  # padding: keys whose mask is 0 are never attended to
        allowed = allowed[None, None] & key_mask_BK[:, None, None, :].bool()
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0).to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h * d)


class MLP(nn.Module):
    """SwiGLU: ``fc2(silu(gate) · up · scale)`` with ``fc1 = [gate; up]`` (megatron's glu)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor, scale_N: Tensor | None = None) -> Tensor:
        gate, up = torch.chunk(self.linear_fc1(x), 2, dim=-1)
        inter = F.silu(gate) * up
        if scale_N is not None:  # the MoE gate, applied before fc2 as megatron's experts do
            inter = (inter * scale_N[:, None]).to(inter.dtype)
        out: Tensor = self.linear_fc2(inter)
        return out


class Router(nn.Module):
    def __init__(self, cfg: ElasticLoopedConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))


class Experts(nn.Module):
    def __init__(self, cfg: ElasticLoopedConfig) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(
            [MLP(cfg.hidden_size, cfg.moe_ffn_hidden_size) for _ in range(cfg.num_experts)]
        )


def route(logits_NE: Tensor, cfg: ElasticLoopedConfig, replay_NK: Tensor | None) -> tuple[Tensor, Tensor]:
    """(gates ``[N, k]``, experts ``[N, k]``): megatron's ``topk_routing_with_score_function``."""
    k = cfg.moe_top_k

    def topk(scores: Tensor) -> tuple[Tensor, Tensor]:
        if replay_NK is not None:  # route replay: the recorded experts, scores read at them
            return scores.gather(1, replay_NK), replay_NK
        values, idx = torch.topk(scores, k=k, dim=1)
        return values, idx

    if cfg.router_score_function == "softmax":
        if cfg.router_pre_softmax:
            probs, idx = topk(torch.softmax(logits_NE, dim=-1, dtype=torch.float32).type_as(logits_NE))
        else:
            scores, idx = topk(logits_NE)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits_NE)
    elif cfg.router_score_function == "sigmoid":
        scores, idx = topk(torch.sigmoid(logits_NE.float()).type_as(logits_NE))
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else scores
    else:
        raise ValueError(f"router_score_function: {cfg.router_score_function!r} is not 'softmax' or 'sigmoid'")
    if cfg.router_topk_scaling_factor:
        probs = probs * cfg.router_topk_scaling_factor
    return probs, idx


class MoE(nn.Module):
    def __init__(self, cfg: ElasticLoopedConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x_BSD: Tensor, replay_NK: Tensor | None = None) -> tuple[Tensor, Tensor]:
        x_ND = x_BSD.reshape(-1, x_BSD.shape[-1])
        probs_NK, idx_NK = route(F.linear(x_ND, self.router.weight), self.cfg, replay_NK)
        out_ND = torch.zeros_like(x_ND)
        for e, expert in enumerate(self.experts.local_experts):  # expert-major, like megatron's permutation
            rows, slot = torch.nonzero(idx_NK == e, as_tuple=True)
            if rows.numel():
                out_ND.index_add_(0, rows, expert(x_ND[rows], probs_NK[rows, slot]))
        return out_ND.view_as(x_BSD), idx_NK


class Layer(nn.Module):
    """megatron ``TransformerLayer``: h + attn(norm(h)), then h + mlp(norm(h)). ``mlp=None``: the
    attention half only (a core layer's pass j > 0, whose MLP is pass 0's)."""

    def __init__(self, cfg: ElasticLoopedConfig, mlp: str | None) -> None:
        super().__init__()
        self.input_layernorm = _norm(cfg)
        self.self_attention = SelfAttention(cfg)
        if mlp is not None:
            self.pre_mlp_layernorm = _norm(cfg)
            self.mlp: nn.Module = MoE(cfg) if mlp == "moe" else MLP(cfg.hidden_size, cfg.ffn_hidden_size)

    def attend(
        self,
        h_BSD: Tensor,
        freqs_Sd: Tensor,
        past: tuple[Tensor, Tensor] | None,
        frozen: tuple[Tensor, Tensor, Tensor] | None,
        key_mask_BK: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Attention half for S new tokens after the cached ones; also returns the step's K/V.
        ``frozen = (mask_BS, k, v)``: tokens stopped by adaptive depth contribute their frozen K/V."""
        q, k, v = self.self_attention.qkv(self.input_layernorm(h_BSD), freqs_Sd)
        if frozen is not None:
            mask = frozen[0][:, :, None, None]
            k, v = torch.where(mask, frozen[1], k), torch.where(mask, frozen[2], v)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        return h_BSD + self.self_attention.linear_proj(causal_attention(q, keys, values, key_mask_BK)), k, v

    def mlp_half(self, h_BSD: Tensor, replay_NK: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        x = self.pre_mlp_layernorm(h_BSD)
        if isinstance(self.mlp, MoE):
            out, idx = self.mlp(x, replay_NK)
            return h_BSD + out, idx
        return h_BSD + self.mlp(x), None


class CoreLayer(nn.Module):
    def __init__(self, cfg: ElasticLoopedConfig) -> None:
        super().__init__()
        n_attn = 1 if cfg.attention == "tied" else cfg.max_loops
        self.passes = nn.ModuleList([Layer(cfg, "moe")] + [Layer(cfg, None) for _ in range(n_attn - 1)])

    def attention_for(self, pass_idx: int) -> Layer:
        return cast(Layer, self.passes[min(pass_idx, len(self.passes) - 1)])

    def mlp_half(self, h_BSD: Tensor, replay_NK: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The shared MoE MLP half (held by ``passes.0``), for any pass."""
        return cast(Layer, self.passes[0]).mlp_half(h_BSD, replay_NK)


class LoopConditioning(nn.Module):
    """ELR: (target ℓ, pass j) → a vector added to the residual at the entry of pass j."""

    def __init__(self, cfg: ElasticLoopedConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.target_emb = nn.Embedding(cfg.max_loops + 1, d)
        self.pass_emb = nn.Embedding(cfg.max_loops, d)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, target_loops: int, pass_idx: int) -> Tensor:
        z_D = self.target_emb.weight[target_loops] + self.pass_emb.weight[pass_idx]
        out: Tensor = self.out(F.silu(z_D))
        return out


class IterationDecider(nn.Module):
    """TaH2: (h after pass j, token embedding, j) → continue logit."""

    def __init__(self, cfg: ElasticLoopedConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, int(cfg.decider_hidden_size or 1)
        self.norm_h = nn.LayerNorm(d)
        self.norm_e = nn.LayerNorm(d)
        self.fc1 = nn.Linear(2 * d, hd)
        self.pass_emb = nn.Embedding(cfg.max_loops, hd)
        self.fc2 = nn.Linear(hd, 1)

    def forward(self, h_BSD: Tensor, emb_BSD: Tensor, pass_idx: int) -> Tensor:
        z = torch.cat([self.norm_h(h_BSD.float()), self.norm_e(emb_BSD.float())], dim=-1)
        z = F.silu(self.fc1(z) + self.pass_emb.weight[pass_idx])
        out: Tensor = self.fc2(z)[..., 0]
        return out


class _Embedding(nn.Module):
    def __init__(self, cfg: ElasticLoopedConfig) -> None:
        super().__init__()
        self.word_embeddings: nn.Module = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class ElasticLoopedPreTrainedModel(PreTrainedModel):
    config_class = ElasticLoopedConfig  # type: ignore[assignment]
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["CoreLayer", "Layer"]  # noqa: RUF012 (transformers API)

    def _init_weights(self, module: nn.Module) -> None:
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if isinstance(module, nn.Linear | nn.Embedding | Router) and isinstance(weight, Tensor):
            weight.data.normal_(0.0, 0.02)
        elif isinstance(module, nn.RMSNorm | nn.LayerNorm) and isinstance(weight, Tensor):
            weight.data.fill_(1.0)
        if isinstance(bias, Tensor):
            bias.data.zero_()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the looped model brings its own caches (LoopedKVCache)


class ElasticLoopedModel(ElasticLoopedPreTrainedModel):
    """Everything up to the final norm; :meth:`decode` runs S new tokens against a cache."""

    inv_freq: Tensor

    def __init__(self, config: ElasticLoopedConfig) -> None:
        super().__init__(config)
        cfg = config
        self.embedding = _Embedding(cfg)
        self.prelude = nn.ModuleList([Layer(cfg, cfg.edge_mlp) for _ in range(cfg.prelude_layers)])
        self.core = nn.ModuleList([CoreLayer(cfg) for _ in range(cfg.core_layers)])
        self.coda = nn.ModuleList([Layer(cfg, cfg.edge_mlp) for _ in range(cfg.coda_layers)])
        self.loop_conditioning = LoopConditioning(cfg) if cfg.loop_conditioning else None
        self.decider = IterationDecider(cfg) if cfg.decider_hidden_size else None
        self.final_layernorm = _norm(cfg)
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.post_init()

    def rope(self, start: int, end: int) -> Tensor:
        seq = torch.arange(start, end, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(seq, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)

    def decode(
        self,
        ids_BS: Tensor,
        cache: LoopedKVCache,
        *,
        loops: int,
        stop_threshold: float | None = None,
        key_mask_BK: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(final-norm states ``[B, S, D]``, passes per token ``[B, S]``) of S new tokens.

        ``last-loop`` runs them one by one: each token's later passes need the last-pass K/V of every
        earlier token, so a step of several tokens cannot run in parallel."""
        if cache.policy == "last-loop" and ids_BS.shape[1] > 1:
            outs = []
            for t in range(ids_BS.shape[1]):
                mask = None if key_mask_BK is None else key_mask_BK[:, : cache.length + 1]
                outs.append(self._chunk(ids_BS[:, t : t + 1], cache, loops, stop_threshold, mask))
            return torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)
        return self._chunk(ids_BS, cache, loops, stop_threshold, key_mask_BK)

    def _chunk(
        self, ids_BS: Tensor, cache: LoopedKVCache, loops: int, stop_threshold: float | None, key_mask_BK: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        p0, s = cache.length, ids_BS.shape[1]
        freqs_Sd = self.rope(p0, p0 + s)
        emb_BSD = self.embedding.word_embeddings(ids_BS)
        h_BSD = self._edge(self.prelude, "prelude", emb_BSD, freqs_Sd, cache, key_mask_BK)
        h_BSD, passes_BS = self._core(h_BSD, emb_BSD, freqs_Sd, cache, loops, stop_threshold, key_mask_BK)
        h_BSD = self.final_layernorm(self._edge(self.coda, "coda", h_BSD, freqs_Sd, cache, key_mask_BK))
        cache.length += s
        return h_BSD, passes_BS

    def _edge(
        self,
        layers: nn.ModuleList,
        name: str,
        h_BSD: Tensor,
        freqs_Sd: Tensor,
        cache: LoopedKVCache,
        key_mask_BK: Tensor | None,
    ) -> Tensor:
        for i, module in enumerate(layers):
            layer = cast(Layer, module)
            h_BSD, k, v = layer.attend(h_BSD, freqs_Sd, cache.get((name, i)), None, key_mask_BK)
            cache.append((name, i), k, v)
            h_BSD, _ = layer.mlp_half(h_BSD)
        return h_BSD

    def _core(
        self,
        h_BSD: Tensor,
        emb_BSD: Tensor,
        freqs_Sd: Tensor,
        cache: LoopedKVCache,
        loops: int,
        stop_threshold: float | None,
        key_mask_BK: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        cfg = self.config
        active_BS = torch.ones(h_BSD.shape[:2], dtype=torch.bool, device=h_BSD.device)
        passes_BS = torch.zeros(h_BSD.shape[:2], dtype=torch.long, device=h_BSD.device)
        last: list[tuple[Tensor, Tensor] | None] = [None] * len(self.core)  # each token's latest K/V per layer
        per_pass: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}
        routes: list[Tensor | None] = [None] * len(self.core)  # route replay: pass-0 experts per layer
        for j in range(loops):
            if not bool(active_BS.any()):
                break
            x_BSD = h_BSD
            if self.loop_conditioning is not None:
                x_BSD = h_BSD + self.loop_conditioning(loops, j).to(h_BSD.dtype)
            for i, module in enumerate(self.core):
                core = cast(CoreLayer, module)
                prev = last[i]
                frozen = None if prev is None or bool(active_BS.all()) else (~active_BS, prev[0], prev[1])
                x_BSD, k, v = core.attention_for(j).attend(
                    x_BSD, freqs_Sd, cache.get(cache.core_key(i, j)), frozen, key_mask_BK
                )
                replay = routes[i] if cfg.route_replay and j > 0 else None
                x_BSD, idx = core.mlp_half(x_BSD, replay)
                if j == 0:
                    routes[i] = idx
                last[i] = (k, v)
                per_pass[("core", i, j)] = (k, v)
            h_BSD = torch.where(active_BS[..., None], x_BSD, h_BSD)  # stopped tokens stay frozen
            passes_BS += active_BS.long()
            if stop_threshold is not None and j + 1 < loops:
                assert self.decider is not None
                cont = torch.sigmoid(self.decider(h_BSD, emb_BSD, j))
                active_BS = active_BS & ~(cont < stop_threshold)
        for i in range(len(self.core)):
            final = last[i]
            assert final is not None
            if cache.policy == "last-loop":
                cache.append(("core", i), *final)
            else:  # passes a token skipped hold its frozen K/V (what the others attended to)
                for j in range(loops):
                    cache.append(("core", i, j), *per_pass.get(("core", i, j), final))
        return h_BSD, passes_BS


@dataclasses.dataclass
class ElasticCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` + the core passes each token ran (``[B, S]``)."""

    passes: torch.LongTensor | None = None


class ElasticLoopedForCausalLM(ElasticLoopedPreTrainedModel, GenerationMixin):  # type: ignore[misc]
    _tied_weights_keys = ["lm_head.weight"]  # type: ignore[assignment]  # noqa: RUF012 (transformers API)

    def __init__(self, config: ElasticLoopedConfig) -> None:
        super().__init__(config)
        self.model = ElasticLoopedModel(config)
        self.lm_head: nn.Module = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embedding.word_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embedding.word_embeddings = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def depth(self, loops: int | str | None, threshold: float | None) -> tuple[int, float | None]:
        """(passes, stop threshold or None) for a ``loops`` argument: an int, ``"auto"``, or None (config)."""
        cfg = self.config
        loops = cfg.loops if loops is None else loops
        if loops == "auto":
            if self.model.decider is None:
                raise ValueError("loops='auto' needs the iteration decider; this export has none: pass a loop count")
            return cfg.max_loops, cfg.decider_threshold if threshold is None else threshold
        loops = int(loops)
        if not 1 <= loops <= cfg.max_loops:
            raise ValueError(f"loops={loops} is outside [1, {cfg.max_loops}]: pick a loop count in that range")
        return loops, None

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Tensor | None = None,
        past_key_values: LoopedKVCache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        loops: int | str | None = None,
        kv_cache: str | None = None,
        decider_threshold: float | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> ElasticCausalLMOutput:
        """Logits ``[B, S, V]`` of ``input_ids`` (the new tokens when ``past_key_values`` is given).

        ``loops``: passes per token (default ``config.loops``), or ``"auto"`` (iteration decider, up to
        ``max_loops``). ``kv_cache``: ``per-loop`` (exact: equals the full-sequence forward) or
        ``last-loop`` (ELR). ``attention_mask`` ``[B, P + S]``: 0 marks padding keys (positions stay
        absolute: right padding is exact, left padding shifts RoPE positions).
        """
        depth, threshold = self.depth(loops, decider_threshold)
        cache = past_key_values if isinstance(past_key_values, LoopedKVCache) else None
        policy = kv_cache or (cache.policy if cache is not None else self.config.kv_cache)
        if cache is not None and cache.policy != policy:
            raise ValueError(f"kv_cache={policy!r} but past_key_values is a {cache.policy!r} cache")
        cache = cache if cache is not None else LoopedKVCache(policy)
        key_mask = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            key_mask = attention_mask.bool()
        h_BSD, passes_BS = self.model.decode(
            input_ids, cache, loops=depth, stop_threshold=threshold, key_mask_BK=key_mask
        )
        logits_BSV = self.lm_head(h_BSD)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits_BSV[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        fields: dict[str, Any] = {
            "loss": loss,
            "logits": logits_BSV,
            "passes": passes_BS,
            "past_key_values": cache if use_cache else None,
        }  # our own cache class
        return ElasticCausalLMOutput(**fields)

    def prepare_inputs_for_generation(  # type: ignore[override]
        self,
        input_ids: torch.LongTensor,
        past_key_values: Any = None,
        attention_mask: Tensor | None = None,
        loops: int | str | None = None,
        kv_cache: str | None = None,
        decider_threshold: float | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        new_ids: Tensor = input_ids
        if isinstance(past_key_values, LoopedKVCache):
            new_ids = input_ids[:, past_key_values.length :]  # only the tokens not yet cached
        else:
            past_key_values = None
        return {
            "input_ids": new_ids,
            "past_key_values": past_key_values,
            "attention_mask": attention_mask,
            "use_cache": True,
            "loops": loops,
            "kv_cache": kv_cache,
            "decider_threshold": decider_threshold,
        }
