"""The looped flattened-MoE language model, built from megatron-core modules.

Shape legend (suffixes): B batch, T sequence, D hidden, V (padded) vocabulary, E experts, L loops.
megatron-core layers work sequence-first, so hidden states inside the block are ``h_TBD``.

    embedding -> prelude (run once) -> core (run ℓ times) -> coda (run once per exit) -> norm -> head

Core layer i at pass j = attention A[i][j] (one parameter set per pass: untied, Foil §3) + the MoE
MLP M[i] (experts, router and the norm in front of it shared by every pass). The model contains no
process-group code: it receives a megatron ``TransformerConfig`` built by ``parallel/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor

from elastic_pretrain.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerSpecs:
    """megatron layer specs: ``dense`` for dense layers, ``moe`` for MoE layers."""

    dense: ModuleSpec
    moe: ModuleSpec


def attention_only(spec: ModuleSpec) -> ModuleSpec:
    """The same layer spec with no MLP half (the shared MLP of pass 0 is used instead)."""
    sub = dataclasses.replace(spec.submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp)
    return dataclasses.replace(spec, submodules=sub)


class CoreLayer(MegatronModule):
    """Core layer i: one attention per pass, one MoE MLP shared by every pass.

    ``passes[0]`` is a full megatron ``TransformerLayer`` (attention A[i][0] + shared MLP M[i]);
    ``passes[j>0]`` are attention-only layers. Each pass runs its own attention half and then the MLP
    half of ``passes[0]``, so shared parameters are registered exactly once (one gradient buffer
    entry, one checkpoint key) and receive the gradient of every pass.
    """

    def __init__(self, config: TransformerConfig, spec: ModuleSpec, *, layer_number: int, num_passes: int,
                 tied_attention: bool) -> None:
        super().__init__(config=config)
        n_attn = 1 if tied_attention else num_passes
        layers = [build_module(spec, config=config, layer_number=layer_number)]
        layers += [build_module(attention_only(spec), config=config, layer_number=layer_number)
                   for _ in range(n_attn - 1)]
        self.passes = torch.nn.ModuleList(layers)

    @property
    def shared_mlp(self) -> torch.nn.Module:
        return self.passes[0].mlp

    def attention_for(self, pass_idx: int) -> TransformerLayer:
        return self.passes[min(pass_idx, len(self.passes) - 1)]

    def forward(self, h_TBD: Tensor, *, pass_idx: int, rotary_pos_emb: Tensor | None) -> Tensor:
        h_TBD, _ = self.attention_for(pass_idx)._forward_attention(
            h_TBD, attention_mask=None, rotary_pos_emb=rotary_pos_emb
        )
        return self.passes[0]._forward_mlp(h_TBD)


class LoopedMoEModel(LanguageModule):
    """Embedding → prelude → core × ℓ → coda → norm → output layer (vocab-parallel)."""

    def __init__(self, cfg: ModelConfig, config: TransformerConfig, specs: LayerSpecs, *, padded_vocab: int) -> None:
        super().__init__(config=config)
        self.cfg = cfg
        self.padded_vocab = padded_vocab
        self.share_embeddings_and_output_weights = cfg.tie_embeddings
        self.pre_process = self.post_process = True
        self.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
        self.embedding = LanguageModelEmbedding(
            config=config, vocab_size=padded_vocab, max_sequence_length=0, position_embedding_type="rope",
            scatter_to_sequence_parallel=True,
        )
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=cfg.rope_base,
            use_cpu_initialization=config.use_cpu_initialization,
        )
        edge = specs.moe if cfg.edge_mlp == "moe" else specs.dense
        number = iter(range(1, cfg.num_unique_layers + 1))
        self.prelude = torch.nn.ModuleList(
            [build_module(edge, config=config, layer_number=next(number)) for _ in range(cfg.prelude_layers)]
        )
        self.core = torch.nn.ModuleList(
            [
                CoreLayer(config, specs.moe, layer_number=next(number), num_passes=cfg.max_loops,
                          tied_attention=cfg.attention == "tied")
                for _ in range(cfg.core_layers_built)
            ]
        )
        self.coda = torch.nn.ModuleList(
            [build_module(edge, config=config, layer_number=next(number)) for _ in range(cfg.coda_layers)]
        )
        norm_spec = specs.dense.submodules.input_layernorm
        self.final_layernorm = build_module(norm_spec, config=config, hidden_size=config.hidden_size,
                                            eps=config.layernorm_epsilon)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, padded_vocab, config=config, init_method=config.init_method, bias=False,
            skip_bias_add=False, gather_output=False, skip_weight_param_allocation=cfg.tie_embeddings,
        )
        if cfg.tie_embeddings:
            self.setup_embeddings_and_output_layer()

    # ------------------------------------------------------------------------------------------
    def set_input_tensor(self, input_tensor: Tensor | None) -> None:  # megatron schedule hook (PP=1: unused)
        self.input_tensor = input_tensor

    def run_loops(self, input_ids_BT: Tensor, *, loops: int, exits: Sequence[int]) -> dict[int, Tensor]:
        """Hidden states after the coda and final norm at each exit loop count (sequence-first)."""
        self.cfg.check_loops(loops)
        rope = self.rotary_pos_emb(input_ids_BT.shape[1])
        h_TBD = self.embedding(input_ids=input_ids_BT, position_ids=None)
        for layer in self.prelude:
            h_TBD, _ = layer(h_TBD, attention_mask=None, rotary_pos_emb=rope)
        out: dict[int, Tensor] = {}
        for j in range(loops):
            for core in self.core:
                h_TBD = core(h_TBD, pass_idx=j, rotary_pos_emb=rope)
            if j + 1 in exits:
                out[j + 1] = self._head_states(h_TBD, rope)
        return out

    def _head_states(self, h_TBD: Tensor, rope: Tensor) -> Tensor:
        for layer in self.coda:
            h_TBD, _ = layer(h_TBD, attention_mask=None, rotary_pos_emb=rope)
        return self.final_layernorm(h_TBD)

    def logits(self, h_TBD: Tensor) -> Tensor:
        """Vocab-parallel logits ``[T, B, V/tp]`` (sequence gathered under sequence parallelism)."""
        weight = self.shared_embedding_or_output_weight() if self.cfg.tie_embeddings else None
        logits_TBV, _ = self.output_layer(h_TBD, weight=weight)
        return logits_TBV

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, *, loops: int | None = None,
                exits: Sequence[int] = ()) -> dict[int, Tensor]:
        """Run ℓ = ``loops`` passes (default L_max).

        Returns ``{exit: tensor}`` for ℓ and every extra exit in ``exits`` (< ℓ): per-token losses
        ``[B, T]`` when ``labels`` are given, else full-vocabulary logits ``[B, T, V]`` (the padded
        vocabulary entries beyond ``cfg.vocab_size`` are dropped).
        """
        loops = self.cfg.max_loops if loops is None else loops
        all_exits = sorted({*exits, loops})
        if all_exits[0] < 1:
            self.cfg.check_loops(all_exits[0])
        states = self.run_loops(input_ids, loops=loops, exits=all_exits)
        out: dict[int, Tensor] = {}
        for ell, h_TBD in states.items():
            logits_TBV = self.logits(h_TBD)
            if labels is None:
                full_TBV = tensor_parallel.gather_from_tensor_model_parallel_region(logits_TBV)
                out[ell] = full_TBV[..., : self.cfg.vocab_size].transpose(0, 1).contiguous()
            else:
                out[ell] = self.compute_language_model_loss(labels, logits_TBV)
        return out
