"""Helpers of the checkpoint tests: run the tiny job through the CLI, read a checkpoint's tensors."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from tests.conftest import REPO, VENV_BIN

CLI = str(VENV_BIN / "elastic-pretrain")
COMMON = [
    "train.warmup_steps=1",
    "train.eval_sequences=4",
    "train.log_interval=1",
    "train.eval_interval=0",
    "checkpoint.interval=0",
    "tracking.backend=none",
]


# history.jsonl values measured with a clock (the estimated ghost time is step time x a FLOP share):
# not part of a run's numerics, so a bitwise resume compares everything else.
TIMING_KEYS = ("ghost_time_s",)


def history(run_dir: Path) -> list[dict[str, Any]]:
    """``summary.json``'s per-step history of ``run_dir`` without the wall-clock values."""
    steps = json.loads((run_dir / "summary.json").read_text())["history"]
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in steps]


def train(
    run_dir: Path, nproc: int, *overrides: str, env: dict[str, str] | None = None, expect: int = 0
) -> subprocess.CompletedProcess[str]:
    """``elastic-pretrain train jobs/tiny-cpu.yaml`` on ``run_dir`` (one process, or torchrun)."""
    layout = ["parallel=single"] if nproc == 1 else ["--nproc-per-node", str(nproc)]
    proc = subprocess.run(
        [CLI, "train", "jobs/tiny-cpu.yaml", "--run-dir", str(run_dir), *layout, *COMMON, *overrides],
        cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def tensors(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    """Every model and Adam tensor of a committed ``step_<N>`` (megatron's checkpoint as one dict)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "model_optim", out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors are not bitwise equal (or exist on one side only)."""
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]
