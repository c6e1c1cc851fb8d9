"""Shared by the evaluation tests: one tiny looped model (flatten 2, L_max 4, prelude + coda)."""

from __future__ import annotations

import pytest
import torch

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig

PAR = ParallelConfig()
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32; the only difference is the order of the attention reductions


def tiny(**kw) -> ModelConfig:
    base = dict(
        hidden_size=32, num_heads=4, ffn_hidden_size=64, core_layers=2, num_experts=4, loops=2, flatten=2,
        moe_top_k=2, moe_ffn_hidden_size=32, prelude_layers=1, coda_layers=1, moe_z_loss_coeff=0.0,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model(mesh1):
    torch.manual_seed(0)
    return build_model(tiny(), PAR).eval()
