"""Parameter counts by arithmetic (model/params.py) against the built model's real parameters."""

from __future__ import annotations

import pytest
import torch

from elastic_pretrain.config import ConfigError
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.model.params import count_parameters, expert_params
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig
from tests.conftest import REPO

PAR = ParallelConfig()
BASE = dict(
    vocab_size=300,
    hidden_size=32,
    num_heads=4,
    ffn_hidden_size=48,
    core_layers=2,
    num_experts=4,
    loops=2,
    moe_top_k=2,
    moe_ffn_hidden_size=24,
    prelude_layers=1,
    coda_layers=1,
)
SHAPES = {
    "default": {},
    "gqa-qknorm": dict(num_query_groups=2, qk_norm=True),
    "mqa-flatten2": dict(num_query_groups=1, flatten=2),
    "tied-attention-layernorm": dict(attention="tied", normalization="LayerNorm", qk_norm=True),
    "moe-edges-tied-embeddings": dict(edge_mlp="moe", tie_embeddings=True),
    "no-conditioning-no-edges": dict(loop_conditioning=False, prelude_layers=0, coda_layers=0),
}


def real_counts(model: torch.nn.Module, cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) of a built model; active drops E - k experts of every MoE MLP, by their real size."""
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    expert0 = [p for n, p in params.items() if ".experts.local_experts.0." in n]
    moe_mlps = len({n.split(".experts.")[0] for n in params if ".experts." in n})
    one_expert = sum(p.numel() for p in expert0) // moe_mlps
    return total, total - moe_mlps * (cfg.experts_built - cfg.moe_top_k) * one_expert


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_counts_equal_the_built_model(mesh1, shape: str) -> None:
    cfg = ModelConfig(**{**BASE, **SHAPES[shape]})
    model = build_model(cfg, PAR)
    counts = count_parameters(cfg)
    assert (counts.total, counts.active) == real_counts(model, cfg)
    assert counts.active < counts.total
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counts.experts == experts


def test_tiny_cpu_job_count(mesh1) -> None:
    """The shipped tiny job (the one CI trains) counts right too."""
    cfg = load_job(REPO / "jobs" / "tiny-cpu.yaml").model
    model = build_model(cfg, PAR)
    assert count_parameters(cfg).total == sum(p.numel() for p in model.parameters())


def test_gqa_and_qk_norm_are_built_and_train(mesh1) -> None:
    """GQA shrinks the QKV projection to (H + 2G)·d_h rows; QK-norm adds real norms; a step runs."""
    cfg = ModelConfig(**{**BASE, "num_query_groups": 1, "qk_norm": True})
    model = build_model(cfg, PAR)
    attn = model.core[0].attention_for(1).self_attention
    d_h = cfg.hidden_size // cfg.num_heads
    assert attn.linear_qkv.weight.shape == ((cfg.num_heads + 2) * d_h, cfg.hidden_size)
    assert type(attn.q_layernorm).__name__ != "IdentityOp" and type(attn.k_layernorm).__name__ != "IdentityOp"
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens, loops=cfg.max_loops)[cfg.max_loops]
    assert logits.shape[:2] == (2, 16) and torch.isfinite(logits).all()
    logits.float().square().mean().backward()
    assert attn.q_layernorm.weight.grad is not None and attn.q_layernorm.weight.grad.abs().sum() > 0


def test_expert_params_are_swiglu() -> None:
    assert expert_params(ModelConfig(**BASE)) == 3 * 32 * 24


def test_query_groups_must_divide_heads() -> None:
    with pytest.raises(ConfigError, match="num_query_groups: 3 must divide num_heads 4"):
        ModelConfig(**{**BASE, "num_query_groups": 3})


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_memory_estimate_holds_the_same_parameters(shape: str) -> None:
    """parallel/memory.py counts per rank on its own: at one rank it must hold every parameter."""
    from elastic_pretrain.parallel.memory import estimate_memory

    shape_kw = {**BASE, **SHAPES[shape]}
    overrides = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in shape_kw.items()]
    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", [*overrides, "parallel.expert=1"])
    assert estimate_memory(job, 1).stages[0].params == count_parameters(job.model).total
