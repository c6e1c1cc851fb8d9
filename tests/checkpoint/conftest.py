from __future__ import annotations

import subprocess

import pytest

from tests.checkpoint.runs import CLI
from tests.conftest import REPO


@pytest.fixture(scope="package")
def prepared() -> None:
    """The default job's shards (idempotent)."""
    subprocess.run([CLI, "prepare-data", "stdlib-code"], cwd=REPO, check=True, capture_output=True, timeout=300)
