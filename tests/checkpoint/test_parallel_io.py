"""Parallel checkpoint I/O (checkpoint/parallel_io.py): 4 ranks, EP 2 — each rank writes and reads about
1/world of the checkpoint's bytes, and the spread load gives bitwise the tensors of a plain load."""

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
    total = results[0]["distcp_total"]
    # dense tensors are needed by 4 ranks and each expert half by 2: a fair read share is total / 4
    # + one tensor (the greedy split's granularity) + .metadata, which the spread load reads twice
    slack = results[0]["largest_tensor"] + 2 * results[0]["metadata"]
    for r in results:
        assert r["same"], r  # the spread load is bitwise the plain load
        assert r["spread_read"] <= total / 4 + slack, r
        assert r["plain_read"] >= total / 2, r  # without spreading, every replica reads all it needs
        assert r["written"] <= total / 4 + r["largest_tensor"], r
    assert sum(r["written"] for r in results) == total
