"""Issue 33: a run directory is self-contained. ``cp -r`` a trained run, evaluate and resume the copy: every file
of the original stays byte for byte what it was (the copy's MLflow store used to name the original's artifact
folder, so both wrote there), and ``eval`` reports beside the checkpoints, on the job's own validation size."""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.eval.conftest import cli

pytestmark = pytest.mark.slow


def _tree(root: Path) -> dict[str, str]:
    """Every entry below ``root``: a file's sha256, a link's target, a folder's name."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "-> " + str(p.readlink())
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def test_a_copied_run_evaluates_and_resumes_into_itself(run_dir: Path, tmp_path: Path) -> None:
    before = _tree(run_dir)
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, symlinks=True)

    # no --sequences: the job's train.eval_sequences (4 in the fixture's run)
    proc = cli("eval", str(copy), "--data", "stdlib-code")
    assert ("evaluated 4 held-out sequences x 128 predicted tokens = 512 tokens per loop count "
            "(the job's train.eval_sequences") in proc.stdout, proc.stdout[-2000:]  # fmt: skip
    report = copy / "eval" / "step_2" / "eval.md"
    assert "512 tokens per loop count" in report.read_text()
    assert not (copy / "checkpoints" / "step_2" / "eval").exists()  # rotation deletes step_2/, not its report

    resumed = cli("train", "jobs/tiny-cpu.yaml", "--run-dir", str(copy), "parallel=single", "train.steps=3",
                  "train.warmup_steps=1", "train.eval_sequences=4", "train.eval_interval=0",
                  "tracking.system_metrics=false")  # fmt: skip
    assert "trained 3 steps" in resumed.stdout + resumed.stderr

    assert _tree(run_dir) == before
    run_id = (copy / "mlflow_run_id").read_text().strip()
    assert run_id == (run_dir / "mlflow_run_id").read_text().strip()  # the copy continued the same MLflow run
    assert (copy / "mlflow" / "artifacts" / run_id / "artifacts" / "config.yaml").read_bytes() == (
        copy / "config.yaml"
    ).read_bytes()
    with sqlite3.connect(copy / "mlflow" / "mlflow.db") as con:
        rows = con.execute("SELECT artifact_location FROM experiments UNION ALL SELECT artifact_uri FROM runs")
        locations = [r[0] for r in rows]
    assert not [loc for loc in locations if not loc.startswith("artifacts")], locations  # all relative
