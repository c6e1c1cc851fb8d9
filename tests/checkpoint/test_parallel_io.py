"""Parallel checkpoint I/O (checkpoint/parallel_io.py, checkpoint/optim_state.py): 4 ranks, EP 2 — each
rank builds, writes, reads and loads into only its 1/DP share of the optimizer state, writes and reads
about 1/world of the model's bytes, and the spread load gives bitwise the tensors of a plain load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_pretrain.checkpoint.store import verify_share
from tests.conftest import REPO, torchrun

SCRIPT = REPO / "tests" / "dist" / "ckpt_reads.py"


def test_verify_share_splits_files_by_size_over_ranks():
    files = {f"f{i}": [size, 0] for i, size in enumerate([100, 90, 10, 10, 5, 1])}
    shares = [verify_share(files, r, 3) for r in range(3)]
    assert set().union(*shares) == set(files) and sum(len(s) for s in shares) == len(files)  # each file once
    assert shares == [{"f0"}, {"f1"}, {"f2", "f3", "f4", "f5"}]  # largest first, to the least-loaded rank


@pytest.mark.slow
def test_each_rank_reads_and_writes_its_share(tmp_path: Path) -> None:
    torchrun(SCRIPT, str(tmp_path), nproc=4, timeout=900, env={"PYTHONPATH": str(REPO)})
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    total, optim_total = results[0]["distcp_total"], results[0]["optim_total"]
    model_total = total - sum(r["written_optim"] for r in results)  # the model's bytes as stored
    # dense tensors are needed by 4 ranks and each expert half by 2: a fair share is total / 4
    # + one tensor (the greedy split's granularity) + .metadata, which the spread load reads twice
    slack = results[0]["largest_tensor"] + 2 * results[0]["metadata"]
    # the optimizer slices of the 4 ranks partition the state: each rank's 1/DP share is `owned`
    assert sum(r["owned"] for r in results) == optim_total
    for r in results:
        assert r["same"], r  # the spread load is bitwise the plain load
        assert r["owned"] <= optim_total / 4 + r["largest_tensor"], r
        # the optimizer state a rank builds to save (views of its own state, no copy) and to load into
        assert r["save_built"] == r["owned"] and r["save_copied"] == 0, r
        assert r["load_built"] == r["owned"], r
        # ... writes (raw tensor bytes; stored, each box carries torch.save's framing, < 2 KB) ...
        assert r["written_optim_raw"] == r["owned"], r
        assert r["written_optim"] - r["written_optim_raw"] <= 2048 * r["optim_items_written"], r
        # ... and reads back: exactly the items it wrote (same layout), with either load strategy
        assert r["spread_read_optim"] == r["plain_read_optim"] == r["written_optim"], r
        # the model: replicated over DP, read once per DP group by the spread load, by every replica without
        assert r["plain_read_model"] >= model_total / 2, r
        assert r["spread_read_model"] <= model_total / 4 + r["largest_model_tensor"], r
        assert r["spread_read"] <= total / 4 + slack, r
        assert r["written"] <= total / 4 + r["largest_tensor"], r
    assert sum(r["written"] for r in results) == total
