"""The GPU check's trainer sections: the real ``train`` command on a tiny job, strict device mode, kill and resume.

Three (or four) launches of ``elastic-pretrain train jobs/tiny-cpu.yaml`` on one GPU (one process, the TE spec
where TE exists), under ``ELASTIC_PRETRAIN_STRICT_DEVICES=1`` (every collective's tensors checked on the
device, parallel/strict.py):

1. ``full``: 30 steps uninterrupted;
2. ``split``: the same run saving every 15 steps and SIGKILLed at the start of its step-30 save
   (``ELASTIC_PRETRAIN_CKPT_FAULT``): step_15 is the newest checkpoint;
3. ``split`` again: resumes from step_15 and finishes.

The per-step history (summary.json: loss and per-exit losses, 30 steps, across the fixed → mixed switch at
75 % of tokens) of 3 must equal 1's. The runs ask torch for deterministic kernels (``warn_only``: an op without
one warns and runs anyway); if the histories are not bitwise equal, a fourth run — 1 again — measures the
run-to-run noise of the kernels that stayed nondeterministic, and the resumed run must stay within 4× it. A lost
optimizer state (issue 30 item 1: Adam's step under TE's FusedAdam) moves the first steps after the resume by
far more. ``trainer_fp8`` repeats it all with ``model.fp8=delayed``, whose amax histories live in the checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu_common import REPO, Ctx

# the `train` command with deterministic kernels requested first (the CLI itself leaves torch's default)
ENTRY = (
    "import sys, torch; torch.use_deterministic_algorithms(True, warn_only=True); "
    "from elastic_pretrain.cli import main; sys.exit(main(sys.argv[1:]))"
)
COMMON = ["parallel=single", "train.eval_sequences=4", "train.eval_interval=0", "tracking.backend=none"]
TIMING_KEYS = ("ghost_time_s",)  # history values measured with a clock (tests/checkpoint/runs.py)
NOISE_FACTOR = 4.0


def steps_for(ctx: Ctx) -> tuple[int, int]:
    """(steps, save at): 30 and 15; 4 and 2 at toy sizes."""
    return (4, 2) if ctx.toy else (30, 15)


def train_argv(ctx: Ctx, run_dir: Path, steps: int, overrides: list[str]) -> list[str]:
    """The tiny job in bf16 on a GPU (what a cluster runs); in fp32 at toy sizes on CPU, the code path only."""
    log = max(1, steps // 6)
    dtype = "bf16" if ctx.cuda or any(o.startswith("model.fp8=") for o in overrides) else "fp32"
    return [
        sys.executable,
        "-c",
        ENTRY,
        "train",
        "jobs/tiny-cpu.yaml",
        "--run-dir",
        str(run_dir),
        *COMMON,
        f"model.dtype={dtype}",
        f"train.steps={steps}",
        f"train.warmup_steps={max(1, steps // 10)}",
        f"train.log_interval={log}",
        *overrides,
    ]


def launch(ctx: Ctx, argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {
        **os.environ,
        "ELASTIC_PRETRAIN_STRICT_DEVICES": "1",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        **(env or {}),
    }
    return subprocess.run(argv, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=ctx.remaining())


def prepare_data(ctx: Ctx) -> None:
    """The tiny job's shards (cache/stdlib-code from this interpreter's standard library), unless there already
    (the train command checks them against their manifest)."""
    if (REPO / "cache" / "stdlib-code" / "manifest.json").is_file():
        return
    proc = launch(ctx, [sys.executable, "-c", ENTRY, "prepare-data", "stdlib-code"])
    if proc.returncode != 0:
        raise RuntimeError(f"prepare-data failed ({proc.returncode}): {proc.stderr[-2000:]}")


def history(run_dir: Path) -> list[dict[str, Any]]:
    steps = json.loads((run_dir / "summary.json").read_text())["history"]
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in steps]


def losses(hist: list[dict[str, Any]]) -> dict[tuple[int, str], float]:
    """Every loss value of the history (the objective and each exit's) by (step, key)."""
    out = {}
    for h in hist:
        out[(h["step"], "loss")] = float(h["loss"])
        out |= {(h["step"], f"ℓ{k}"): float(v) for k, v in h.get("loss_by_loops", {}).items()}
    return out


def max_diff(a: dict[tuple[int, str], float], b: dict[tuple[int, str], float]) -> float:
    """Largest |a - b| over shared keys; inf if the keys differ (a step or an exit missing)."""
    if a.keys() != b.keys():
        return float("inf")
    return max((abs(a[k] - b[k]) for k in a), default=0.0)


def verdict(
    full: list[dict[str, Any]],
    resumed: list[dict[str, Any]],
    noise: list[dict[str, Any]] | None,
) -> tuple[bool, str]:
    """(ok, detail): bitwise equal, or — given a repeat of the uninterrupted run — every loss within
    NOISE_FACTOR × the largest difference between the two uninterrupted runs."""
    if full == resumed:
        return True, "histories bitwise equal"
    diff = max_diff(losses(full), losses(resumed))
    if noise is None or diff == float("inf"):
        return False, f"max |Δloss| {diff:.3g}" + ("" if noise else ", no repeat run")
    floor = max_diff(losses(full), losses(noise))
    return diff <= NOISE_FACTOR * floor, (
        f"not bitwise: max |Δloss| {diff:.3g} vs {floor:.3g} between two uninterrupted runs (allowed {NOISE_FACTOR:g}x)"
    )


def resume_check(ctx: Ctx, tag: str, overrides: list[str]) -> None:
    from elastic_pretrain.checkpoint.store import FAULT_ENV

    steps, save_at = steps_for(ctx)
    root = ctx.workdir / tag
    full, split, again = root / "full", root / "split", root / "again"
    times = {}

    def run(
        name: str, run_dir: Path, extra: list[str], env: dict[str, str] | None = None, expect_ok: bool = True
    ) -> subprocess.CompletedProcess[str]:
        t0 = time.monotonic()
        proc = launch(ctx, train_argv(ctx, run_dir, steps, [*overrides, *extra]), env)
        times[name] = time.monotonic() - t0
        if expect_ok and proc.returncode != 0:
            raise RuntimeError(
                f"{tag} {name} run failed ({proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
            )
        return proc

    first = run("full", full, [])
    spec = next(
        (line.split(": ", 1)[-1] for line in (first.stdout + first.stderr).splitlines() if "layer spec" in line), "?"
    )
    print(f"  spec: {spec}")
    last_step = next((line for line in reversed(first.stdout.splitlines()) if line.startswith("step ")), "")
    print(f"  full:    {steps} steps in {times['full']:.1f} s | {last_step.strip()}")
    killed = run(
        "killed", split, [f"checkpoint.interval={save_at}"], {FAULT_ENV: f"before_tensors:0:{steps}"}, expect_ok=False
    )
    marker = split / "checkpoints" / "latest"
    latest = marker.read_text().strip() if marker.exists() else ""
    ctx.check(
        f"{tag}: the run died at its step-{steps} save (SIGKILL) with step_{save_at} committed",
        killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) and latest == f"step_{save_at}",
        f"exit {killed.returncode}, latest {latest or 'none'}",
    )
    resumed = run("resumed", split, [f"checkpoint.interval={save_at}"])
    print(f"  killed at step {steps} in {times['killed']:.1f} s; resumed in {times['resumed']:.1f} s")
    ctx.check(
        f"{tag}: the resumed run started from step_{save_at}", f"step_{save_at} (step {save_at}" in resumed.stdout
    )
    a, b = history(full), history(split)
    ctx.check(f"{tag}: the resumed history holds steps 1..{steps}", [h["step"] for h in b] == list(range(1, steps + 1)))
    noise = None
    if a != b:
        run("again", again, [])
        noise = history(again)
    ok, detail = verdict(a, b, noise)
    ctx.check(f"{tag}: history after kill + resume equals the uninterrupted run", ok, detail)


def section_trainer(ctx: Ctx) -> None:
    prepare_data(ctx)
    resume_check(ctx, "bf16" if ctx.cuda else "fp32", [])


def section_trainer_fp8(ctx: Ctx) -> None:
    """``model.fp8=delayed``: refused in one line without CUDA + TE (printed: the toy run on CPU ends there)."""
    if not ctx.te:
        prepare_data(ctx)
        steps, _ = steps_for(ctx)
        proc = launch(ctx, train_argv(ctx, ctx.workdir / "fp8-refused", steps, ["model.fp8=delayed"]))
        message = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
        print(f"  not run here (exit {proc.returncode}): {message[0]}")
        ctx.check("model.fp8 without CUDA + Transformer Engine is refused with exit 2", proc.returncode == 2)
        return
    prepare_data(ctx)
    resume_check(ctx, "fp8-delayed", ["model.fp8=delayed"])
