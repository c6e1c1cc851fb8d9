"""Export a trained looped model to a Hugging Face directory (``elastic-pretrain export``).

The checkpoint is loaded into a one-process model (``engine.restore.load_model``: megatron's
``dist_checkpointing`` reshards any TP/EP/DP/PP layout, with the restricted unpickling of resume), so every
layout exports the same files: ``model.safetensors`` under the project's own names, ``config.json`` with an
``auto_map`` to the standalone ``configuration_elastic.py`` / ``modeling_elastic.py``, the tokenizer and
``elastic_pretrain.json`` (provenance). docs/export.md, "What is exported" (the table of files).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_pretrain.errors import UserError
from elastic_pretrain.files import copy_file, ensure_dir, write_atomic

if TYPE_CHECKING:  # annotations only
    from elastic_pretrain.data.config import TokenizerConfig
    from elastic_pretrain.model.config import DeciderConfig
    from elastic_pretrain.model.looped import LoopedMoEModel

HF_DIR = Path(__file__).parent / "hf"
MODEL_FILES = ("configuration_elastic.py", "modeling_elastic.py")
PROVENANCE = "elastic_pretrain.json"
WEIGHTS = "model.safetensors"
# config.json's pointers to the copied files: what trust_remote_code=True imports (export/folder.py checks them)
AUTO_MAP = {
    "AutoConfig": "configuration_elastic.ElasticLoopedConfig",
    "AutoModelForCausalLM": "modeling_elastic.ElasticLoopedForCausalLM",
}

# megatron TransformerConfig settings the standalone model does not implement: (attribute, value it
# must have, what to say). Checked at export so an unsupported model fails loudly, not numerically.
_REQUIRED: tuple[tuple[str, Any, str], ...] = (
    ("add_bias_linear", False, "linear biases"),
    ("gated_linear_unit", True, "non-gated MLPs"),
    ("qk_layernorm", False, "QK layer norm"),
    ("moe_router_enable_expert_bias", False, "router expert bias"),
    ("moe_router_group_topk", None, "group-limited top-k routing"),
    ("moe_expert_capacity_factor", None, "expert capacity (token dropping)"),
    ("moe_shared_expert_intermediate_size", None, "shared experts"),
    ("moe_apply_probs_on_input", False, "gates applied on expert inputs"),
    ("rotary_interleaved", False, "interleaved RoPE"),
    ("softmax_scale", None, "a custom attention softmax scale"),
)


def check_supported(tconfig: Any) -> None:
    for attr, want, what in _REQUIRED:
        if getattr(tconfig, attr, want) != want:
            raise UserError(
                f"the model uses {what} ({attr}={getattr(tconfig, attr)!r}), which the "
                "exported modelling file does not implement: extend export/hf/modeling_elastic.py"
            )
    if tconfig.moe_router_load_balancing_type == "sinkhorn":
        raise UserError("sinkhorn routing is not implemented by the exported model: use top-k routing")
    if tconfig.activation_func.__name__ != "silu":
        raise UserError(f"activation {tconfig.activation_func.__name__} is not implemented (SwiGLU only)")


# Transformer Engine layer specs fuse the norms into the next linear layer: map them back.
_TE_RENAMES = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
)


def hf_state_dict(net: LoopedMoEModel) -> dict[str, Any]:
    """The exported tensors of a one-process ``LoopedMoEModel`` (padded vocabulary rows dropped)."""
    import torch

    vocab = net.cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    for key, t in net.state_dict().items():
        if not isinstance(t, torch.Tensor) or key.endswith("_extra_state"):
            continue
        if key.startswith("loop_conditioning.") and not net.conditioning_active:
            continue  # heads never switched on: the exported model runs without them, like the checkpoint
        for te, local in _TE_RENAMES:
            key = key.replace(te, local)
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = t[:vocab]
        name = "lm_head.weight" if key == "output_layer.weight" else f"model.{key}"
        out[name] = t.detach().to("cpu").contiguous().clone()
    return out


def hf_config(net: LoopedMoEModel, decider: DeciderConfig | None, *, eos_id: int | None) -> Any:
    """The ``ElasticLoopedConfig`` of a loaded one-process model (the built shape, as the exported model
    runs it); ``decider``: the job's ``DeciderConfig`` (its threshold) or None."""
    import torch

    from elastic_pretrain.export.hf.configuration_elastic import ElasticLoopedConfig

    cfg, tc = net.cfg, net.config
    check_supported(tc)
    config = ElasticLoopedConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
        num_query_groups=tc.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, num_experts=cfg.experts_built, moe_top_k=cfg.moe_top_k,
        prelude_layers=cfg.prelude_layers, core_layers=cfg.core_layers_built, coda_layers=cfg.coda_layers,
        max_loops=cfg.max_loops, attention=cfg.attention, edge_mlp=cfg.edge_mlp, normalization=cfg.normalization,
        norm_eps=tc.layernorm_epsilon, rope_base=cfg.rope_base, route_replay=cfg.route_replay,
        router_score_function=tc.moe_router_score_function, router_pre_softmax=tc.moe_router_pre_softmax,
        router_topk_scaling_factor=tc.moe_router_topk_scaling_factor,
        loop_conditioning=bool(net.conditioning_active and net.loop_conditioning is not None),
        decider_hidden_size=net.decider.cfg.hidden_size if net.decider is not None else None,
        decider_threshold=decider.threshold if decider is not None else 0.5,
        tie_word_embeddings=cfg.tie_embeddings, eos_token_id=eos_id, pad_token_id=eos_id,
        torch_dtype=torch.bfloat16 if cfg.dtype == "bf16" else torch.float32,
    )  # fmt: skip
    config.architectures = ["ElasticLoopedForCausalLM"]
    config.auto_map = dict(AUTO_MAP)
    return config


def generation_config(config: Any) -> Any:
    """``generation_config.json``: what ``generate`` reads by default — the EOS that ends a sequence and pads a
    batch (config.json's), greedy decoding. transformers writes it only from a model's ``save_pretrained``;
    the export never builds the transformers model, so it is written from the config."""
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False)


def write_export(
    net: LoopedMoEModel,
    tokenizer: TokenizerConfig,
    out: Path,
    *,
    decider: DeciderConfig | None = None,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Write the Hugging Face files of a loaded one-process model into ``out`` (created; must be empty)."""
    from safetensors.torch import save_file

    from elastic_pretrain.export.tokenizer import export_tokenizer

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder: pick a new output folder")
    tensors = hf_state_dict(net)
    ensure_dir(out, root=out)  # new or empty (checked above): the libraries below write into a folder of ours
    eos_id = export_tokenizer(tokenizer, out)
    config = hf_config(net, decider, eos_id=eos_id)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(out)
    generation_config(config).save_pretrained(out)
    for name in MODEL_FILES:
        copy_file(HF_DIR / name, out / name, root=out, follow=True)  # the installed package's own files
    meta = {
        "model": dataclasses.asdict(net.cfg),
        "conditioning_active": bool(net.conditioning_active),
        "decider": net.decider is not None,
        **(provenance or {}),
    }
    write_atomic(out / PROVENANCE, json.dumps(meta, indent=2, default=str) + "\n", root=out)
    return out


def export_hf(ckpt: Path, out: Path) -> Path:
    """Export a committed checkpoint (any layout: loaded into one process) into ``out``."""
    from elastic_pretrain.checkpoint.store import read_trainer_state, resolve_checkpoint
    from elastic_pretrain.engine.restore import load_model
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown

    ckpt = resolve_checkpoint(Path(ckpt))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder: pick a new output folder")
    step = read_trainer_state(ckpt).get("trainer", {}).get("step")
    init_mesh(ParallelConfig(), seed=0)
    try:
        job, net = load_model(ckpt)
        provenance = {"checkpoint": str(ckpt.resolve()), "step": step, "job": job.name, "seq_len": job.data.seq_len}
        return write_export(net, job.data.tokenizer, out, decider=job.decider, provenance=provenance)
    finally:
        teardown()


def is_export(path: Path) -> bool:
    """A folder with a ``config.json`` (as :func:`export_hf` writes; a checkpoint or run directory has none).
    Whether it is a valid export is for ``export/folder.py`` to say, in one line naming what is wrong."""
    return os.path.lexists(path / "config.json")
