"""The configuration reference is generated from the fields' docs and the page holds exactly it (issue 33)."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from elastic_pretrain.config_reference import entries, explain, reference, splice
from elastic_pretrain.errors import UserError
from tests.conftest import REPO, VENV_BIN

PAGE = REPO / "docs" / "configuration.md"


def test_the_page_holds_the_generated_reference():
    page = PAGE.read_text()
    assert splice(page) == page, (
        "docs/configuration.md's reference is stale: regenerate it with "
        "`python -c 'from pathlib import Path; from elastic_pretrain.config_reference import splice; "
        'p = Path("docs/configuration.md"); p.write_text(splice(p.read_text()))\'`'
    )


def test_every_section_and_key_is_in_it_with_a_doc():
    from elastic_pretrain.job import JobConfig

    rows = list(entries())
    sections = {e.key for e in rows if e.section and "." not in e.key}
    top = {f.name for f in dataclasses.fields(JobConfig)}
    assert {"model", "parallel", "data", "train", "schedule", "tracking", "checkpoint", "slurm", "decider",
            "deepspeed"} <= sections <= top  # fmt: skip
    undocumented = [e.key for e in rows if not e.doc]
    assert not undocumented, f"fields without doc=: {undocumented}"
    text = reference()
    for e in rows:
        if not e.section:
            assert f"| `{e.key}` |" in text, e.key


def test_explain_a_key_a_section_and_a_typo():
    one = explain("schedule.fixed_loops")
    assert one.startswith("schedule.fixed_loops (int | None; default None)") and "ELR" in one
    section = explain("checkpoint")
    assert all(line.startswith("  ") for line in section.splitlines()[1:]) and "checkpoint.interval" in section
    with pytest.raises(UserError, match="no key 'schedul': did you mean schedule"):
        explain("schedul")


def test_the_cli_explains_without_a_job_and_prints_its_version():
    proc = subprocess.run([str(VENV_BIN / "elastic-pretrain"), "config", "--explain", "train.lr"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert proc.stdout.startswith("train.lr (float; default")
    version = subprocess.run([str(VENV_BIN / "elastic-pretrain"), "--version"], cwd=REPO, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
    assert version.stdout.startswith("elastic-pretrain 0.")
