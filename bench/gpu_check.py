"""The GPU check: the first thing to run on a CUDA machine (bench/gpu_check.sh runs it; docs/gpu.md "GPU check").

    python bench/gpu_check.py --dry-run          # the plan: sections, budgets, their sum (no torch, any machine)
    python bench/gpu_check.py                    # every section, each stopped at its budget
    python bench/gpu_check.py --only trainer memory
    python bench/gpu_check.py --toy              # every section at toy sizes on this machine (tests on CPU)

One process, one GPU, one time budget: the plan's budgets (the shell's setup included) sum to at most
:data:`TOTAL_BUDGET_S`, and the sections run most informative first — the real trainer before the kernels'
numerics before speed — so a run cut short has already answered the first questions. A section that overruns its
budget is stopped (SIGALRM; its subprocesses are killed with it) and the next one starts; every section prints
its figures, checks print ``PASS``/``FAIL`` lines, and a summary table closes the run (also when the shell's
overall timeout interrupts it). Sections that need Transformer Engine are skipped on a CUDA machine without it
(they run their code paths at toy sizes on CPU). The sections live in bench/gpu_trainer.py, gpu_numerics.py and
gpu_perf.py as functions of a :class:`bench.gpu_common.Ctx`, so a CPU test runs each of them.
``GPU_CHECK_STALL=name[,name]`` (tests only) makes those sections sleep past their budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOTAL_BUDGET_S = 480  # issue 30: one run of the whole check on one H200 within 8 minutes
SETUP_S = 25  # the shell's wheel install and nvidia-smi, and this process's imports of torch and megatron
TOY_SCALE = 6  # --toy on a loaded 2-core CPU: every budget times this (the code paths matter, not the time)


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    budget_s: int
    target: str  # "module:function", the function taking a Ctx
    needs_te: bool
    what: str


PLAN: tuple[Section, ...] = (
    Section(
        "env",
        10,
        "bench.gpu_common:section_env",
        False,
        "versions, device, layer spec, TF32 state; which sections are skipped",
    ),
    Section(
        "trainer",
        90,
        "bench.gpu_trainer:section_trainer",
        False,
        "`train` (tiny job, bf16, strict device mode): 30 steps vs save at 15, kill, resume",
    ),
    Section(
        "trainer_fp8",
        70,
        "bench.gpu_trainer:section_trainer_fp8",
        True,
        "the same with model.fp8=delayed (amax histories in the checkpoint)",
    ),
    Section(
        "parity",
        35,
        "bench.gpu_numerics:section_parity",
        True,
        "TE vs local spec, fp32 logits at every ℓ (TF32 off, route replay off); 30 bf16 steps",
    ),
    Section(
        "replay_fused",
        20,
        "bench.gpu_numerics:section_replay_fused",
        True,
        "route replay through TE's fused permute vs the unfused one: losses and gradients",
    ),
    Section(
        "replay_size",
        45,
        "bench.gpu_numerics:section_replay_size",
        False,
        "route replay at hidden 1024, 16k tokens: dispatch and router losses equal; step time vs off",
    ),
    Section(
        "fp8",
        50,
        "bench.gpu_numerics:section_fp8",
        True,
        "bf16 vs tensorwise vs delayed, 100 steps at hidden 1024; GEMMs inside the FP8 autocast",
    ),
    Section(
        "memory",
        40,
        "bench.gpu_perf:section_memory",
        False,
        "activation bytes per pass vs parallel/memory.py, recompute none/selective/pass",
    ),
    Section(
        "mfu",
        30,
        "bench.gpu_perf:section_mfu",
        False,
        "looped ℓ=4 vs GPTModel with the same layers: tokens/s and MFU (train/mfu.py)",
    ),
    Section(
        "grouped", 15, "bench.gpu_perf:section_grouped", True, "MoE MLP fwd+bwd: TE grouped GEMM vs the per-expert loop"
    ),
    Section("pytest_gpu", 50, "bench.gpu_perf:section_pytest_gpu", False, "pytest -m gpu tests/gpu"),
)
SECTIONS = tuple(s.name for s in PLAN)


class Overrun(BaseException):
    """Raised in a section when its budget is spent. A BaseException, so that a section's own ``except
    Exception`` does not swallow it; ``subprocess.run`` kills its child on the way out."""


@dataclasses.dataclass
class Result:
    name: str
    status: str  # ok | FAIL | error | stopped | skipped | not started
    seconds: float
    note: str = ""


def plan_for(only: list[str] | None) -> list[Section]:
    return [s for s in PLAN if not only or s.name in only]


def format_plan(sections: list[Section], *, scale: int = 1) -> str:
    total = SETUP_S + sum(s.budget_s for s in sections)
    lines = [
        f"gpu_check plan: {len(sections)} sections, budgets summing to {total * scale} s "
        f"(limit {TOTAL_BUDGET_S * scale} s; setup {SETUP_S * scale} s)"
    ]
    lines.append(f"  {'#':>2}  {'section':<13} {'budget':>7}  {'TE':<3} what")
    lines.append(f"  {0:>2}  {'setup':<13} {SETUP_S * scale:>5} s  {'':<3} wheels, nvidia-smi, imports")
    for i, s in enumerate(sections, 1):
        lines.append(f"  {i:>2}  {s.name:<13} {s.budget_s * scale:>5} s  {'yes' if s.needs_te else '':<3} {s.what}")
    lines.append(f"  total {total * scale} s")
    return "\n".join(lines)


@contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise :class:`Overrun` in this (main) thread after ``seconds``."""

    def fire(signum: int, frame: Any) -> None:
        raise Overrun

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def resolve(target: str) -> Callable[[Any], None]:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def run_sections(
    sections: list[Section],
    ctx: Any,
    *,
    deadline: float,
    scale: int = 1,
    out: Callable[[str], None] = print,
    record: Callable[[Result], None] = lambda r: None,
) -> list[Result]:
    """Run ``sections`` in order, each within min(its budget × ``scale``, the time left to ``deadline``)."""
    results: list[Result] = []
    for s in sections:
        left = deadline - time.monotonic()
        if left < 1:
            results.append(Result(s.name, "not started", 0.0, "the overall budget is spent"))
            record(results[-1])
            continue
        if s.needs_te and ctx.skip_te:
            out(f"== {s.name}: skipped (needs Transformer Engine, absent on this CUDA machine)")
            results.append(Result(s.name, "skipped", 0.0, "no Transformer Engine"))
            record(results[-1])
            continue
        budget = min(s.budget_s * scale, left)
        out(f"== {s.name} (budget {budget:.0f} s): {s.what}")
        failed_before = ctx.failures
        t0 = time.monotonic()
        ctx.deadline = t0 + budget
        status, note = "ok", ""
        try:
            with alarm(budget):
                if s.name in os.environ.get("GPU_CHECK_STALL", "").split(","):
                    time.sleep(budget + 60)  # tests only: a section that cannot finish (the budget must stop it)
                resolve(s.target)(ctx)
        except Overrun:
            status, note = "stopped", f"overran its {budget:.0f} s budget"
            out(f"   {s.name}: stopped at its budget ({budget:.0f} s); what it printed above stands")
        except Exception as err:  # a section's failure is reported, and the next section runs
            status, note = "error", f"{type(err).__name__}: {err}".splitlines()[0][:160]
            traceback.print_exc(file=sys.stdout)
        if status == "ok" and ctx.failures > failed_before:
            status, note = "FAIL", f"{ctx.failures - failed_before} check(s) failed"
        results.append(Result(s.name, status, time.monotonic() - t0, note))
        record(results[-1])
        out(f"   ({results[-1].seconds:.1f} s)")
    return results


def summary(results: list[Result], elapsed: float) -> str:
    lines = [f"== summary ({elapsed:.0f} s)", f"  {'section':<13} {'status':<12} {'s':>6}  note"]
    lines += [f"  {r.name:<13} {r.status:<12} {r.seconds:>6.1f}  {r.note}" for r in results]
    bad = [r.name for r in results if r.status in ("FAIL", "error", "stopped")]
    lines.append(f"== done; failed or stopped: {', '.join(bad) or 'none'}")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan with its budgets and exit")
    parser.add_argument("--toy", action="store_true", help="toy sizes on this machine, budgets x6 (CPU test)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run these sections only (of: {', '.join(SECTIONS)})",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for all sections (default: {TOTAL_BUDGET_S} - setup {SETUP_S}, x6 with --toy)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sections = plan_for(args.only)
    scale = TOY_SCALE if args.toy else 1
    if args.dry_run:
        print(format_plan(sections, scale=scale))
        return 0
    start = time.monotonic()
    deadline = start + (args.budget if args.budget is not None else (TOTAL_BUDGET_S - SETUP_S) * scale)
    warnings.filterwarnings("ignore")  # the libraries' deprecations would bury the figures
    from bench.gpu_common import make_ctx  # torch and megatron from here on

    ctx = make_ctx(toy=args.toy)
    results: list[Result] = []
    try:
        results = run_sections(sections, ctx, deadline=deadline, scale=scale, record=results.append)
    except KeyboardInterrupt:  # the shell's overall timeout (SIGINT): say where it stopped, keep what ran
        done = {r.name for r in results}
        current = next((s.name for s in sections if s.name not in done), "?")
        results.append(Result(current, "stopped", 0.0, "interrupted by the overall timeout"))
    finally:
        ctx.close()
    print(summary(results, time.monotonic() - start), flush=True)
    return 0 if all(r.status in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # the summary is out: skip the interpreter's shutdown, which with torch, megatron and a process group loaded
    # can take seconds of the overall budget (the shell's timeout would then report a finished run as stopped)
    os._exit(code)
