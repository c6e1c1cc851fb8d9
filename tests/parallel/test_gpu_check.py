"""bench/gpu_check.py runs end to end at toy sizes on CPU (``--dry-run``), so that the first GPU run
is not spent on a typo: every section runs and prints its figures."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_gpu_check_dry_run_runs_every_section():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=580,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    for section in ("env", "te_vs_local", "steps", "fp8", "looped_gpt", "grouped", "memory"):
        assert f"== {section}\n" in out
    assert "failed sections: none" in out
    assert "l=4: max |TE - local|" in out and "looped / GPTModel tokens/s" in out
    assert "model.fp8=tensorwise needs CUDA and Transformer Engine" in out  # refused on CPU, not dropped
    assert "recompute=pass step time at l=4" in out
