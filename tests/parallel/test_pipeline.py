"""Pipeline parallelism of the loop, in one 4-process torchrun launch (tests/dist/pipeline_checks.py).

Parity (tests/dist/pipeline_parity.py): PP=2 x EP=2 gives the 1-process loss, loss per exit and every
gradient — 2 stages x 2 replicas, the EP group pairing the replicas' ranks of a stage — at fixed depth
and at mixed depth (ℓ per micro-batch and replica, extra exits, route replay and the loop-conditioning
head on), also with train.recompute=pass (every chunk and ghost chunk re-run in backward).
Tolerance: fp32, rtol=1e-4 / atol=1e-6 on gradients, rel 1e-5 on losses — sums are reassociated across
ranks, nothing else differs.

Resume (tests/dist/pipeline_resume.py): the trainer at PP=2 (preset cpu-pp2) and checkpoints across
pipeline layouts, model and optimizer. Uninterrupted 4-step runs at PP=1 (A) and PP=2 (B) with mixed
depth (independent-rank ℓ), route replay and the loop-conditioning head; then A's step-2 checkpoint
resumed at PP=2 (D) and B's at PP=1 (C). The resumed runs must continue exactly as the uninterrupted
ones: per-step losses (rel 1e-6), final parameters and Adam moments (rtol 1e-5, atol 1e-8 — fp32; the
same sums in a different grouping at most), validation loss per loop count and routing health (rel
1e-6 / 1e-5: the pipeline accumulates per-micro-batch sums in another order).

FP8 weight cache (tests/dist/fp8_weight_cache.py): at PP=2 every TE-style layer of both stages re-quantizes its
weight exactly once per step and in evaluation, never computing with a copy of an older weight.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, VENV_BIN, torchrun

SCRIPT = REPO / "tests" / "dist" / "pipeline_checks.py"


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cli = str(VENV_BIN / "elastic-pretrain")
    subprocess.run([cli, "prepare-data", "stdlib-code"], cwd=REPO, check=True, capture_output=True, timeout=300)
    out = tmp_path_factory.mktemp("pipeline")
    torchrun(SCRIPT, str(out), nproc=4, timeout=900, env={"PYTHONPATH": str(REPO), "TMPDIR": str(out)})
    return out


@pytest.fixture(scope="module")
def results(launch: Path) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for f in sorted((launch / "parity").glob("result_*.json")):
        _, layout, case, _ = f.stem.split("_")
        found.setdefault(f"{layout}/{case}", []).append(json.loads(f.read_text()))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fixed", "mixed", "mixedrecompute"])
@pytest.mark.parametrize(("layout", "ranks"), [("pp2ep2", 4)])
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
    if case.startswith("mixed"):  # ℓ differed between micro-batches: every exit was supervised somewhere
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


def _summary(runs: Path, name: str) -> dict:
    return json.loads((runs / name / "summary.json").read_text())


def _tensors(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "model_optim", out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
@pytest.mark.parametrize(("resumed", "uninterrupted"), [("C", "B"), ("D", "A")], ids=["pp2->pp1", "pp1->pp2"])
def test_resume_at_another_pipeline_layout_continues_the_run(launch: Path, resumed: str, uninterrupted: str) -> None:
    runs = launch / "resume"
    got, want = _summary(runs, resumed), _summary(runs, uninterrupted)
    assert want["steps"] == got["steps"] == 4
    pp = {"A": 1, "B": 2, "C": 1, "D": 2}
    assert got["layout"]["pp"] == pp[resumed] and want["layout"]["pp"] == pp[uninterrupted]
    after = {h["step"]: h for h in want["history"]}
    assert [h["step"] for h in got["history"]] == [3, 4]  # only the steps this run trained
    for h in got["history"]:
        assert h["loss"] == pytest.approx(after[h["step"]]["loss"], rel=1e-6)
        assert h["loss_by_loops"].keys() == after[h["step"]]["loss_by_loops"].keys()
    assert len({tuple(h["loss_by_loops"]) for h in want["history"]}) > 1  # mixed depth: ℓ varied
    assert got["val_loss_by_loops"].keys() == want["val_loss_by_loops"].keys() == {"1", "2", "3"}
    for k, v in want["val_loss_by_loops"].items():
        assert got["val_loss_by_loops"][k] == pytest.approx(v, rel=1e-6)
    # routing health of the last step, per (core layer, pass), from every stage
    assert got["routing"].keys() == want["routing"].keys()
    assert {where.split("/")[0] for where in got["routing"]} == {"0", "1"}  # both stages' core layers
    for where, stats in want["routing"].items():
        for stat, v in stats.items():
            assert got["routing"][where][stat] == pytest.approx(v, rel=1e-5, abs=1e-7), (where, stat)
    # the final checkpoints hold the same model and optimizer state under the same keys
    a = _tensors(runs / resumed / "checkpoints" / "step_4", runs / f"{resumed}.pt")
    b = _tensors(runs / uninterrupted / "checkpoints" / "step_4", runs / f"{uninterrupted}.pt")
    assert a.keys() == b.keys()
    assert any(k.startswith("optimizer.exp_avg_sq.") for k in a) and any(".passes.2." in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-8, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_pipeline_stages_start_from_their_own_initialisation(launch: Path) -> None:
    """Not a requirement, a documented fact (docs/parallelism.md): each stage initialises only its layers,
    so a run's first loss depends on the pipeline layout — and the trainer at PP=2 still learns."""
    runs = launch / "resume"
    b = [h["loss"] for h in _summary(runs, "B")["history"]]
    a = [h["loss"] for h in _summary(runs, "A")["history"]]
    assert b[0] != a[0]
    assert b[-1] < b[0] - 0.2


@pytest.mark.slow
def test_fp8_weights_follow_the_optimizer_at_pp2(launch: Path) -> None:
    """Issue 30, item 2: megatron's schedule flags a chunk's modules through ``PassChunk.set_is_first_microbatch``;
    before it had none, so from step 2 on every TE GEMM ran on the FP8 weights cast at step 1. Chunk 0 flags
    the stage's modules once per step (the other chunks, sharing them, must not re-flag)."""
    from tests.dist.fp8_weight_cache import check_phases

    stages = []
    for rank in range(2):
        result = json.loads((launch / "fp8_cache" / f"fp8_cache_rank{rank}.json").read_text())
        check_phases(result)
        stages.append(result["stage"])
        # stage 0 holds the prelude and core layer 0, stage 1 core layer 1 and the coda: each its shared experts
        assert any(".experts." in n for n in result["layers"])
    assert stages == [0, 1]
