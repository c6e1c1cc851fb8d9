"""The GPU check (bench/gpu_check.sh, bench/gpu_check.py) on CPU, so that the first GPU run is not spent on a typo.

- ``--dry-run`` prints the plan: every section with its budget, the trainer first after ``env``, budgets (setup
  included) summing to at most 480 s — without torch, through the shell script.
- The runner (real sections stood in by functions of this module): a section that overruns its budget is
  stopped — its subprocess killed — and the next one runs; a failed check fails its section, an exception is
  reported, TE sections are skipped on a CUDA machine without TE, and nothing starts once the budget is spent.
- ``--toy`` (slow): every section at toy sizes, the trainer's kill and resume included; and the shell script under a
  small overall budget stops the section that overruns and still prints the summary.
- The trainer section's verdict on two histories.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import gpu_check
from bench.gpu_check import PLAN, SETUP_S, TOTAL_BUDGET_S, Section, run_sections
from tests.conftest import REPO, VENV_BIN

SCRIPT = REPO / "bench" / "gpu_check.sh"
ENV = {
    "PATH": f"{VENV_BIN}:/usr/bin:/bin",
    "PYTHON": str(VENV_BIN / "python"),
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(REPO),
}


def test_dry_run_prints_the_plan_within_eight_minutes():
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^\s+(\d+)\s+(\w+)\s+(\d+) s", proc.stdout, flags=re.M)
    names = [name for _, name, _ in rows]
    assert names == ["setup", *gpu_check.SECTIONS]
    assert names[1:3] == ["env", "trainer"]  # the most informative section first
    total = sum(int(b) for _, _, b in rows)
    assert total <= TOTAL_BUDGET_S == 480
    assert f"total {total} s" in proc.stdout and f"budgets summing to {total} s (limit 480 s" in proc.stdout
    only = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--only", "memory", "trainer"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert re.findall(r"^\s+\d+\s+(\w+)", only.stdout, flags=re.M) == ["setup", "trainer", "memory"]  # plan order


def test_an_unknown_section_is_refused_naming_the_sections():
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--only", "trainr"], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert proc.returncode == 2
    assert "invalid choice: 'trainr'" in proc.stderr and "'trainer'" in proc.stderr


def test_the_plan_names_real_sections_and_fits_the_budget():
    assert SETUP_S + sum(s.budget_s for s in PLAN) <= TOTAL_BUDGET_S
    for s in PLAN:
        assert callable(gpu_check.resolve(s.target)), s.target
    te = {s.name for s in PLAN if s.needs_te}
    assert te == {"trainer_fp8", "parity", "replay_fused", "fp8", "grouped"}


# ------------------------------------------------------------------------------------------------ the runner
def sleeps(ctx) -> None:
    time.sleep(60)


def sleeps_in_run(ctx) -> None:
    subprocess.run(["sleep", "60"], timeout=ctx.remaining() + 30)


def fails_a_check(ctx) -> None:
    ctx.failures += 1


def raises(ctx) -> None:
    raise ValueError("broken section")


def passes(ctx) -> None:
    ctx.ran.append("passes")


def section(name: str, fn: str, budget: int = 30, te: bool = False) -> Section:
    return Section(name, budget, f"tests.parallel.test_gpu_check:{fn}", te, name)


def fake_ctx(skip_te: bool = False) -> SimpleNamespace:
    return SimpleNamespace(skip_te=skip_te, failures=0, ran=[], deadline=0.0, remaining=lambda: 1.0)


def test_a_section_over_its_budget_is_stopped_and_the_next_runs():
    ctx = fake_ctx()
    lines: list[str] = []
    results = run_sections(
        [section("slow", "sleeps", budget=1), section("after", "passes")],
        ctx,
        deadline=time.monotonic() + 100,
        out=lines.append,
    )
    assert [(r.name, r.status) for r in results] == [("slow", "stopped"), ("after", "ok")]
    assert "overran its 1 s budget" in results[0].note and ctx.ran == ["passes"]
    assert any("slow: stopped at its budget" in line for line in lines)


def test_a_subprocess_of_an_overrunning_section_is_killed():
    ctx = fake_ctx()
    before = {p.pid for p in _sleep_children()}
    results = run_sections(
        [section("slow", "sleeps_in_run", budget=1)], ctx, deadline=time.monotonic() + 100, out=lambda s: None
    )
    assert results[0].status == "stopped"
    assert {p.pid for p in _sleep_children()} - before == set()  # subprocess.run killed its child on the way out


def _sleep_children() -> list[SimpleNamespace]:
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(os.getpid())], capture_output=True, text=True)
    return [SimpleNamespace(pid=int(line.split()[0])) for line in out.stdout.splitlines() if line.split()[1] == "sleep"]


def test_failures_errors_skips_and_a_spent_budget_are_reported():
    ctx = fake_ctx(skip_te=True)
    plan = [
        section("check", "fails_a_check"),
        section("boom", "raises"),
        section("needs_te", "passes", te=True),
        section("fine", "passes"),
    ]
    results = run_sections(plan, ctx, deadline=time.monotonic() + 100, out=lambda s: None)
    assert [(r.name, r.status) for r in results] == [
        ("check", "FAIL"),
        ("boom", "error"),
        ("needs_te", "skipped"),
        ("fine", "ok"),
    ]
    assert results[1].note == "ValueError: broken section"
    spent = run_sections([section("late", "passes")], fake_ctx(), deadline=time.monotonic() - 1, out=lambda s: None)
    assert [(r.name, r.status) for r in spent] == [("late", "not started")]
    assert "failed or stopped: check, boom" in gpu_check.summary(results, 1.0)


# ------------------------------------------------------------------------------------------------ the trainer's verdict
def hist(*losses: float) -> list[dict]:
    return [{"step": i + 1, "loss": x, "loss_by_loops": {"4": x}} for i, x in enumerate(losses)]


def test_the_resume_verdict():
    from bench.gpu_trainer import verdict

    assert verdict(hist(5.0, 4.0), hist(5.0, 4.0), None) == (True, "histories bitwise equal")
    assert not verdict(hist(5.0, 4.0), hist(5.0, 4.1), None)[0]  # differs, and no noise to compare with
    assert verdict(hist(5.0, 4.0), hist(5.0, 4.0 + 3e-4), hist(5.0, 4.0 + 1e-4))[0]  # within 4x the noise
    assert not verdict(hist(5.0, 4.0), hist(5.0, 4.2), hist(5.0, 4.0 + 1e-4))[0]  # a lost optimizer state
    assert not verdict(hist(5.0, 4.0), hist(5.0), hist(5.0, 4.0))[0]  # a step missing


# ------------------------------------------------------------------------------------------------ toy runs (slow)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_toy_run_runs_every_section_on_cpu():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--toy"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=880,
        env={**ENV, "MLFLOW_DISABLE_TELEMETRY": "true"},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:] + proc.stderr[-3000:]
    for name in gpu_check.SECTIONS:
        assert re.search(rf"^  {name}\s+ok\s", out, flags=re.M), (name, out[-3000:])
    assert "failed or stopped: none" in out and "FAIL:" not in out
    assert "PASS: fp32: history after kill + resume equals the uninterrupted run (histories bitwise equal)" in out
    assert "PASS: model.fp8 without CUDA + Transformer Engine is refused with exit 2" in out
    assert "model.fp8=tensorwise needs CUDA and Transformer Engine" in out  # refused on CPU, not dropped
    assert "PASS: route replay dispatch vs router (fp32): losses at every exit" in out
    assert "ℓ=4: max |TE - local|" in out and "looped / GPTModel tokens/s" in out
    for mode in ("none", "selective", "pass"):
        assert re.search(rf"^\s+{mode}\s+[\d.]+\s+[\d.]+", out, flags=re.M), mode


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_shell_stops_a_section_at_the_overall_budget_and_still_prints_the_summary(tmp_path: Path):
    # the trainer section stalls (GPU_CHECK_STALL): how long a real one takes depends on the machine
    env = {**ENV, "GPU_CHECK_BUDGET": "40", "GPU_CHECK_STALL": "trainer", "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--toy", "--only", "env", "trainer", "memory"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^  trainer\s+stopped\s", out, flags=re.M), out[-3000:]
    assert re.search(r"^  memory\s+not started\s", out, flags=re.M)
    assert "failed or stopped: trainer" in out
