"""Shared by the export tests: tiny looped models with every optional part switched on, exported into
a temporary folder, and the transformers model loaded from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from elastic_pretrain.data.config import TokenizerConfig
from elastic_pretrain.model.config import DeciderConfig, ModelConfig
from elastic_pretrain.parallel.mesh import ParallelConfig

PAR = ParallelConfig()
# fp32. The exported model computes what megatron computes, in another order of reductions (batch-first
# matmuls, attention scale applied after QKᵀ instead of inside baddbmm, experts gathered by index):
# measured differences are ~1e-7 on logits of magnitude ~1, so 1e-5 leaves two orders of margin.
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny(**kw: Any) -> ModelConfig:
    base = dict(
        hidden_size=32, num_heads=4, ffn_hidden_size=64, core_layers=2, num_experts=4, loops=2, flatten=2,
        moe_top_k=2, moe_ffn_hidden_size=32, prelude_layers=1, coda_layers=1, moe_z_loss_coeff=0.0,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})


def build(
    cfg: ModelConfig, *, decider: DeciderConfig | None = None, conditioning: bool = True, seed: int = 0, **tconfig: Any
) -> Any:
    """A one-process model in eval mode; ``tconfig``: megatron TransformerConfig overrides (router
    settings the job config does not expose). Conditioning heads on and non-zero, like a mixed-phase run."""
    from elastic_pretrain.model.looped import LoopedMoEModel
    from elastic_pretrain.model.vocab import padded_vocab_size
    from elastic_pretrain.parallel.megatron import layer_specs, transformer_config

    torch.manual_seed(seed)
    tc = dataclasses.replace(transformer_config(cfg, PAR), **tconfig)
    net = LoopedMoEModel(cfg, tc, layer_specs(cfg), padded_vocab=padded_vocab_size(cfg.vocab_size, 1),
                         decider=decider)  # fmt: skip
    net.set_vocab_shard(0, net.padded_vocab)
    if conditioning and net.loop_conditioning is not None:
        net.set_modes(conditioning=True)
        with torch.no_grad():
            net.loop_conditioning.out.weight.normal_(0.0, 0.1)  # zero-init: make it matter
    return net.eval()


def export(
    net: Any, out: Path, *, decider: DeciderConfig | None = None, tokenizer: TokenizerConfig | None = None
) -> Any:
    """Export ``net`` and load it back with transformers (trust_remote_code)."""
    from elastic_pretrain.export.hf_export import write_export

    write_export(net, tokenizer or TokenizerConfig(), out, decider=decider)
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, output_loading_info=True)
    assert not any(info.values()), info  # every tensor in the file, every parameter loaded
    return model.eval()
