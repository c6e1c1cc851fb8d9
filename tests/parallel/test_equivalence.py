"""TP=2 and EP=2 (2 gloo processes) give the loss and gradients of 1 process on the same batch.

Tolerance: fp32, rtol=1e-4 / atol=1e-6 — sums are reassociated across ranks (all-reduce,
all-to-all token order), nothing else differs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, torchrun
from tests.dist.equivalence import global_name, local_view

SCRIPT = REPO / "tests" / "dist" / "equivalence.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("equiv")
    subprocess.run(
        [sys.executable, str(SCRIPT), "ref", str(out)],
        check=True,
        cwd=REPO,
        timeout=300,
        capture_output=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    torchrun(SCRIPT, "tp2,ep2", str(out), nproc=2, env={"PYTHONPATH": str(REPO)})  # both layouts, one launch
    return out


def _reference_view(name: str, got: torch.Tensor, ref_grads: dict, res: dict) -> torch.Tensor:
    """The part of the 1-process gradient that this rank's parameter corresponds to."""
    n_local = 4 // (2 if res["mode"] == "ep2" else 1)
    return local_view(name, ref_grads[global_name(name, res["ep"], n_local)], got.shape, 2, res["tp"])


@pytest.mark.parametrize("mode", ["tp2", "ep2"])
def test_two_ranks_match_one_process(reference, mode):
    ref = torch.load(reference / "ref_rank0.pt", weights_only=True)
    for rank in range(2):
        res = torch.load(reference / f"{mode}_rank{rank}.pt", weights_only=True)
        assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        for k, v in ref["by_loops"].items():
            assert res["by_loops"][k] == pytest.approx(v, rel=1e-5)
        res["mode"] = mode
        for name, got in res["grads"].items():
            want = _reference_view(name, got, ref["grads"], res)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{mode} {n}: {m}")
