"""Which code trained a run: the git commit of the checkout the package runs from, and whether it had
uncommitted changes to tracked files.

``summary.json`` keeps it (``"code"``), MLflow gets it as tags (tracking/tracker.py), and an experiment
report lists it per run and says when the runs it reads were trained by more than one version: an
experiment reuses a finished run whose config is unchanged whatever code trained it (docs/experiments.md).
Read from git without importing torch; a run directory is someone else's file, so what is read back
(:func:`code_label`, :func:`code_version`) is checked, never trusted."""

from __future__ import annotations

import functools
import hashlib
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
    """This process's code (once per process: the code does not change under a running trainer):

    - ``commit``: the checkout's commit (for people and MLflow), or ``unknown`` outside a git checkout;
    - ``tree``: the git tree of the package folder at that commit: equal across commits that did not touch
      the code (docs, jobs: a job's config is compared on its own), so this is what "the same code" means;
    - ``dirty``: ``true`` when tracked files of the package folder had uncommitted changes, and ``diff`` then
      the sha256 of those changes (two runs with different uncommitted edits are different code)."""
    commit = git("rev-parse", "HEAD")
    tree = git("rev-parse", "HEAD:./")
    changes = git("status", "--porcelain", "--untracked-files=no", ".")
    diff = git("diff", "HEAD", "--binary", "--", ".") if changes else ""
    return {
        "commit": commit if commit and _COMMIT.fullmatch(commit) else "unknown",
        "tree": tree if tree and _COMMIT.fullmatch(tree) else "unknown",
        "dirty": "unknown" if changes is None else str(bool(changes)).lower(),
        "diff": hashlib.sha256(diff.encode()).hexdigest() if changes and diff is not None else "",
    }


def _field(code: dict[str, Any], key: str) -> str | None:
    value = code.get(key)
    return value if isinstance(value, str) and _COMMIT.fullmatch(value) else None


def code_label(summary: dict[str, Any]) -> str:
    """A run's code in a report: its commit's first 10 hex digits, ``+`` when the code had uncommitted
    changes, ``unknown`` when the trainer was not in a git checkout, :data:`UNRECORDED` when ``summary.json``
    does not say (a run trained before the field existed, or a value that is not a commit)."""
    code = summary.get("code")
    if not isinstance(code, dict):
        return UNRECORDED
    if code.get("commit") == "unknown":
        return "unknown"
    commit = _field(code, "commit")
    return UNRECORDED if commit is None else commit[:10] + ("+" if code.get("dirty") == "true" else "")


def code_version(summary: dict[str, Any]) -> str:
    """What two runs must share to have been trained by the same code: the package tree (and the hash of
    uncommitted changes to it), shown as ``tree <10 hex>[+<6 hex>]``; a run that does not say is
    :data:`UNRECORDED` (or ``unknown``), its own version."""
    code = summary.get("code")
    label = code_label(summary)
    if not isinstance(code, dict) or label in (UNRECORDED, "unknown"):
        return label
    tree = _field(code, "tree")
    if tree is None:
        return UNRECORDED
    diff = code.get("diff")
    if code.get("dirty") != "true":
        return f"tree {tree[:10]}"
    if not isinstance(diff, str) or not re.fullmatch(r"[0-9a-f]{64}", diff):
        return UNRECORDED
    return f"tree {tree[:10]}+{diff[:6]}"


def mixed_code_note(summaries: Iterable[dict[str, Any]]) -> str | None:
    """One sentence when the runs a report reads were trained by more than one version of the code
    (:func:`code_version`), naming each version's commits and run count; else None."""
    versions: dict[str, Counter[str]] = {}
    for summary in summaries:
        versions.setdefault(code_version(summary), Counter())[code_label(summary)] += 1
    if len(versions) <= 1:
        return None
    parts = []
    for version, labels in sorted(versions.items(), key=lambda kv: (-sum(kv[1].values()), kv[0])):
        commits = ", ".join(f"`{label}`" for label in sorted(labels))
        parts.append(f"{version} x{sum(labels.values())}" + ("" if version == UNRECORDED else f" (commits {commits})"))
    return (
        f"**The runs were trained by {len(versions)} versions of the code** ({'; '.join(parts)}; `+`: uncommitted "
        "changes): a finished run whose config is unchanged is reused whatever code trained it, so the arms may "
        "differ by more than their configs; delete the run directories to train every run with one version."
    )
