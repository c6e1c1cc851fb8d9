"""Resume is bitwise: N steps uninterrupted == N/2 steps, stop (save, exit 0), resume, N/2 more —
per-step losses, final parameters and Adam state, across the default job's fixed -> mixed switch
(switch_at 0.75: step 5 of 6, after the resume at step 3). World size 1 and 2 (EP=2, DP=2)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, VENV_BIN

pytestmark = pytest.mark.slow
CLI = str(VENV_BIN / "elastic-pretrain")
STEPS = 6
COMMON = [
    f"train.steps={STEPS}",
    "train.warmup_steps=1",
    "train.eval_sequences=4",
    "train.log_interval=1",
    "train.eval_interval=0",
    "checkpoint.interval=0",
    "tracking.backend=none",
]


def _train(run_dir: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess[str]:
    layout = ["parallel=single"] if nproc == 1 else ["--nproc-per-node", str(nproc)]
    proc = subprocess.run(
        [CLI, "train", "jobs/tiny-cpu.yaml", "--run-dir", str(run_dir), *layout, *COMMON, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _tensors(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "model_optim", out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module", autouse=True)
def _data() -> None:
    subprocess.run([CLI, "prepare-data", "stdlib-code"], cwd=REPO, check=True, capture_output=True, timeout=300)


@pytest.mark.parametrize("nproc", [1, 2])
def test_stop_and_resume_is_bitwise_equal(tmp_path: Path, nproc: int) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    _train(full, nproc)
    first = _train(split, nproc, "checkpoint.stop_at=3")
    assert "stopped (stop_at) at step 3" in first.stdout
    assert not (split / "FINISHED").exists() and (split / "checkpoints" / "latest").read_text().strip() == "step_3"
    second = _train(split, nproc)
    assert "resumed from" in second.stdout and (split / "FINISHED").is_file()
    a, b = (json.loads((d / "summary.json").read_text())["history"] for d in (full, split))
    assert [h["step"] for h in b] == list(range(1, STEPS + 1))
    assert a == b  # per-step losses (JSON floats round-trip exactly)
    x = _tensors(full / "checkpoints" / f"step_{STEPS}", tmp_path / "x.pt")
    y = _tensors(split / "checkpoints" / f"step_{STEPS}", tmp_path / "y.pt")
    assert sorted(x) == sorted(y) and any(k.startswith("optimizer.exp_avg_sq.") for k in x)
    assert [k for k in x if not torch.equal(x[k], y[k])] == []
    listing = subprocess.run([CLI, "checkpoints", str(split), "--verify"], cwd=REPO, capture_output=True, text=True)
    assert listing.returncode == 0 and "step_6" in listing.stdout and "latest" in listing.stdout
