"""End to end: train the tiny job two steps (one process), then `eval` and `generate` on its checkpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.eval.conftest import CLI, cli

pytestmark = pytest.mark.slow


def test_eval_command_writes_table_and_plot(run_dir: Path, tmp_path: Path) -> None:
    import torch

    from elastic_pretrain.model.decider import DeciderConfig, IterationDecider, save_decider

    torch.manual_seed(0)
    decider = tmp_path / "decider.pt"
    save_decider(decider, IterationDecider(DeciderConfig(), hidden_size=96, max_loops=4))
    out = tmp_path / "eval"
    proc = cli("eval", str(run_dir), "--sequences", "4", "--kv-gap", "--out", str(out),
               "--adaptive", "--decider", str(decider), "--threshold", "0", "0.5", "1.01")  # fmt: skip
    report = (out / "eval.md").read_text()
    for ell in range(1, 5):
        assert f"\n| {ell} | " in report
    assert "AUC (compute-averaged loss" in report and "| last-loop |" in report and "| per-loop |" in report
    assert (out / "quality.png").read_bytes()[:4] == b"\x89PNG"
    # adaptive depth next to fixed depth: threshold 0 is the L_max model, above 1 one pass (no conditioning yet)
    assert "| 0 | 4.000 | 1.000 |" in report and "| 1.01 | 1.000 |" in report and "| +0.0000 |" in report
    assert "| adaptive (decider) |" in report and (out / "adaptive.png").read_bytes()[:4] == b"\x89PNG"
    assert "written:" in proc.stdout


def test_generate_command_fixed_and_auto(run_dir: Path, tmp_path: Path) -> None:
    import torch

    from elastic_pretrain.model.decider import DeciderConfig, IterationDecider, save_decider

    fixed = cli("generate", str(run_dir), "--prompt", "import ", "--loops", "2", "--max-new-tokens", "5")
    assert fixed.stdout.startswith("import ") and "mean passes/token 2.00" in fixed.stdout
    torch.manual_seed(0)
    path = tmp_path / "decider.pt"
    save_decider(path, IterationDecider(DeciderConfig(), hidden_size=96, max_loops=4))
    auto = cli("generate", str(run_dir), "--loops", "auto", "--decider", str(path), "--threshold", "0",
                "--max-new-tokens", "5")  # fmt: skip
    assert "mean passes/token 4.00" in auto.stdout and "KV cache last-loop: 2304 bytes/token" in auto.stdout
    bad = subprocess.run([CLI, "generate", str(run_dir), "--loops", "auto"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode != 0 and "has no iteration decider: train a decider job" in bad.stderr
