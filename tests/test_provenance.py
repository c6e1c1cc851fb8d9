"""Which code trained a run (elastic_pretrain/provenance.py): ``summary.json`` records the checkout's commit
and where this process took over, a report labels each run's code from that (checked: a run directory is
someone else's file) and says so when its runs were trained by more than one version."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from elastic_pretrain.provenance import UNRECORDED, code_identity, code_label, code_version, mixed_code_note
from elastic_pretrain.rundir import RunFiles
from elastic_pretrain.train.trainer import SummaryWriter, TrainState
from tests.conftest import REPO

SHA = "0123456789abcdef0123456789abcdef01234567"
TREE = "fedcba9876543210fedcba9876543210fedcba98"
DIFF = "ab" * 32


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="the suite runs from a git checkout (CI clones)")
def test_code_identity_is_this_checkout() -> None:
    code = code_identity()
    assert code["commit"] == _git("rev-parse", "HEAD")
    assert code["tree"] == _git("rev-parse", "HEAD:elastic_pretrain")  # the package folder's tree, not the repo's
    changes = _git("status", "--porcelain", "--untracked-files=no", "--", "elastic_pretrain")
    assert code["dirty"] == str(bool(changes)).lower()
    assert (code["diff"] != "") == bool(changes)


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


def _summary(commit: str = SHA, tree: str = TREE, dirty: str = "false", diff: str = "") -> dict[str, object]:
    return {"code": {"commit": commit, "tree": tree, "dirty": dirty, "diff": diff}}


def test_the_version_is_the_package_tree_and_its_uncommitted_changes() -> None:
    assert code_version(_summary()) == code_version(_summary(commit=SHA[::-1])) == "tree fedcba9876"
    assert code_version(_summary(dirty="true", diff=DIFF)) == "tree fedcba9876+ababab"
    assert code_version(_summary(dirty="true", diff="not a hash")) == UNRECORDED
    assert code_version(_summary(tree="`|x|`")) == UNRECORDED
    assert code_version({}) == UNRECORDED and code_version(_summary(commit="unknown")) == "unknown"


def test_one_version_needs_no_note_several_are_counted() -> None:
    docs_only = [_summary(), _summary(commit=SHA[::-1]), _summary()]  # commits that did not touch the code
    assert mixed_code_note(docs_only) is None
    note = mixed_code_note([*docs_only, {}, _summary(tree=TREE[::-1], dirty="true", diff=DIFF)])
    assert note is not None and note.startswith("**The runs were trained by 3 versions of the code**")
    assert "(tree fedcba9876 x3 (commits `0123456789`, `76543210fe`); " in note
    assert "; tree 89abcdef01+ababab x1 (commits `0123456789+`); unrecorded x1; `+`" in note
