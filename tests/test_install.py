"""Install metadata: the GPU constraints and the pyproject ranges agree with megatron-core's own
metadata, and nothing but the lock files pins torch or megatron-core (docs/install.md); the CPU venv holds no
torchvision that cannot import, and set-up's ``pip check`` tolerates exactly that missing requirement."""

from __future__ import annotations

import importlib.metadata
import itertools
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
GPU_CONSTRAINTS = REPO / "requirements" / "constraints-gpu.txt"
# An NGC container's torch: a pre-release local build. pip accepts an installed pre-release against a
# range (it never replaces it) but any exact pin or upper bound below it would reinstall torch.
CONTAINER_TORCH = Version("2.9.0a0+145a3a7bda.nv25.10")


def requirements_file(path: Path) -> list[Requirement]:
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return [Requirement(ln) for ln in lines if ln]


def megatron_requires() -> dict[str, SpecifierSet]:
    """megatron-core's Requires-Dist (all extras), by package name: the specifier each declares."""
    dist = importlib.metadata.distribution("megatron-core")
    out: dict[str, SpecifierSet] = {}
    for text in dist.metadata.get_all("Requires-Dist") or []:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name not in out or out[name] == req.specifier, f"megatron-core declares {name} twice, differently"
        out[name] = req.specifier
    return out


def version_grid() -> list[Version]:
    """Releases, pre-releases and local builds around every version these packages use."""
    grid = []
    for major, minor, patch in itertools.product(range(0, 4), range(0, 20), range(0, 3)):
        grid += [
            Version(f"{major}.{minor}.{patch}"),
            Version(f"{major}.{minor}.{patch}rc1"),
            Version(f"{major}.{minor}.{patch}a0"),
            Version(f"{major}.{minor}.{patch}+local"),
        ]
    return grid


def assert_within(ours: SpecifierSet, theirs: SpecifierSet, what: str) -> None:
    accepted = [v for v in version_grid() if ours.contains(v, prereleases=True)]
    assert accepted, f"{what}: {ours} accepts no version at all"
    outside = [v for v in accepted if not theirs.contains(v, prereleases=True)]
    assert not outside, f"{what}: {ours} allows {outside[:3]}, outside megatron-core's {theirs}"


def test_megatron_metadata_is_read() -> None:
    """The check below is only as good as the metadata it reads: it must hold TE and grouped GEMM."""
    declared = megatron_requires()
    assert {"transformer-engine", "nv-grouped-gemm", "torch"} <= set(declared)


def test_gpu_constraints_within_megatron_ranges() -> None:
    declared = megatron_requires()
    reqs = {canonicalize_name(r.name): r for r in requirements_file(GPU_CONSTRAINTS)}
    assert {"transformer-engine", "nv-grouped-gemm", "megatron-core"} <= set(reqs)
    for name, req in reqs.items():
        # TE's split packages (transformer-engine-torch/-cu12/-cu13) share the metapackage's version
        family = "transformer-engine" if name.startswith("transformer-engine") else name
        if family in declared:
            assert_within(req.specifier, declared[family], f"constraints-gpu.txt {name}")
    installed = importlib.metadata.version("megatron-core")
    assert reqs["megatron-core"].specifier == SpecifierSet(f"=={installed}"), "pin the megatron-core of the lock"


def test_gpu_constraints_keep_the_containers_torch() -> None:
    names = {canonicalize_name(r.name) for r in requirements_file(GPU_CONSTRAINTS)}
    replaced = sorted(n for n in names if n in ("torch", "torchvision", "torchaudio") or n.startswith("nvidia-"))
    assert not replaced, f"constraints-gpu.txt names {replaced}: pip would replace the container's build"


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_pyproject_pins_torch_and_megatron_only_in_lock_files() -> None:
    deps = {canonicalize_name(Requirement(d).name): Requirement(d) for d in pyproject()["dependencies"]}
    for name in ("torch", "megatron-core"):
        assert not any(s.operator in ("==", "===") for s in deps[name].specifier), f"pyproject pins {name}"
    assert deps["torch"].specifier.contains(CONTAINER_TORCH, prereleases=True), "a container's torch must satisfy it"
    declared = megatron_requires()
    assert_within(deps["torch"].specifier, declared["torch"], "pyproject torch")
    lock = {canonicalize_name(r.name): r for r in requirements_file(REPO / "requirements" / "lock-cpu.txt")}
    for name in ("torch", "megatron-core"):
        pin = lock[name].specifier
        assert len(pin) == 1 and next(iter(pin)).operator == "==", f"lock-cpu.txt must pin {name} exactly"
        locked = next(iter(pin)).version
        assert deps[name].specifier.contains(locked, prereleases=True), f"pyproject excludes the lock's {name}"


def test_pyproject_gpu_extra_within_megatron_ranges() -> None:
    declared = megatron_requires()
    gpu = pyproject()["optional-dependencies"]["gpu"]
    extra = {canonicalize_name(Requirement(d).name): Requirement(d) for d in gpu}
    assert {"transformer-engine", "nv-grouped-gemm"} <= set(extra)
    for name, req in extra.items():
        assert_within(req.specifier, declared[name], f"pyproject gpu extra {name}")


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_python_versions(python: str) -> None:
    """CI's 3.11 and the NGC containers' 3.12, both also inside megatron-core's Requires-Python."""
    assert Version(python) in SpecifierSet(pyproject()["requires-python"])
    requires = importlib.metadata.distribution("megatron-core").metadata["Requires-Python"]
    assert Version(python) in SpecifierSet(requires)
    assert Version("3.13") not in SpecifierSet(pyproject()["requires-python"])


# --- torchvision (issue 33, item 4) ---------------------------------------------------------------------
def test_the_lock_installs_no_torchvision() -> None:
    """PyPI's torchvision beside torch 2.13 CPU is a CUDA build that cannot import, and transformers imports
    torchvision whenever it is installed: no Hugging Face model loaded in the venv (scripts/setup.sh)."""
    lock = {canonicalize_name(r.name) for r in requirements_file(REPO / "requirements" / "lock-cpu.txt")}
    assert "torchvision" not in lock and "mosaicml-streaming" in lock


def pip_check_filter(output: str) -> str:
    """What scripts/setup.sh keeps of ``pip check``'s output (its own grep and pattern, run by bash)."""
    script = (REPO / "scripts" / "setup.sh").read_text()
    (line,) = [ln for ln in script.splitlines() if ln.startswith("PIP_CHECK_TOLERATED=")]
    code = f'{line}\nprintf "%s" "$1" | grep -Ev "$PIP_CHECK_TOLERATED|^No broken requirements found\\.$" || true\n'
    return subprocess.run(["bash", "-c", code, "filter", output], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize(
    ("output", "kept"),
    [
        ("mosaicml-streaming 0.13.0 requires torchvision, which is not installed.\n", ""),
        ("No broken requirements found.\n", ""),
        ("mosaicml-streaming 0.13.0 requires torchvision, which is not installed.\n"
         "mlflow 3.17.2 requires alembic, which is not installed.\n", "mlflow 3.17.2 requires alembic"),
        ("mosaicml-streaming 0.13.0 has requirement torchvision>=0.10, but you have torchvision 0.1.\n",
         "has requirement torchvision"),
        ("lm-eval 0.4.9.1 requires torchvision, which is not installed.\n", "lm-eval 0.4.9.1 requires torchvision"),
        ("mosaicml-streaming 0.13.0 requires numpy, which is not installed.\n", "requires numpy"),
    ],
)  # fmt: skip
def test_setup_tolerates_exactly_streamings_missing_torchvision(output: str, kept: str) -> None:
    got = pip_check_filter(output)
    assert (kept in got and got.strip()) if kept else got == ""


def test_the_venv_passes_setups_pip_check() -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "check", "--disable-pip-version-check"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert pip_check_filter(proc.stdout + proc.stderr) == "", "run scripts/setup.sh: the venv's requirements are broken"


def test_torchvision_is_absent_or_imports() -> None:
    """A fresh interpreter of the venv: no torchvision, or one that imports (a GPU container's)."""
    code = "import importlib.util\nif importlib.util.find_spec('torchvision'):\n    import torchvision\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"run scripts/setup.sh (it uninstalls the CUDA torchvision): {proc.stderr[-500:]}"
