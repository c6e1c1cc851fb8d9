"""The trainer at PP=2 (preset cpu-pp2) and checkpoints across pipeline layouts, model and optimizer.

One torchrun launch (tests/dist/pipeline_resume.py): uninterrupted 6-step runs at PP=1 (A) and PP=2
(B) with mixed depth (independent-rank ℓ), route replay and the loop-conditioning head; then A's
step-3 checkpoint resumed at PP=2 (D) and B's resumed at PP=1 (C). The resumed runs must continue
exactly as the uninterrupted ones: per-step losses (rel 1e-6), final parameters and Adam moments
(rtol 1e-5, atol 1e-8 — fp32; the same sums in a different grouping at most), validation loss per
loop count (rel 1e-6: the pipeline accumulates per-micro-batch sums in another order).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, VENV_BIN, torchrun

SCRIPT = REPO / "tests" / "dist" / "pipeline_resume.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cli = str(VENV_BIN / "elastic-pretrain")
    subprocess.run([cli, "prepare-data", "stdlib-code"], cwd=REPO, check=True, capture_output=True, timeout=300)
    out = tmp_path_factory.mktemp("pipeline_resume")
    torchrun(SCRIPT, str(out), nproc=2, timeout=600, env={"PYTHONPATH": str(REPO), "TMPDIR": str(out)})
    return out


def _summary(runs: Path, name: str) -> dict:
    return json.loads((runs / name / "summary.json").read_text())


def _tensors(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "model_optim", out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(("resumed", "uninterrupted"), [("C", "B"), ("D", "A")], ids=["pp2->pp1", "pp1->pp2"])
def test_resume_at_another_pipeline_layout_continues_the_run(runs: Path, resumed: str, uninterrupted: str) -> None:
    got, want = _summary(runs, resumed), _summary(runs, uninterrupted)
    assert want["steps"] == got["steps"] == 6
    pp = {"A": 1, "B": 2, "C": 1, "D": 2}
    assert got["layout"]["pp"] == pp[resumed] and want["layout"]["pp"] == pp[uninterrupted]
    after = {h["step"]: h for h in want["history"]}
    assert [h["step"] for h in got["history"]] == [4, 5, 6]  # only the steps this run trained
    for h in got["history"]:
        assert h["loss"] == pytest.approx(after[h["step"]]["loss"], rel=1e-6)
        assert h["loss_by_loops"].keys() == after[h["step"]]["loss_by_loops"].keys()
    assert len({tuple(h["loss_by_loops"]) for h in want["history"]}) > 1  # mixed depth: ℓ varied
    assert got["val_loss_by_loops"].keys() == want["val_loss_by_loops"].keys() == {"1", "2", "3"}
    for k, v in want["val_loss_by_loops"].items():
        assert got["val_loss_by_loops"][k] == pytest.approx(v, rel=1e-6)
    # routing health of the last step, per (core layer, pass), from every stage
    assert got["routing"].keys() == want["routing"].keys() == {f"{i}/{j}" for i in range(2) for j in range(3)}
    for where, stats in want["routing"].items():
        for stat, v in stats.items():
            assert got["routing"][where][stat] == pytest.approx(v, rel=1e-5, abs=1e-7), (where, stat)
    # the final checkpoints hold the same model and optimizer state under the same keys
    a = _tensors(runs / resumed / "checkpoints" / "step_6", runs / f"{resumed}.pt")
    b = _tensors(runs / uninterrupted / "checkpoints" / "step_6", runs / f"{uninterrupted}.pt")
    assert a.keys() == b.keys()
    assert any(k.startswith("optimizer.exp_avg_sq.") for k in a) and any(".passes.2." in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-8, msg=lambda m, k=k: f"{k}: {m}")


def test_pipeline_stages_start_from_their_own_initialisation(runs: Path) -> None:
    """Not a requirement, a documented fact (docs/parallelism.md): each stage initialises only its layers,
    so a run's first loss depends on the pipeline layout — and the trainer at PP=2 still learns."""
    b = [h["loss"] for h in _summary(runs, "B")["history"]]
    a = [h["loss"] for h in _summary(runs, "A")["history"]]
    assert b[0] != a[0]
    assert b[-1] < b[0] - 0.2
