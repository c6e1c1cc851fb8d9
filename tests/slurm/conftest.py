"""Fixtures for the Slurm tests: a real local cluster (slurm/local-cluster/up.sh) for the session.

The cluster lives in its own state directory and ports (``ELASTIC_SLURM_TEST_HOME``, default
/tmp/elastic-slurm-test; ``ELASTIC_SLURM_TEST_PORT``, default 16940), so it never touches a cluster
a developer brought up by hand. It is torn down at the end of the session unless
``ELASTIC_SLURM_KEEP=1``. If up.sh says this machine cannot run a cluster (exit 3), the cluster
tests are skipped with its reason; any other failure of up.sh fails them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_helpers import CLUSTER_NODES, CLUSTER_SCRIPTS, CPUS_PER_NODE, Cluster


def _cluster_env() -> dict[str, str]:
    return {
        **os.environ,
        "ELASTIC_SLURM_HOME": os.environ.get("ELASTIC_SLURM_TEST_HOME", "/tmp/elastic-slurm-test"),
        "ELASTIC_SLURM_PORT": os.environ.get("ELASTIC_SLURM_TEST_PORT", "16940"),
        "ELASTIC_SLURM_NODES": str(CLUSTER_NODES),
        "ELASTIC_SLURM_CPUS": str(CPUS_PER_NODE),
    }


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    env = _cluster_env()
    up = subprocess.run(["bash", str(CLUSTER_SCRIPTS / "up.sh")], env=env, capture_output=True, text=True, timeout=600)
    if up.returncode == 3:
        pytest.skip(up.stderr.strip().splitlines()[-1])
    if up.returncode != 0:
        subprocess.run(["bash", str(CLUSTER_SCRIPTS / "down.sh")], env=env, capture_output=True, timeout=300)
        pytest.fail(f"slurm/local-cluster/up.sh failed (exit {up.returncode}):\n{up.stdout}\n{up.stderr}")
    home = Path(env["ELASTIC_SLURM_HOME"])
    conf = home / "etc" / "slurm.conf"
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", str(conf))
            yield Cluster(home, conf, {**env, "SLURM_CONF": str(conf)})
    finally:
        if os.environ.get("ELASTIC_SLURM_KEEP") != "1":
            subprocess.run(["bash", str(CLUSTER_SCRIPTS / "down.sh")], env=env, capture_output=True, timeout=300)
            stray = _processes_of(home)
            assert not stray, f"down.sh left processes of the test cluster running: {stray}"


def _processes_of(home: Path) -> list[str]:
    """Live processes started by the cluster in ``home`` (daemons carry ELASTIC_SLURM_DAEMON=home)."""
    marker = f"ELASTIC_SLURM_DAEMON={home}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name} {cmdline}")
        except OSError:
            continue
    return found
