"""Compute-balanced mixed depth gives replicas different numbers of micro-batches; the gradient must
still be the plain per-token mean over the global batch (every token 1 / global tokens).

Reference: one process running the same 4 micro-batches at the same ℓ (gradient accumulation).
2 gloo processes: data parallel 2 with 3 + 1 micro-batches, and expert parallel 2 with 2 + 2.
Tolerance: fp32, rtol=1e-4 / atol=1e-6 (sums reassociated across ranks; nothing else differs).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, torchrun
from tests.dist.balanced_depth import model_cfg
from tests.dist.equivalence import global_name

SCRIPT = REPO / "tests" / "dist" / "balanced_depth.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("balanced_depth")
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, str(SCRIPT), "ref", str(out)], check=True, cwd=REPO, timeout=300, capture_output=True, env=env
    )
    torchrun(SCRIPT, "dist", str(out), nproc=2, timeout=400, env={"PYTHONPATH": str(REPO)})
    return out


def load(out, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("case", ["dp2", "ep2"])
def test_balanced_deal_gradient_is_the_global_token_mean(out, case):
    ref = load(out, "ref_rank0")
    assert math.isfinite(ref["loss"]) and sorted(ref["by_loops"]) == [1, 2]
    for rank in range(2):
        res = load(out, f"{case}_rank{rank}")
        # depth_balance, from the real reduction: dp2 executes 1+1+2 vs 2 passes (mean 3 / max 4); ep2 3 and 3
        assert res["balance"] == (0.75 if case == "dp2" else 1.0)
        assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        for k, v in ref["by_loops"].items():
            assert res["by_loops"][k] == pytest.approx(v, rel=1e-5)
        for name, got in res["grads"].items():
            want = ref["grads"][global_name(name, res["ep"], model_cfg().experts_built // (2 if case == "ep2" else 1))]
            torch.testing.assert_close(
                got, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name, r=rank: f"{case} rank {r} {n}: {m}"
            )


def test_megatron_default_weighting_would_bias_an_unequal_deal(out):
    """Without the per-token weighting, replica 0's three micro-batches weigh 1/6 each and replica 1's
    one 1/2: the gradient is not the reference's (this is what schedule.balance: compute fixes)."""
    ref = load(out, "ref_rank0")["grads"]
    res = load(out, "dp2-default_rank0")["grads"]
    worst = max(float(((res[n] - ref[n]).abs() / (ref[n].abs() + 1e-6)).max()) for n in res)
    assert worst > 1e-2
