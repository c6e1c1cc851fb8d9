"""The set-up the quick end-to-end experiment tests share: a private copy of the repository's declarative side
(data and parallel presets, the job sets under test) with the prepared data cache linked in, and the experiment
command run in a fresh process (the trainer owns the process group and tears it down). Fixtures built on it:
tests/experiments/conftest.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO

# Each experiment's exit status, in one process; an exception in one is printed and the next still runs.
_RUN = textwrap.dedent(
    """
    import json, sys, traceback
    from elastic_pretrain.cli import main

    if __name__ == "__main__":
        seeds, names, codes = sys.argv[1], sys.argv[2:], {}
        for name in names:
            try:
                codes[name] = main(["experiment", name, "--quick", "--seeds", seeds])
            except BaseException:
                traceback.print_exc()
                codes[name] = -1
        print("CODES " + json.dumps(codes))
    """
)


def quick_workspace(root: Path, *sets: str) -> Path:
    """``root`` made a repository root for the experiment command: data and parallel presets, the job sets
    ``sets`` of jobs/experiments/ (copies: a test may edit them), the data cache (prepared once, linked)."""
    for folder in ("data", "parallel", *(f"jobs/experiments/{name}" for name in sets)):
        shutil.copytree(REPO / folder, root / folder)
    if not (REPO / "cache/stdlib-code/manifest.json").is_file():
        cmd = [sys.executable, "-m", "elastic_pretrain.cli", "prepare-data", "stdlib-code"]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=300)
    (root / "cache").symlink_to(REPO / "cache")
    return root


def run_python(root: Path, *args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """``python *args`` in ``root`` with this checkout importable, one thread per op, warnings off."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


@dataclasses.dataclass(frozen=True)
class QuickRun:
    """Quick experiments run together: their exit statuses, the process's output and where the reports are."""

    root: Path
    codes: dict[str, int]
    output: str

    @property
    def results(self) -> Path:
        return self.root / "runs/experiments-quick/results"

    def numbers(self, name: str) -> dict:
        """The experiment's JSON report, after asserting that it exited 0 (else its output is the message)."""
        assert self.codes.get(name) == 0, self.output[-8000:]
        return json.loads((self.results / f"{name}.json").read_text())


def quick_experiments(root: Path, *names: str, seeds: int = 1, timeout: int = 1800) -> QuickRun:
    """``experiment <name> --quick --seeds N`` for each name, in that order, in one fresh process in ``root``."""
    (root / "quick_run.py").write_text(_RUN)
    proc = run_python(root, "quick_run.py", str(seeds), *names, timeout=timeout)
    output = proc.stdout + proc.stderr
    codes = json.loads(proc.stdout.split("CODES ", 1)[1]) if "CODES " in proc.stdout else {}
    return QuickRun(root, codes, output)
