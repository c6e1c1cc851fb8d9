"""Small frictions of a new user's first runs (issue #21, item 7): a short run of the default job, a data
recipe given as a path."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from elastic_pretrain.config import ConfigError
from elastic_pretrain.job_loader import load_job
from tests.conftest import REPO, VENV_BIN


def test_a_short_run_names_the_warmup_override() -> None:
    """tiny-cpu warms up for 30 steps: train.steps=20 is refused with the override that makes it run."""
    with pytest.raises(ConfigError, match=r"add train\.warmup_steps=2 ") as err:
        load_job(REPO / "jobs" / "tiny-cpu.yaml", ["train.steps=20"])
    fix = str(err.value).split("add ")[1].split(" ")[0]
    assert load_job(REPO / "jobs" / "tiny-cpu.yaml", ["train.steps=20", fix]).train.warmup_steps == 2


def test_data_recipe_as_a_path(tmp_path: Path) -> None:
    recipe = tmp_path / "recipes" / "mine.yaml"
    recipe.parent.mkdir()
    shutil.copy(REPO / "data" / "stdlib-code.yaml", recipe)
    recipe.write_text(recipe.read_text().replace("seq_len: 128", "seq_len: 64"))
    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", [f"data={recipe}"])
    assert job.data.seq_len == 64
    # the CLI: the same override, and a missing file is one line naming it
    cli = str(VENV_BIN / "elastic-pretrain")
    shown = subprocess.run([cli, "config", "jobs/tiny-cpu.yaml", f"data={recipe}"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0 and "seq_len: 64" in shown.stdout, shown.stderr
    missing = subprocess.run([cli, "config", "jobs/tiny-cpu.yaml", f"data={tmp_path}/nope.yaml"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert f"data: {tmp_path}/nope.yaml: no such file" in missing.stderr
