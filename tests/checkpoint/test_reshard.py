"""Resharding, model AND optimizer: a checkpoint saved at one layout loads bitwise at another —
TP 1<->2, DP 1<->2 (distributed optimizer: each DP rank owns a different slice of the Adam state),
EP 1<->2. One torchrun launch runs every direction (tests/dist/ckpt_reshard.py)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, torchrun

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "dist" / "ckpt_reshard.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("reshard")
    torchrun(SCRIPT, str(out), nproc=2, timeout=600, env={"PYTHONPATH": str(REPO)})
    found: dict[str, list[dict]] = {}
    for f in sorted(out.glob("result_*.json")):
        found.setdefault(f.stem.split("_")[1], []).append(json.loads(f.read_text()))
    return found


@pytest.mark.parametrize(
    ("change", "ranks"),
    [("1totp2", 2), ("tp2to1", 1), ("1todp2", 2), ("dp2to1", 1), ("1toep2", 2), ("ep2to1", 1)],
    ids=["tp1->2", "tp2->1", "dp1->2", "dp2->1", "ep1->2", "ep2->1"],
)
def test_checkpoint_loads_bitwise_at_another_layout(results: dict[str, list[dict]], change: str, ranks: int) -> None:
    found = results.get(change, [])
    assert len(found) == ranks, sorted(results)
    for r in found:
        assert r["bad"] == [] and r["params"] > 0 and r["slices"] > 0
    if ranks == 1:  # one rank owns every optimizer slice
        assert found[0]["covered"] == found[0]["total"]
    elif change != "1totp2":  # DP / EP: the ranks' optimizer slices cover the model exactly once
        assert sum(r["covered"] for r in found) == results["dp2to1"][0]["total"]
