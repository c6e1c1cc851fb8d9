"""Peak device memory per report window (issue 31 item 4; docs/gpu.md, "Peak memory per report").

ℓ changes from step to step, and with it the activation footprint: a peak since the start of the run would
show the deepest step ever trained, not what the current depth needs. So each report reads the CUDA caching
allocator's peak allocated and reserved bytes and resets them (``torch.cuda.reset_peak_memory_stats``): the
next report shows its own window's peak. The reads touch the allocator's host-side counters only — no
device sync — and happen once per report, not per step. On CPU nothing is read.

The allocator keeps one peak per device, but three callbacks report at their own cadence (the progress
line, MLflow, the straggler report): each is a *reader* with its own window. A read resets the device's
peak and folds what it saw into every reader's running peak, so no reader loses what another's reset cleared.
"""

from __future__ import annotations

from typing import Protocol

import torch

# the readers: the progress line and MLflow (every log_interval), the straggler report (every straggler_interval)
READERS = ("progress", "tracking", "stragglers")


class CudaMemory(Protocol):
    """What :class:`MemoryPeaks` uses of ``torch.cuda``."""

    def max_memory_allocated(self) -> int: ...
    def max_memory_reserved(self) -> int: ...
    def reset_peak_memory_stats(self) -> None: ...


class MemoryPeaks:
    """(peak allocated, peak reserved) bytes since a reader's previous read; None without CUDA."""

    def __init__(self, cuda: CudaMemory | None, readers: tuple[str, ...] = READERS) -> None:
        self.cuda = cuda
        self._held = {r: (0, 0) for r in readers}

    @classmethod
    def on(cls, device: torch.device) -> MemoryPeaks:
        return cls(torch.cuda if device.type == "cuda" else None)

    def read(self, reader: str) -> tuple[int, int] | None:
        if self.cuda is None:
            return None
        now = (int(self.cuda.max_memory_allocated()), int(self.cuda.max_memory_reserved()))
        self.cuda.reset_peak_memory_stats()  # from here the allocator's peak restarts at what is in use
        for name, (allocated, reserved) in self._held.items():
            self._held[name] = (max(allocated, now[0]), max(reserved, now[1]))
        peak, self._held[reader] = self._held[reader], (0, 0)
        return peak


def gib(n: float) -> float:
    return n / 2**30
