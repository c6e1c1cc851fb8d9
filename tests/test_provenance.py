"""Which code trained a run (elastic_pretrain/provenance.py): ``summary.json`` records the checkout's commit
and where this process took over, a report labels each run's code from that (checked: a run directory is
someone else's file) and says so when its runs were trained by more than one version."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from elastic_pretrain.provenance import UNRECORDED, code_identity, code_label, mixed_code_note
from elastic_pretrain.rundir import RunFiles
from elastic_pretrain.train.trainer import SummaryWriter, TrainState
from tests.conftest import REPO

SHA = "0123456789abcdef0123456789abcdef01234567"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="the suite runs from a git checkout (CI clones)")
def test_code_identity_is_this_checkout() -> None:
    code = code_identity()
    assert code["commit"] == _git("rev-parse", "HEAD")
    assert code["dirty"] == str(bool(_git("status", "--porcelain", "--untracked-files=no"))).lower()


def test_summary_records_the_code_and_where_this_process_took_over(mesh1, tmp_path: Path) -> None:
    SummaryWriter(tmp_path, mesh1, resumed_step=5).on_end(TrainState(step=9, tokens=9), {})
    code = json.loads(RunFiles(tmp_path).summary.read_text())["code"]
    assert code == {**code_identity(), "started_at_step": 5}
    assert code_label({"code": code}) == code_label({"code": code_identity()}) != UNRECORDED


@pytest.mark.parametrize(
    ("code", "label"),
    [
        ({"commit": SHA, "dirty": "false"}, "0123456789"),
        ({"commit": SHA, "dirty": "true"}, "0123456789+"),
        ({"commit": "unknown", "dirty": "unknown"}, "unknown"),  # trained outside a git checkout
        (None, UNRECORDED),  # a run from before summary.json recorded its code
        ("0123456789", UNRECORDED),
        ({"commit": "0123456"}, UNRECORDED),  # an abbreviation is not what the trainer writes
        ({"commit": "`| injected |" + SHA[:28], "dirty": "false"}, UNRECORDED),  # never rendered as given
        ({"commit": SHA.upper(), "dirty": "false"}, UNRECORDED),
    ],
)
def test_code_label_reads_summary_json_as_untrusted(code: object, label: str) -> None:
    summary = {} if code is None else {"code": code}
    assert code_label(summary) == label


def test_one_version_needs_no_note_several_are_counted() -> None:
    assert mixed_code_note(["0123456789"] * 3) is None
    note = mixed_code_note(["0123456789", UNRECORDED, "0123456789", "fedcba9876+"])
    assert note is not None and note.startswith("**The runs were trained by 3 code versions**")
    assert "(`0123456789` x2, `fedcba9876+` x1, `unrecorded` x1;" in note
