"""Peak memory per report window (issue 31 item 4; train/memory_peaks.py), on CPU by contract: a stand-in for
``torch.cuda`` keeps its peaks the way CUDA's caching allocator does — a running maximum of allocated and
reserved bytes that only ``reset_peak_memory_stats`` lowers (to what is in use then) — and the real progress
printer, MLflow callback and straggler report read it. On CPU nothing is read and the progress line is as before."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from elastic_pretrain.job_loader import load_job
from elastic_pretrain.schedule import ScheduleController
from elastic_pretrain.tracking import names
from elastic_pretrain.train.memory_peaks import MemoryPeaks
from elastic_pretrain.train.step import StepResult
from elastic_pretrain.train.step_timing import BusyClock
from elastic_pretrain.train.stragglers import StragglerReport
from elastic_pretrain.train.trainer import ProgressPrinter, TrackingCallback, TrainState
from tests.conftest import REPO

GiB = 2**30


class StandInCudaMemory:
    """The caching allocator's counters: allocated bytes, reserved bytes (blocks it keeps cached after a free),
    and their peaks since the last reset. Not a device: nothing here waits."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.resets = 0

    def malloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)  # freed blocks stay cached: reserved never shrinks
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, n: int) -> None:
        self.allocated -= n

    def max_memory_allocated(self) -> int:
        return self.peak_allocated

    def max_memory_reserved(self) -> int:
        return self.peak_reserved

    def reset_peak_memory_stats(self) -> None:
        self.resets += 1
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


class RecordingTracker:
    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged[step] = dict(metrics)


def _job(tmp_path: Path, *overrides: str):
    return load_job(
        REPO / "jobs" / "tiny-cpu.yaml",
        [
            "parallel=single",
            "train.steps=4",
            "train.warmup_steps=0",
            "train.log_interval=2",
            f"run_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


def _callbacks(job, peaks: MemoryPeaks | None) -> tuple[ProgressPrinter, TrackingCallback, RecordingTracker]:
    mesh = SimpleNamespace(is_logging_rank=True, world_size=1)
    ctl = ScheduleController(job.schedule, max_loops=job.model.max_loops, total_tokens=10**9, seed=0)
    tracking = TrackingCallback(job, mesh, job.run_path, peaks)  # type: ignore[arg-type]
    tracker = RecordingTracker()
    tracking.tracker = tracker  # type: ignore[assignment]
    return ProgressPrinter(job, mesh, ctl, peaks), tracking, tracker  # type: ignore[arg-type]


def _result() -> StepResult:
    return StepResult(loss=2.5, loss_by_loops={1: 2.5}, grad_norm=1.25, lr=1e-3, skipped=False, aux={})


def _train(cuda: StandInCudaMemory, callbacks: list, steps_gib: list[float]) -> None:
    """Each step allocates its activations (ℓ varies: so do they), then frees them, as a real step does."""
    state = TrainState()
    for gib in steps_gib:
        n = int(gib * GiB)
        cuda.malloc(n)
        cuda.free(n)
        state.step += 1
        for cb in callbacks:
            cb.on_step(state, _result(), step_s=0.5)


def test_each_report_shows_its_own_windows_peak(tmp_path, capsys) -> None:
    cuda = StandInCudaMemory()
    cuda.malloc(2 * GiB)  # the parameters, gradients and optimizer state: held for the run
    peaks = MemoryPeaks(cuda)
    job = _job(tmp_path)
    progress, tracking, tracker = _callbacks(job, peaks)
    # window 1 (steps 1-2): a deep step needs 8 GiB; window 2 (steps 3-4): shallow steps, 3 GiB
    _train(cuda, [progress, tracking], [1.0, 8.0, 3.0, 2.0])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    assert len(lines) == 2
    assert " tok/s | mem 10.0/10.0 GiB | fixed" in lines[0]
    # window 2's own peak: 2 + 3 GiB allocated (the 10 GiB reserved stay cached); a peak that was never reset
    # would say 10.0 again
    assert " tok/s | mem 5.0/10.0 GiB | fixed" in lines[1]
    assert tracker.logged[2][names.PEAK_ALLOCATED_GIB] == 10.0 and tracker.logged[2][names.PEAK_RESERVED_GIB] == 10.0
    assert tracker.logged[4][names.PEAK_ALLOCATED_GIB] == 5.0 and tracker.logged[4][names.PEAK_RESERVED_GIB] == 10.0
    assert names.PEAK_ALLOCATED_GIB == "memory/peak_allocated_gib" == names.sanitize(names.PEAK_ALLOCATED_GIB)
    assert cuda.resets == 4, "the counters are read at report cadence only: two readers, two reports"


def test_the_straggler_report_keeps_its_own_window(tmp_path, capsys) -> None:
    """Its interval (4) is not the progress line's (2): the progress line's reset at step 2 must not hide step
    2's peak from the straggler report at step 4; it names the rank with the highest peak."""
    cuda = StandInCudaMemory()
    peaks = MemoryPeaks(cuda)
    progress, _, _ = _callbacks(_job(tmp_path), peaks)
    logged: dict[int, dict[str, float]] = {}
    stragglers = StragglerReport(
        4,
        rank=0,
        is_logging_rank=True,
        log_metrics=lambda m, s: logged.update({s: m}),
        clock=BusyClock(torch.device("cpu"), cpu_clock=lambda: 0.0),
        peaks=peaks,
    )
    _train(cuda, [progress, stragglers], [1.0, 8.0, 3.0, 2.0])
    out = capsys.readouterr().out
    progress_lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert "mem 3.0/8.0 GiB" in progress_lines[1]  # the progress line at step 4: its window, steps 3-4
    assert "peak memory at step 4: most allocated on rank 0" in out and "8.0 GiB allocated / 8.0 GiB reserved" in out
    assert logged[4]["straggler/max_peak_allocated_gib"] == 8.0 and logged[4]["straggler/peak_memory_rank"] == 0.0
    stragglers.hosts = ["node0", "node1"]  # two ranks' rows, as the gather returns them
    stragglers.report_memory(8, [[1.0, 0.0, 1.0, 4.0 * GiB, 5.0 * GiB], [1.0, 0.0, 1.0, 6.0 * GiB, 6.5 * GiB]])
    assert logged[8]["straggler/peak_memory_rank"] == 1.0 and logged[8]["straggler/max_peak_reserved_gib"] == 6.5


def test_on_cpu_nothing_is_read_and_the_progress_line_is_unchanged(tmp_path, capsys) -> None:
    job = _job(tmp_path)
    progress, tracking, tracker = _callbacks(job, MemoryPeaks.on(torch.device("cpu")))
    _train(StandInCudaMemory(), [progress, tracking], [1.0, 1.0])
    line = capsys.readouterr().out.splitlines()[0]
    tokens = f"{job.tokens_per_step / 0.5:,.0f}"
    assert line == (
        f"step     2/4 [ 50.0%] loss 2.5000 (ℓ1=2.500) | lr 1.00e-03 | gnorm 1.25 | {tokens} tok/s | fixed | eta 1s"
    )
    assert not any(k.startswith("memory/") for k in tracker.logged[2])


@pytest.mark.parametrize("reader", ["progress", "tracking", "stragglers"])
def test_a_first_read_sees_the_peak_since_the_start(reader: str) -> None:
    cuda = StandInCudaMemory()
    cuda.malloc(3 * GiB)
    cuda.free(2 * GiB)
    assert MemoryPeaks(cuda).read(reader) == (3 * GiB, 3 * GiB)
