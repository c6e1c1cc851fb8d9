"""Profiler window: ``train.profile: {start: S, steps: K}`` traces steps S+1 .. S+K with the torch
profiler; every rank writes ``<run_dir>/profile/rank_<r>.json`` (Chrome trace: chrome://tracing or
https://ui.perfetto.dev), and the logging rank logs its trace to MLflow under ``profile/``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elastic_pretrain.files import atomic_path
from elastic_pretrain.rundir import RunFiles
from elastic_pretrain.train.config import ProfileConfig


class ProfileWindow:
    """Trainer callback; starts the profiler after step S, stops it after step S+K."""

    def __init__(
        self,
        cfg: ProfileConfig | None,
        run_dir: Path,
        rank: int,
        log_artifact: Callable[[Path, str], None] = lambda p, a: None,
    ) -> None:
        self.cfg, self.rank, self.log_artifact = cfg, rank, log_artifact
        self.run_dir, self.path = run_dir, RunFiles(run_dir).profile_trace(rank)
        self.prof: torch.profiler.profile | None = None
        self.done = False

    def on_step(self, state: Any, result: Any, step_s: float) -> None:
        if self.cfg is None or self.done:
            return
        if self.prof is None and state.step == self.cfg.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.start()
            self.first = state.step + 1
        elif self.prof is not None and state.step >= self.first + self.cfg.steps - 1:
            self.finish(state.step)

    def finish(self, step: int) -> None:
        assert self.prof is not None
        self.prof.stop()
        with atomic_path(self.path, root=self.run_dir) as tmp:  # profile/ below the run directory (files.py)
            self.prof.export_chrome_trace(str(tmp))
        self.prof, self.done = None, True
        if self.rank == 0:
            print(f"profile of steps {self.first}..{step} -> {self.path}", flush=True)
        self.log_artifact(self.path, "profile")

    def on_eval(self, state: Any, val: dict[int, float]) -> None: ...

    def on_rollback(self, state: Any) -> None: ...

    def on_end(self, state: Any, val: dict[int, float]) -> None:
        if self.prof is not None:  # the run ended inside the window
            self.finish(state.step)

    def on_stop(self, state: Any, reason: str) -> None:
        self.on_end(state, {})
