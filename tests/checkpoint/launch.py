"""A ``train --nproc-per-node 2`` launch to signal while it runs: its output as it comes, its processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from elastic_pretrain.launch.local import children
from tests.checkpoint.runs import CLI, COMMON
from tests.conftest import REPO


class Launch:
    """``elastic-pretrain train jobs/tiny-cpu.yaml --nproc-per-node 2`` on ``run_dir``, running."""

    def __init__(self, run_dir: Path, *overrides: str) -> None:
        cmd = [CLI, "train", "jobs/tiny-cpu.yaml", "--run-dir", str(run_dir), "--nproc-per-node", "2", *COMMON,
               *overrides]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()

    def wait_for(self, pattern: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, "".join(self.out)):
            assert self.proc.poll() is None, f"ended before {pattern!r}:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s:\n{self.text()}"
            time.sleep(0.2)

    def launcher(self, timeout: float = 120) -> int:
        """The launcher process (torchrun's agent) the CLI started."""
        deadline = time.monotonic() + timeout
        while not (found := children(self.proc.pid)):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.text()
            time.sleep(0.05)
        return found[0]

    def rank_pid(self, rank: int, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid in children(self.launcher()):
                try:
                    environ = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                if f"\0RANK={rank}\0".encode() in environ:
                    return pid
            time.sleep(0.1)
        raise AssertionError(f"no rank {rank} process:\n{self.text()}")

    def signal(self, pid: int, sig: int = signal.SIGTERM) -> None:
        os.kill(pid, sig)

    def finish(self, timeout: float = 900) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        time.sleep(0.5)  # the reader threads drain the pipes
        return code

    def text(self) -> str:
        return "".join(self.out)[-3000:] + "\n--- stderr ---\n" + "".join(self.err)[-5000:]
