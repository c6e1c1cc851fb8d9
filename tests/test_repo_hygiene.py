"""The repository tracks no symlinks: a symlink a developer made for a local setup (``cache`` -> a shared
data directory, ``.venv``) that gets committed replaces the ignored directory of that name in every checkout
(git treats ignored files as expendable), and in a fresh clone it points at a path that does not exist."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout")
def test_no_tracked_symlinks() -> None:
    out = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, check=True, capture_output=True, text=True).stdout
    links = [line.split("\t", 1)[1] for line in out.splitlines() if line.startswith("120000 ")]
    assert not links, f"tracked symlinks {links}: git rm --cached them (local links belong in .gitignore)"
