"""The sampler experiment (issue 19 item 4): its statistics against a naive computation, and a
``--quick`` run of the whole job set (2 steps per job) that writes the report."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from elastic_pretrain.experiments.sampler import interval
from tests.conftest import REPO, VENV_BIN


def test_interval_is_the_student_t_95_interval():
    values = [1.0, 1.5, 0.5, 2.0]
    mean = sum(values) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    got_mean, half = interval(values)
    assert got_mean == pytest.approx(mean) and half == pytest.approx(3.182 * sd / 2)
    assert math.isnan(interval([2.0])[1])


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_run_reports_every_sampler_with_paired_deltas(tmp_path):
    proc = subprocess.run([str(VENV_BIN / "elastic-pretrain"), "experiment", "samplers", "--quick", "--runs",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    numbers = json.loads(next((tmp_path / "results").glob("samplers*.json")).read_text())
    found = json.dumps(numbers)
    for label in ("independent_rank", "per_step", "independent_rank + balance: compute"):
        assert f'"{label}"' in found
