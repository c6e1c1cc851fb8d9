"""Install metadata: the GPU constraints and the pyproject ranges agree with megatron-core's own
metadata, and nothing but the lock files pins torch or megatron-core (docs/install.md)."""

from __future__ import annotations

import importlib.metadata
import itertools
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
        grid += [Version(f"{major}.{minor}.{patch}"), Version(f"{major}.{minor}.{patch}rc1"),
                 Version(f"{major}.{minor}.{patch}a0"), Version(f"{major}.{minor}.{patch}+local")]
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
