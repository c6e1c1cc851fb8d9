"""Every command of README.md, top to bottom, as a new user runs them in a fresh clone (issue 33, item 2).

The README's ```bash blocks are read in order and each line is run, in a copy of the repository (its
tracked and untracked-but-not-ignored files; ``.venv`` links to this one's, which must be set up) whose
``runs/``, ``cache/`` and ``exports/`` start empty; each must exit 0.

Substitution rule (the README's runs take minutes each; what changes is only how long they train):

* a training command (``elastic-pretrain train`` or ``bash scripts/run-default.sh``) trains 1/50 of its
  steps: ``train.steps=K`` becomes ``train.steps=max(2, K // 50)``, and one without ``train.steps`` gets its
  job's ``train.steps // 50`` appended (tiny-cpu 300 -> 6, tiny-decider 150 -> 3, train.steps=400 -> 8);
  ``train.warmup_steps=1`` is appended (a warmup must be shorter than the run). The ratios stay: the
  README's ``train.steps=400`` after the default 300 still trains the finished run further;
* not run: ``bash scripts/test.sh`` (this suite) and ``mlflow ui`` (a server that never exits; its store,
  the file the command names, must exist instead).

Checked besides the exit codes: the default run finishes, ``train.steps=400`` trains that finished run
further at the end of its schedule (min_lr, mixed depth) and finishes again, the changed shape gets its
own run directory, and the Slurm dry run's pre-flight passes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(3600)]  # ~9 min: beyond CI (docs/testing.md)

DIVISOR = 50
SKIP = ("scripts/test.sh", "mlflow ui")


def readme_commands() -> list[str]:
    """The lines of README.md's ```bash blocks, in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.M | re.S)
    return [ln.strip() for block in blocks for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]


def is_training(argv: list[str]) -> bool:
    cli_train = argv[0].endswith("/elastic-pretrain") and argv[1] == "train"
    return argv[:2] == ["bash", "scripts/run-default.sh"] or cli_train


def job_file(argv: list[str]) -> str:
    return "jobs/tiny-cpu.yaml" if argv[0] == "bash" else argv[2]


def shortened(argv: list[str], repo: Path) -> list[str]:
    """The substitution rule of the module docstring."""
    if not is_training(argv):
        return argv
    out = [f"train.steps={max(2, int(a.split('=', 1)[1]) // DIVISOR)}" if a.startswith("train.steps=") else a
           for a in argv]  # fmt: skip
    if not any(a.startswith("train.steps=") for a in argv):
        steps = yaml.safe_load((repo / job_file(argv)).read_text())["train"]["steps"]
        out.append(f"train.steps={steps // DIVISOR}")
    return [*out, "train.warmup_steps=1"]


def mlflow_store(line: str) -> Path:
    """The SQLite file an ``mlflow ui`` line opens: ``sqlite:///NAME``, in the folder a ``(cd DIR && ...)`` enters."""
    folder = re.search(r"\(cd (\S+) &&", line)
    name = re.search(r"sqlite:///([^\s)]+)", line)
    assert name, f"{line}: no sqlite:/// store"
    return Path(folder.group(1) if folder else ".") / name.group(1)


def setup_stamp() -> Path:
    """The stamp scripts/setup.sh leaves in a venv set up for this tree (its own hash of the same files)."""
    files = [REPO / "pyproject.toml", *sorted((REPO / "requirements").glob("*.txt")), REPO / "scripts" / "setup.sh"]
    digest = hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    return REPO / ".venv" / f".setup-{digest}"


def fresh_clone(dest: Path) -> Path:
    """The repository's files as a clone has them (tracked, and untracked ones git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".venv").symlink_to(REPO / ".venv")
    return dest


def finished_step(run: Path) -> int:
    return json.loads((run / "FINISHED").read_text())["step"]


def test_readme_commands_run_top_to_bottom(tmp_path: Path) -> None:
    if not setup_stamp().exists():  # run-default.sh would install into the shared venv
        pytest.fail("the venv is not set up for this tree: run `bash scripts/setup.sh` first")
    repo = fresh_clone(tmp_path / "clone")
    # the copy's package, not the one the venv's editable install points at
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    env.pop("MLFLOW_TRACKING_URI", None)
    ran = []
    for line in readme_commands():
        if any(skip in line for skip in SKIP):
            if "mlflow ui" in line:
                assert (repo / mlflow_store(line)).is_file(), f"{line}: no store {mlflow_store(line)}"
            continue
        argv = shlex.split(line, comments=True)
        cmd = shortened(argv, repo)
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}"  # fmt: skip
        ran.append((line, proc.stdout + proc.stderr))
    runs = repo / "runs"
    out = dict(ran)
    default, further = "bash scripts/run-default.sh", next(ln for ln, _ in ran if "train.steps=400" in ln)
    assert "trained 6 steps" in out[default]
    assert "goes past this run's 6-step schedule: steps 7..8 train at its end (learning rate 3.00e-04, mixed" \
           in out[further] and finished_step(runs / "tiny-cpu") == 8  # fmt: skip
    assert finished_step(runs / "tiny-loops3") == 2 and finished_step(runs / "tiny-pp2") == 6
    assert finished_step(runs / "tiny-decider") == 3 and (repo / "exports" / "tiny-cpu" / "config.json").is_file()
    assert len(ran) == len(readme_commands()) - 2  # all but test.sh and mlflow ui
