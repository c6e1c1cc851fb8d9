"""Transformer Engine's FP8 weight cache is refreshed once per step, by whatever model object the schedule is
handed, and evaluation never runs on weights from before the last update (issue 30, item 2).

Stand-in of TE's contract and the run: tests/dist/fp8_weight_cache.py. PP = 1 here, in one process; PP = 2 in
the 4-process launch of tests/parallel/test_pipeline.py (``test_fp8_weights_follow_the_optimizer_at_pp2``).
"""

from __future__ import annotations

from elastic_pretrain.parallel.mesh import ParallelConfig
from tests.dist.fp8_weight_cache import check_phases, run


def test_fp8_weights_follow_the_optimizer_at_pp1(mesh1) -> None:
    """megatron's schedule flags DDP's modules before micro-batch 0; ``loss_by_loops`` calls the model
    directly and flags them itself (before, evaluation used the FP8 copy cast before the last update)."""
    result = run(ParallelConfig(), pp_size=1)
    assert any(".experts." in n for n in result["layers"]) and any("linear_qkv" in n for n in result["layers"])
    check_phases(result)
