"""A real ``mlflow server`` on loopback for the tracking tests.

Starting one costs 10-20 s of CPU on our 2 cores (two interpreters import MLflow, then sqlite
migrations), so one server is shared by the whole session; only the outage tests, which kill and
restart theirs, get their own (see ``MlflowServer``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_pretrain.tracking.config import TrackingConfig

MLFLOW_BIN = Path(sys.executable).parent / "mlflow"
START_TIMEOUT_S = 180.0  # generous: the CI machine may be running other suites on the same 2 cores

# For the test process too: no telemetry, no "View run at" lines, no client-side retry storms.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """``mlflow server`` with a sqlite store and proxied artifacts in ``root``; restartable on its port."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.store = root / "mlflow.db"
        self.artifacts = root / "artifacts"
        self.proc: subprocess.Popen[bytes] | None = None
        self._starts = 0

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        assert not self.running, "already running"
        self.root.mkdir(parents=True, exist_ok=True)
        self._starts += 1
        log_path = self.root / f"server-{self._starts}.log"
        env = {
            **os.environ,
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # else ~10 job-runner processes + /dev/shm files
            "MLFLOW_DISABLE_TELEMETRY": "true",
        }
        cmd = [str(MLFLOW_BIN), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        cmd += ["--backend-store-uri", f"sqlite:///{self.store}", "--artifacts-destination", str(self.artifacts)]
        with log_path.open("wb") as log:
            # Own session: stop() signals the whole group (the CLI process and its uvicorn child).
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}):\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server not healthy after {START_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it if still there after 30 s."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        # uvicorn may outlive the CLI parent by a moment; the port must be free before a restart.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One running server for every tracking test that does not need to kill it."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], MlflowServer]]:
    """Make (unstarted) servers of one's own, e.g. to kill and restart; all stopped at the end."""
    made: list[MlflowServer] = []

    def make() -> MlflowServer:
        made.append(MlflowServer(tmp_path_factory.mktemp("mlflow-own-server")))
        return made[-1]

    yield make
    for server in made:
        server.stop()


@pytest.fixture
def dead_uri() -> str:
    """An http URI on a loopback port where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def no_env_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's or CI's MLFLOW_TRACKING_URI must not redirect a test to their server."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture
def fast_cfg() -> Callable[..., TrackingConfig]:
    """TrackingConfig with test-speed intervals (send every 0.2 s, retry at least every 1 s)."""

    def make(**overrides: Any) -> TrackingConfig:
        base: dict[str, Any] = {
            "flush_interval_s": 0.2,
            "retry_max_interval_s": 1.0,
            "request_timeout_s": 5,
            "system_metrics": False,
            "close_timeout_s": 60.0,
        }
        return TrackingConfig(**{**base, **overrides})

    return make
