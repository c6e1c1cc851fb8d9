"""Bringing the project onto an offline GPU machine (bench/gpu_deps.py, bench/gpu_deps.sh; docs/gpu.md "GPU check").

The GPU image (bench/gpu_image.txt) has torch but not megatron-core, streaming or their codecs; they travel as
the wheels of bench/gpu_wheels.txt. Checked here without a GPU and without network: the list covers every
requirement of the project and of megatron-core (and of each carried wheel) that the image lacks; the `train`
command runs in an interpreter that refuses every other installed distribution; the install step works with
--no-index on a wheel folder and says how to fill an empty one.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import gpu_deps
from tests.conftest import REPO, VENV_BIN


def test_the_wheel_list_covers_what_the_gpu_image_lacks():
    assert gpu_deps.uncovered() == {}
    wheels = gpu_deps.wheel_list()
    assert "megatron-core" in wheels and wheels["megatron-core"] == "megatron-core==0.16.1"
    assert not set(wheels) & gpu_deps.image_packages(), "a wheel for what the image has would replace its version"


@pytest.mark.parametrize(
    ("dropped", "required_by"),
    [("megatron-core", "the project"), ("cramjam", "python-snappy"), ("braceexpand", "webdataset")],
)
def test_a_requirement_left_out_of_the_list_is_named(monkeypatch, dropped, required_by):
    full = gpu_deps.wheel_list()
    monkeypatch.setattr(gpu_deps, "wheel_list", lambda path=None: {k: v for k, v in full.items() if k != dropped})
    assert gpu_deps.uncovered() == {dropped: required_by}


def test_every_wheel_pins_one_version(tmp_path: Path):
    assert all("==" in spec for spec in gpu_deps.wheel_list().values())
    loose = tmp_path / "wheels.txt"
    loose.write_text("megatron-core>=0.16\n")
    with pytest.raises(ValueError, match="must pin a version"):
        gpu_deps.wheel_list(loose)


def test_pip_download_arguments_target_the_gpu_machines_python():
    args = gpu_deps.pip_args("/tmp/w")
    assert args[:3] == ["download", "--no-deps", "--only-binary=:all:"]
    assert args[args.index("--python-version") + 1] == "3.12" and "manylinux_2_28_x86_64" in args
    assert set(gpu_deps.wheel_list().values()) <= set(args)


def _wheel(folder: Path, name: str, version: str, module: str) -> Path:
    """A minimal pure-Python wheel (what pip needs: the module, METADATA, WHEEL, RECORD)."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{module}.py": b"VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = (
        "".join(
            f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
            f"{len(data)}\n"
            for path, data in files.items()
        )
        + f"{info}/RECORD,,\n"
    )
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, data in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(p, data)
    return path


def test_install_puts_the_wheels_on_a_target_offline(tmp_path: Path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "gpu_deps_probe", "1.0", "gpu_deps_probe")
    env = {**os.environ, "GPU_WHEELS": str(wheels), "PYTHON": str(VENV_BIN / "python")}
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_deps.sh"), "install", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    site = proc.stdout.strip().splitlines()[-1]
    assert site == str(tmp_path / "site")
    probe = subprocess.run(
        [sys.executable, "-c", "import gpu_deps_probe; print(gpu_deps_probe.VALUE)"],
        env={**os.environ, "PYTHONPATH": site},
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "42"


def test_install_without_wheels_says_how_to_get_them(tmp_path: Path):
    env = {**os.environ, "GPU_WHEELS": str(tmp_path), "PYTHON": str(VENV_BIN / "python")}
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_deps.sh"), "install"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "gpu_deps: no wheels in bench/.wheels: run 'bash bench/gpu_deps.sh download' on a "
        "machine with network and carry bench/.wheels with the checkout"
    )


# torchvision is on the GPU image, built for its torch; the one in this venv is a CUDA build beside a CPU torch that
# cannot import (pyproject.toml: streaming declares it; elastic_pretrain/data/streaming_compat.py stands in)
BROKEN_HERE = frozenset({"torchvision"})


def image_python(site: Path, code: str, *, timeout: int) -> subprocess.CompletedProcess[str]:
    """``code`` in an interpreter that sees the standard library, the checkout and ``site`` only (``-S``)."""
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={
            "PATH": "/usr/bin:/bin",
            "OMP_NUM_THREADS": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "PYTHONPATH": f"{REPO}{os.pathsep}{site}",
        },
    )


def test_a_distribution_outside_the_image_and_the_wheels_is_absent(tmp_path: Path):
    code = (
        "import importlib.util as u; print([u.find_spec(m) is not None for m in ('streaming', 'megatron', 'mlflow')])"
    )
    ok = image_python(gpu_deps.image_site(tmp_path / "all", BROKEN_HERE), code, timeout=60)
    assert ok.stdout.strip() == "[True, True, False]", ok.stderr  # mlflow: not carried, so not there
    less = gpu_deps.image_site(tmp_path / "less", BROKEN_HERE | {"mosaicml-streaming"})
    assert image_python(less, code, timeout=60).stdout.strip() == "[False, True, False]"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_trainer_runs_with_the_image_and_the_wheels_alone(tmp_path: Path):
    """Two steps of the tiny job, a checkpoint save and the final evaluation, importing only what the GPU
    machine has: every import the GPU check's trainer section makes is satisfied there."""
    subprocess.run(
        [str(VENV_BIN / "elastic-pretrain"), "prepare-data", "stdlib-code"],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = (
        "import sys\nfrom elastic_pretrain.cli import main\n"
        f"sys.exit(main(['train', 'jobs/tiny-cpu.yaml', '--run-dir', {str(tmp_path / 'run')!r}, "
        "'parallel=single', 'train.steps=2', 'train.warmup_steps=0', 'train.eval_sequences=4', "
        "'train.eval_interval=0', 'tracking.backend=none']))"
    )
    proc = image_python(gpu_deps.image_site(tmp_path / "site", BROKEN_HERE), code, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "trained 2 steps" in proc.stdout and "checkpoint step 2 committed" in proc.stdout
