"""Expert parallel 2 with MoE edge layers (``model.edge_mlp: moe``) and members holding different plans (issue 30,
item 4): mixed depth (ℓ = 1 beside ℓ = 3: ghost passes) and telescopic exits ({1, 3} beside {2, 3}). Two gloo
processes (data parallel 2 × expert parallel 2) against one process running both micro-batches: same loss per
exit and same gradients. Before the fix the coda's all-to-all of one member paired with a core layer's of
the other, so tokens reached the wrong layer's experts and the numbers differed. The cheap in-process check
of the all-to-all order: tests/model/test_collective_order.py.

Tolerance: fp32, rtol=1e-4 / atol=1e-6 (sums reassociated across ranks; nothing else differs), as
tests/train/test_mixed_depth.py.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, torchrun
from tests.dist.equivalence import global_name

SCRIPT = REPO / "tests" / "dist" / "edge_moe_ep.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("edge_moe_ep")
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, str(SCRIPT), "ref", str(out)], check=True, cwd=REPO, timeout=200, capture_output=True, env=env
    )
    torchrun(SCRIPT, "ep2", str(out), nproc=2, timeout=250, env={"PYTHONPATH": str(REPO)})
    return out


@pytest.mark.parametrize("case", ["mixed", "telescopic"])
def test_ep2_with_moe_edge_layers_matches_one_process(out, case):
    ref = torch.load(out / f"ref_{case}_rank0.pt", weights_only=True)
    assert math.isfinite(ref["loss"])
    assert sorted(ref["by_loops"]) == ([1, 3] if case == "mixed" else [1, 2, 3])
    for rank in range(2):
        res = torch.load(out / f"ep2_{case}_rank{rank}.pt", weights_only=True)
        assert res["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        for k, v in ref["by_loops"].items():
            assert res["by_loops"][k] == pytest.approx(v, rel=1e-5)
        coda = [n for n in res["grads"] if n.startswith("coda.") and ".local_experts." in n]
        assert coda, "the coda's experts are expert-parallel here"
        for name, got in res["grads"].items():
            want = ref["grads"][global_name(name, res["ep"], 2)]
            torch.testing.assert_close(
                got, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )
