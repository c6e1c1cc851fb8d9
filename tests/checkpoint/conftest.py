from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.checkpoint.runs import CLI
from tests.conftest import REPO

STATES = ("exp_avg", "exp_avg_sq")


@pytest.fixture(scope="package")
def prepared() -> None:
    """The default job's shards (idempotent)."""
    subprocess.run([CLI, "prepare-data", "stdlib-code"], cwd=REPO, check=True, capture_output=True, timeout=300)


@pytest.fixture
def parts(mesh1, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real one-process model and optimizer of the tiny job (Adam state filled), async saves on."""
    from elastic_pretrain.checkpoint import optim_state
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.train.session import build_optimizer, wrap_ddp
    from tests.dist.ckpt_reshard import owned_slices

    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", "tracking.backend=none",
                   "checkpoint.async_save=true", "checkpoint.keep_last=10"],
                   values={"run_dir": str(tmp_path / "run")})  # fmt: skip
    net = build_model(job.model, job.parallel)
    optimizer, _ = build_optimizer(job, wrap_ddp(job, net))
    optim_state.ensure_state(optimizer)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, _, _, _, t in owned_slices(optimizer, net):
            for state in STATES:
                t[state].copy_(torch.rand(t[state].shape, generator=g))
    return job, mesh1, job.run_path, net, optimizer
