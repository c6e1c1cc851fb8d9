"""Configuration of an exported elastic-pretrain looped MoE model (Hugging Face ``PretrainedConfig``).

This file is copied next to the weights by ``elastic-pretrain export`` and loaded by
``AutoConfig.from_pretrained(DIR, trust_remote_code=True)``: it imports only ``transformers``.
Every field is the *built* shape of the model (after flattening), not the reference shape of the
training job: ``core_layers`` layers, ``num_experts`` experts each, up to ``max_loops`` passes.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

KV_POLICIES = ("per-loop", "last-loop")


class ElasticLoopedConfig(PretrainedConfig):
    model_type = "elastic_looped"
    keys_to_ignore_at_inference = ["past_key_values"]  # noqa: RUF012 (transformers API)

    def __init__(
        self,
        vocab_size: int = 257,
        hidden_size: int = 64,
        num_attention_heads: int = 4,
        num_query_groups: int | None = None,
        ffn_hidden_size: int = 256,
        moe_ffn_hidden_size: int = 64,
        num_experts: int = 4,
        moe_top_k: int = 2,
        prelude_layers: int = 0,
        core_layers: int = 2,
        coda_layers: int = 0,
        max_loops: int = 2,
        loops: int | str | None = None,
        attention: str = "untied",
        edge_mlp: str = "dense",
        normalization: str = "RMSNorm",
        norm_eps: float = 1e-5,
        rope_base: float = 10000.0,
        route_replay: bool = False,
        router_score_function: str = "softmax",
        router_pre_softmax: bool = False,
        router_topk_scaling_factor: float | None = None,
        loop_conditioning: bool = False,
        decider_hidden_size: int | None = None,
        decider_threshold: float = 0.5,
        kv_cache: str = "per-loop",
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_query_groups = num_query_groups or num_attention_heads
        self.ffn_hidden_size = ffn_hidden_size
        self.moe_ffn_hidden_size = moe_ffn_hidden_size
        self.num_experts = num_experts
        self.moe_top_k = moe_top_k
        self.prelude_layers = prelude_layers
        self.core_layers = core_layers
        self.coda_layers = coda_layers
        self.max_loops = max_loops
        # default passes per token: an int in [1, max_loops], or "auto" (the iteration decider decides)
        self.loops = max_loops if loops is None else loops
        self.attention = attention  # "untied": one attention per pass (Foil); "tied": one for all passes
        self.edge_mlp = edge_mlp  # MLP of prelude/coda layers: "dense" (SwiGLU) or "moe"
        self.normalization = normalization
        self.norm_eps = norm_eps
        self.rope_base = rope_base
        self.route_replay = route_replay  # ELR: passes >= 1 reuse pass-0 experts, gates stay live
        self.router_score_function = router_score_function
        self.router_pre_softmax = router_pre_softmax
        self.router_topk_scaling_factor = router_topk_scaling_factor
        self.loop_conditioning = loop_conditioning  # ELR (target ℓ, pass j) head present and switched on
        self.decider_hidden_size = decider_hidden_size  # TaH2 iteration decider (None: none exported)
        self.decider_threshold = decider_threshold
        self.kv_cache = kv_cache
        self.use_cache = use_cache
        if kv_cache not in KV_POLICIES:
            raise ValueError(f"kv_cache: {kv_cache!r} is not one of {KV_POLICIES}")
        if self.loops != "auto" and not 1 <= int(self.loops) <= max_loops:
            raise ValueError(f"loops={self.loops} is outside [1, {max_loops}]: pick a loop count in range, or 'auto'")
        if self.loops == "auto" and decider_hidden_size is None:
            raise ValueError("loops='auto' needs an iteration decider; this model has none: pick a loop count")
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
