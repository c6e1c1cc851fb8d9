"""Pipeline parallelism of the loop: PP=2 and PP=2 x EP=2 give the 1-process losses and gradients.

One torchrun launch (tests/dist/pipeline_parity.py) runs the 1-process reference and both layouts,
each at fixed depth and at mixed depth (ℓ per micro-batch and replica, extra exits, route replay and
the loop-conditioning head on). Tolerance: fp32, rtol=1e-4 / atol=1e-6 on gradients, rel 1e-5 on
losses — sums are reassociated across ranks, nothing else differs.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO, torchrun

SCRIPT = REPO / "tests" / "dist" / "pipeline_parity.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("pipeline")
    torchrun(SCRIPT, str(out), nproc=4, timeout=600, env={"PYTHONPATH": str(REPO)})
    found: dict[str, list[dict]] = {}
    for f in sorted(out.glob("result_*.json")):
        _, layout, case, _ = f.stem.split("_")
        found.setdefault(f"{layout}/{case}", []).append(json.loads(f.read_text()))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fixed", "mixed"])
@pytest.mark.parametrize(("layout", "ranks"), [("pp2", 2), ("pp2ep2", 4)])
def test_pipeline_matches_one_process(results: dict[str, list[dict]], layout: str, case: str, ranks: int) -> None:
    found = results.get(f"{layout}/{case}", [])
    assert len(found) == ranks, sorted(results)
    for r in found:
        assert r["bad"] == [], r["bad"]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["by_loops"].keys() == r["ref_by_loops"].keys()
        for k, v in r["ref_by_loops"].items():
            assert r["by_loops"][k] == pytest.approx(v, rel=1e-5)
        # every parameter of the stage was compared and got a gradient (shared MLPs from every pass,
        # the conditioning head); DP/EP gradient reduction ran once for all the chunks, not per chunk
        assert r["compared"] == r["nonzero"] == len(r["names"]) > 0
        assert r["grad_syncs"] == 1
    if case == "mixed":  # ℓ differed between micro-batches: every exit was supervised somewhere
        assert sorted(found[0]["by_loops"]) == ["1", "2", "3"]
    # the stages of one replica hold every parameter of the 1-process model, each exactly once
    stage_names = {r["stage"]: r["names"] for r in found}
    assert sorted(n for names in stage_names.values() for n in names) == found[0]["ref_names"] or layout == "pp2ep2"
    if layout == "pp2ep2":  # experts are split over EP: the union over the stage's ranks is the model
        union = sorted({n for r in found for n in r["names"]})
        assert union == found[0]["ref_names"]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"core_layers": 2, "flatten": 2}, "parallel.pipeline=2 must divide the core layers built (1"),
        ({"core_layers": 2, "tie_embeddings": True}, "model.tie_embeddings is not supported with parallel.pipeline"),
    ],
)
def test_pipeline_refuses_a_model_it_cannot_split(model: dict, message: str) -> None:
    from elastic_pretrain.config import ConfigError
    from elastic_pretrain.model.config import ModelConfig
    from elastic_pretrain.parallel.megatron import check_pipeline
    from elastic_pretrain.parallel.mesh import ParallelConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_pipeline(ModelConfig(**model), ParallelConfig(pipeline=2))


def test_pipeline_needs_a_micro_batch_per_stage() -> None:
    from elastic_pretrain.config import ConfigError
    from elastic_pretrain.parallel.pipeline import check_micro_batches

    check_micro_batches(2, 2)
    with pytest.raises(ConfigError, match=re.escape("raise train.global_batch_size")):
        check_micro_batches(1, 2)
