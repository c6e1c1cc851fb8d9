"""The sampler experiment (issue 19): a ``--quick`` run of the whole job set (2 steps per job, one seed) that
writes the report with every sampler and ELR's claim row (undecided with one seed)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO, VENV_BIN


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_run_reports_every_sampler(tmp_path):
    proc = subprocess.run([str(VENV_BIN / "elastic-pretrain"), "experiment", "samplers", "--quick", "--seeds", "1",
                           "--runs", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    numbers = json.loads((tmp_path / "results" / "samplers.json").read_text())
    assert set(numbers["samplers"].values()) == {
        "independent_rank", "per_step", "independent_rank + balance: compute"}
    assert [c["verdict"] for c in numbers["claims"]] == ["no"]  # one seed: no interval
    report = (tmp_path / "results" / "samplers.md").read_text()
    assert "fails to preserve the one-loop endpoint" in report.split("\n\n", 3)[-1][:4000]
