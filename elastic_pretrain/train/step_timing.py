"""A rank's busy time per training step, for the straggler report (train/stragglers.py; issue 31 item 6).

On CPU it is the training thread's CPU time: gloo waits block without spinning, so it is the rank's own work.
On CUDA the host thread's CPU time is mostly waiting (a host sync spins until the GPU catches up), so the
step is timed on the device instead: :func:`open_span` records a CUDA event on the current stream when the
step starts (``train/step.py: measured_step``, both engines) and :meth:`StepSpan.close` another when it ends.
The events are read once per report, after one wait on the last of them (events on one stream complete in
order), so timing adds no host sync per step (``tests/train/test_host_syncs.py`` counts them). Evaluation,
checkpoints and the data wait fall between spans and are not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from elastic_pretrain.parallel.device import device

EventFactory = Callable[[], Any]  # makes an event with torch.cuda.Event's record/synchronize/elapsed_time


def cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class StepSpan:
    """A step's pair of events on the device's current stream: ``start`` recorded, ``end`` once closed."""

    def __init__(self, start: Any, event: EventFactory) -> None:
        self.start, self._event = start, event
        self.end: Any = None

    def close(self) -> None:
        end = self._event()
        end.record()
        self.end = end


def open_span(dev: torch.device | None = None, event: EventFactory = cuda_event) -> StepSpan | None:
    """Start timing a step on ``dev`` (default: this process's device): on CUDA a :class:`StepSpan` whose start
    event is recorded now; elsewhere None (the CPU measure needs none)."""
    if (dev or device()).type != "cuda":
        return None
    start = event()
    start.record()
    return StepSpan(start, event)


class BusyClock:
    """Busy seconds since :meth:`reset`: the spans :meth:`add` collected on CUDA, the thread's CPU time elsewhere."""

    def __init__(self, dev: torch.device, cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.events, self.cpu_clock = dev.type == "cuda", cpu_clock
        self.spans: list[StepSpan] = []
        self.reset()

    def reset(self) -> None:
        self.spans, self.cpu0 = [], self.cpu_clock()  # unread events are dropped unread: no wait for them

    def add(self, span: StepSpan | None) -> None:
        if self.events and span is not None and span.end is not None:
            self.spans.append(span)

    def busy_s(self) -> float:
        if not self.events:
            return self.cpu_clock() - self.cpu0
        if not self.spans:
            return 0.0
        # the one host wait of a report: every earlier event was recorded before this one on the same stream
        self.spans[-1].end.synchronize()
        return sum(s.start.elapsed_time(s.end) for s in self.spans) / 1000.0  # elapsed_time is in ms
