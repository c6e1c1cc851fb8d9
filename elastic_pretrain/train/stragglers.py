"""Straggler report: every ``train.straggler_interval`` steps, each rank's busy time per step and data
wait are gathered; the slowest rank, its ratio to the median and its host are printed and logged.

A slow rank does not show in wall-clock step time (collectives make every rank wait for it); it
shows in *busy* time. On CPU that is the training thread's CPU time (gloo waits block without
spinning); on GPU it is the step's time on the device's stream, from CUDA events read once per report
(train/step_timing.py; docs/faults.md). On CUDA each rank's peak allocated / reserved memory of the window
travels in the same gather (train/memory_peaks.py): the report names the rank with the highest peak — under
expert parallelism the one whose experts received the most tokens.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from elastic_pretrain.parallel.device import device
from elastic_pretrain.train.memory_peaks import MemoryPeaks, gib
from elastic_pretrain.train.step_timing import BusyClock

DATA_WAIT_KEY = "time/data_wait_s"  # StepResult.aux entry the Trainer fills


class StragglerReport:
    """Trainer callback; ``on_step`` is collective every ``interval`` steps (every rank calls it at the same step)."""

    def __init__(
        self,
        interval: int,
        rank: int,
        is_logging_rank: bool,
        log_metrics: Callable[[dict[str, float], int], None] = lambda m, s: None,
        set_tags: Callable[[dict[str, str]], None] = lambda t: None,
        clock: BusyClock | None = None,
        peaks: MemoryPeaks | None = None,
    ) -> None:
        self.clock = clock or BusyClock(device())  # CUDA events on GPU, thread CPU time on CPU
        self.peaks = peaks or MemoryPeaks(None)
        self.interval, self.rank, self.enabled = interval, rank, is_logging_rank
        self.log_metrics, self.set_tags = log_metrics, set_tags
        self.hosts = [socket.gethostname()]
        if interval and dist.is_initialized() and dist.get_world_size() > 1:
            self.hosts = [""] * dist.get_world_size()
            dist.all_gather_object(self.hosts, socket.gethostname())
        self._reset()
        self.last: dict[str, Any] = {}

    def _reset(self) -> None:
        self.steps, self.wall_s, self.data_s = 0, 0.0, 0.0
        self.clock.reset()

    def on_step(self, state: Any, result: Any, step_s: float) -> None:
        if not self.interval:
            return
        self.steps += 1
        self.wall_s += step_s
        self.data_s += float(result.aux.get(DATA_WAIT_KEY, 0.0))
        self.clock.add(getattr(result, "span", None))
        if state.step % self.interval:
            return
        busy_s = self.clock.busy_s() / self.steps
        peak = self.peaks.read("stragglers")  # CUDA: this window's peak allocated, reserved bytes (exact in float64)
        times = [busy_s, self.data_s / self.steps, self.wall_s / self.steps, *(peak or ())]
        mine = torch.tensor(times, dtype=torch.float64, device=device())  # NCCL gathers device tensors only
        rows = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
        self._reset()
        if self.enabled:
            self.report(state.step, [r.tolist() for r in rows])

    def report(self, step: int, rows: list[list[float]]) -> None:
        busy = [r[0] for r in rows]
        slow = max(range(len(rows)), key=lambda r: busy[r])
        mid = median(busy)
        ratio = busy[slow] / mid if mid > 0 else 1.0
        self.last = {"step": step, "rank": slow, "host": self.hosts[slow], "ratio": ratio, "busy_s": busy}
        print(
            f"stragglers at step {step}: slowest rank {slow} on {self.hosts[slow]}: busy {busy[slow]:.3f}s/step = "
            f"{ratio:.2f}x the median {mid:.3f}s | data wait {rows[slow][1]:.3f}s/step "
            f"(max over ranks {max(r[1] for r in rows):.3f}s) | step {rows[slow][2]:.3f}s",
            flush=True,
        )
        self.log_metrics(
            {
                "straggler/rank": float(slow),
                "straggler/ratio": ratio,
                "straggler/busy_s": busy[slow],
                "straggler/median_busy_s": mid,
                "straggler/max_data_wait_s": max(r[1] for r in rows),
            },
            step,
        )
        if len(rows[slow]) > 3:  # CUDA: the peaks of the window, one pair per rank
            self.report_memory(step, rows)
        self.set_tags({"straggler.host": self.hosts[slow]})

    def report_memory(self, step: int, rows: list[list[float]]) -> None:
        top = max(range(len(rows)), key=lambda r: rows[r][3])
        self.last["peak_allocated"] = [r[3] for r in rows]
        print(
            f"peak memory at step {step}: most allocated on rank {top} on {self.hosts[top]}: "
            f"{gib(rows[top][3]):.1f} GiB allocated / {gib(rows[top][4]):.1f} GiB reserved since the last report",
            flush=True,
        )
        self.log_metrics(
            {
                "straggler/peak_memory_rank": float(top),
                "straggler/max_peak_allocated_gib": gib(rows[top][3]),
                "straggler/max_peak_reserved_gib": gib(max(r[4] for r in rows)),
            },
            step,
        )

    def on_eval(self, state: Any, val: dict[int, float]) -> None:
        self._reset()  # evaluation time is not step time

    def on_rollback(self, state: Any) -> None:
        self._reset()

    def on_end(self, state: Any, val: dict[int, float]) -> None: ...

    def on_stop(self, state: Any, reason: str) -> None: ...
