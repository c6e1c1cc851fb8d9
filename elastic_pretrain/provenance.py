"""Which code trained a run: the git commit of the checkout the package runs from, and whether it had
uncommitted changes to tracked files.

``summary.json`` keeps it (``"code"``), MLflow gets it as tags (tracking/tracker.py), and an experiment
report lists it per run and says when the runs it reads were trained by more than one version: an
experiment reuses a finished run whose config is unchanged whatever code trained it (docs/experiments.md).
Read from git without importing torch; a run directory is someone else's file, so what is read back
(:func:`code_label`) is checked, never trusted."""

from __future__ import annotations

import functools
import re
import subprocess
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # sha-1 or sha-256 object names
UNRECORDED = "unrecorded"


def git(*args: str) -> str | None:
    """``git <args>`` in the package's folder: its output, or None (no git, not a checkout, a timeout)."""
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


@functools.cache
def code_identity() -> dict[str, str]:
    """``{"commit": <sha> or "unknown", "dirty": "true" | "false" | "unknown"}`` of this process's code
    (once per process: the code does not change under a running trainer)."""
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": commit if commit and _COMMIT.fullmatch(commit) else "unknown",
        "dirty": "unknown" if dirty is None else str(bool(dirty)).lower(),
    }


def code_label(summary: dict[str, Any]) -> str:
    """A run's code in a report: the commit's first 10 hex digits, ``+`` when it had uncommitted changes,
    ``unknown`` when the trainer was not in a git checkout, :data:`UNRECORDED` when ``summary.json`` does
    not say (a run trained before the field existed, or a value that is not a commit)."""
    code = summary.get("code")
    if not isinstance(code, dict):
        return UNRECORDED
    commit, dirty = code.get("commit"), code.get("dirty")
    if commit == "unknown":
        return "unknown"
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        return UNRECORDED
    return commit[:10] + ("+" if dirty == "true" else "")


def mixed_code_note(labels: Iterable[str]) -> str | None:
    """One sentence when the runs a report reads were trained by more than one code version, else None."""
    seen = Counter(labels)
    if len(seen) <= 1:
        return None
    versions = ", ".join(f"`{label}` x{n}" for label, n in sorted(seen.items(), key=lambda kv: (-kv[1], kv[0])))
    return (
        f"**The runs were trained by {len(seen)} code versions** ({versions}; `+`: uncommitted changes): a "
        "finished run whose config is unchanged is reused whatever code trained it, so the arms may differ by "
        "more than their configs; delete the run directories to train every run with one version."
    )
