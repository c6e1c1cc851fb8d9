"""docs/recipes.md states what the code computes for each shipped GPU job (layout, memory estimate,
parameter counts, tokens): the lines `config --world-size` prints must appear there verbatim."""

from __future__ import annotations

import pytest

from elastic_pretrain.job_loader import load_job
from elastic_pretrain.model.params import count_parameters, format_count
from elastic_pretrain.train.commands import layout_summary
from tests.conftest import REPO

DOC = REPO / "docs" / "recipes.md"
JOBS = {"gpu-1node": 8, "gpu-2node": 16, "gpu-16node": 128}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_recipes_doc_matches_the_code(name: str) -> None:
    text = DOC.read_text()
    job = load_job(REPO / "jobs" / f"{name}.yaml")
    for line in layout_summary(job, JOBS[name]):
        assert f"# {line}" in text, f"docs/recipes.md is out of date for {name}: {line}"
    counts = count_parameters(job.model)
    row = f"| `jobs/{name}.yaml` |"
    assert row in text
    table_row = next(ln for ln in text.splitlines() if ln.startswith(row))
    assert f"{format_count(counts.total)} / {format_count(counts.active)}" in table_row
