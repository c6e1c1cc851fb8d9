"""Shared by the evaluation tests: one tiny looped model (flatten 2, L_max 4, prelude + coda), and a
base checkpoint of the default job trained two steps in one process (for the command tests)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig
from tests.conftest import REPO, VENV_BIN

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


CLI = str(VENV_BIN / "elastic-pretrain")


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default job, two steps in one process: a base checkpoint for eval / generate / decider jobs."""
    cli("prepare-data", "stdlib-code")
    run = tmp_path_factory.mktemp("eval-run") / "tiny"
    cli(
        "train",
        "jobs/tiny-cpu.yaml",
        "--run-dir",
        str(run),
        "parallel=single",
        "train.steps=2",
        "train.warmup_steps=1",
        "train.eval_sequences=4",
        "train.eval_interval=0",
        "tracking.system_metrics=false",
    )  # fmt: skip  (local MLflow store: eval logs next to the training run)
    return run
