"""Shared fixtures. Single-process megatron tests share one initialised 1-rank mesh per session."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true",
                     help="also run the tests marked `long` (end-to-end variants beyond CI's time budget)")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the ``long`` tests unless ``--long`` is given (or ``-m`` names the marker): the default run is
    CI's, which has to fit its time budget (docs/testing.md)."""
    if config.getoption("--long") or "long" in (config.getoption("-m") or ""):
        return
    long = [item for item in items if item.get_closest_marker("long")]
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = [item for item in items if not item.get_closest_marker("long")]
        config.stash[_LONG] = len(long)


_LONG = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    """Shard verification records (data/verified.py) go to a folder of this session, inherited by every process
    the tests start, not to the user's ~/.cache: a test never trusts a record an earlier run wrote."""
    import tempfile

    os.environ.setdefault("ELASTIC_PRETRAIN_VERIFY_CACHE", tempfile.mkdtemp(prefix="verified-"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if n := config.stash.get(_LONG, 0):
        terminalreporter.write_line(f"{n} long tests deselected: run them with `bash scripts/test.sh --long` "
                                    "(docs/testing.md)")  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_moe_aux_tracker():
    """megatron keeps its MoE aux-loss tracker in a module global sized by the first model that logs into it
    (``clear_aux_losses_tracker`` only zeroes it): a later test's model with more MoE layers then indexed past
    its end. Every test starts with an empty one (only where megatron is already imported: no import cost).
    Likewise the aux-loss gradient scale, a class attribute set by the first ``forward_backward`` (its value
    after test_precision.py made test_overlap.py's losses differ when run in that order): as a fresh process."""
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
        moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    yield


@pytest.fixture(scope="session")
def mesh1():
    """A 1-process megatron mesh (gloo), torn down at the end of the session."""
    import torch

    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown

    torch.set_num_threads(1)
    mesh = init_mesh(ParallelConfig(), seed=1234)
    yield mesh
    teardown()


def torchrun(
    script: Path, *args: str, nproc: int = 2, timeout: int = 300, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under torchrun with ``nproc`` CPU ranks; raise with the output if it fails."""
    cmd = [
        str(VENV_BIN / "torchrun"),
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        "0",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        str(script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script.name} {' '.join(args)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc
