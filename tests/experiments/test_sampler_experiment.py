"""The sampler experiment (issue 19): a ``--quick`` run of the whole job set (2 steps per job, one seed, every
job in 2 processes, data-parallel 2) that writes the report with every sampler, the layouts the runs trained
with and the claim rows (undecided with one seed)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO, VENV_BIN


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_run_reports_every_sampler(tmp_path):
    proc = subprocess.run(
        [
            str(VENV_BIN / "elastic-pretrain"),
            "experiment",
            "samplers",
            "--quick",
            "--seeds",
            "1",
            "--runs",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    numbers = json.loads((tmp_path / "results" / "samplers.json").read_text())
    over = " + one_loop_fraction 0.15"
    assert numbers["samplers"] == {
        "balanced": "independent_rank + balance: compute" + over,
        "independent-rank": "independent_rank" + over,
        "one-loop": "fixed",  # the baseline arm (issue 32): ℓ = 1 only
        "per-step": "per_step" + over,
    }
    assert {job: (lay["world_size"], lay["dp"], lay["ep"]) for job, lay in numbers["layouts"].items()} == {
        "balanced": (2, 2, 1),
        "independent-rank": (2, 2, 1),
        "one-loop": (2, 2, 1),
        "per-step": (2, 2, 1),
    }
    # one seed: no interval, so the premise (depth pays) is not established and gates every sampler claim
    gated = "not resolved — premise absent"
    assert [c["verdict"] for c in numbers["claims"]] == ["no", gated, "no", gated, gated]
    assert all(c["values"] for c in numbers["claims"])  # every claim measured, the one-loop tax's arm included
    report = (tmp_path / "results" / "samplers.md").read_text()
    assert "fails to preserve the one-loop endpoint" in report.split("## How", 1)[0]
    assert "2 processes (TP 1 x PP 1 x DP 2, EP 1)" in report
