"""End to end: train the tiny job two steps (one process), then `eval` and `generate` on its checkpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.eval.conftest import CLI, cli

pytestmark = pytest.mark.slow


def test_eval_command_writes_table_and_plot(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from elastic_pretrain.model.decider import DeciderConfig, IterationDecider, save_decider

    torch.manual_seed(0)
    decider = tmp_path / "decider.pt"
    save_decider(decider, IterationDecider(DeciderConfig(), hidden_size=96, max_loops=4))
    out = tmp_path / "eval"
    proc = cli("eval", str(run_dir), "--data", "stdlib-code", "--sequences", "4", "--kv-gap", "--out", str(out),
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
    assert "Warning" not in proc.stderr, proc.stderr  # torch's ShardedTensor deprecations are not the user's
    # MLflow: a run nested under the training run, with the loss per ℓ and the AUC at the checkpoint's step
    from mlflow.tracking import MlflowClient

    from elastic_pretrain.tracking.config import local_store_uri

    client = MlflowClient(tracking_uri=local_store_uri(run_dir))
    parent = (run_dir / "mlflow_run_id").read_text().strip()
    runs = client.search_runs([client.get_run(parent).info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent}'")  # fmt: skip
    assert [r.info.run_name for r in runs] == ["tiny-cpu eval step_2"]
    metrics = runs[0].data.metrics
    assert abs(metrics["eval/loss_loops_4"] - float(report.split("\n| 4 | ")[1].split(" | ")[2])) < 1e-3
    assert "eval/auc" in metrics and "eval/adaptive_auc" in metrics
    monkeypatch.chdir(run_dir / "mlflow")  # artifact locations are relative to the store's folder (docs/tracking.md)
    assert {a.path for a in client.list_artifacts(runs[0].info.run_id, "eval")} >= {"eval/eval.md", "eval/quality.png"}


def test_generate_command_fixed_and_auto(run_dir: Path, tmp_path: Path) -> None:
    import torch

    from elastic_pretrain.model.decider import DeciderConfig, IterationDecider, save_decider

    fixed = cli("generate", str(run_dir), "--prompt", "import ", "--loops", "2", "--max-new-tokens", "5")
    assert fixed.stdout.startswith("import ") and "mean passes/token 2.00" in fixed.stdout
    assert "Warning" not in fixed.stderr, fixed.stderr  # only the project's own output
    torch.manual_seed(0)
    path = tmp_path / "decider.pt"
    save_decider(path, IterationDecider(DeciderConfig(), hidden_size=96, max_loops=4))
    auto = cli("generate", str(run_dir), "--loops", "auto", "--decider", str(path), "--threshold", "0",
                "--max-new-tokens", "5")  # fmt: skip
    assert "mean passes/token 4.00" in auto.stdout and "KV cache last-loop: 2304 bytes/token" in auto.stdout
    bad = subprocess.run([CLI, "generate", str(run_dir), "--loops", "auto"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode != 0 and "has no iteration decider: train a decider job" in bad.stderr


def test_generate_defaults_to_every_pass_without_a_decider_and_refuses_what_it_cannot_do(run_dir: Path) -> None:
    """Issue 33: `generate RUN --prompt x` failed on every pretrained checkpoint (--loops defaulted to auto,
    which needs a decider); a negative temperature and a length past the trained context were taken silently."""
    plain = cli("generate", str(run_dir), "--prompt", "x", "--max-new-tokens", "3")
    assert "mean passes/token 4.00" in plain.stdout  # L_max = 4 passes
    assert "[depth: 4 passes per token; L_max = 4" in plain.stderr
    # the README's line: without --max-new-tokens, what the 128-token context leaves after the prompt (the
    # default of 128 new tokens refused every prompt on this model)
    readme = cli("generate", str(run_dir), "--prompt", "def ", "--loops", "2")
    assert "[124 tokens, mean passes/token 2.00" in readme.stdout
    for flags, words in (
        (["--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--max-new-tokens", "5000"], "exceeds the model's context of 128 tokens"),
        (["--loops", "9"], "--loops 9: this model runs 1..4 passes"),
    ):
        bad = subprocess.run([CLI, "generate", str(run_dir), *flags], cwd=REPO, capture_output=True, text=True)
        assert bad.returncode == 2 and words in bad.stderr, (flags, bad.stderr)
        assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) <= 2, bad.stderr
