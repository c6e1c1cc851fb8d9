"""What an offline GPU machine needs beyond its image, as wheels (bench/gpu_deps.sh, docs/gpu.md "GPU check").

    python bench/gpu_deps.py check          # here: the wheel list covers what the image lacks (exit 1 if not)
    python bench/gpu_deps.py pip-args       # the `pip download` arguments for bench/gpu_wheels.txt

The device machine of this workplace reaches no registry; its image (bench/gpu_image.txt) has torch but no
megatron-core, streaming or their codecs. ``check`` walks the project's requirements (pyproject.toml) and
megatron-core's, then the requirements of every wheel carried, and names each distribution that is neither
on the image, nor in bench/gpu_wheels.txt, nor in :data:`NOT_CARRIED` with the reason it is not needed.
:func:`image_site` links the distributions the GPU machine would have into one folder, so that a test can run
the trainer with nothing else importable (tests/test_gpu_deps.py). Standard library only: it runs before any install.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / "bench" / "gpu_wheels.txt"
IMAGE = REPO / "bench" / "gpu_image.txt"
PYTHON = "3.12"  # the GPU image's python3 (KINDS.md)
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]

# requirements deliberately not carried -> why the GPU check (and a training run) does without them
NOT_CARRIED = {
    "mlflow": "tracking.backend=none in the check; MLflow and its server stack are tens of MB of wheels",
    # mosaicml-streaming's remote-storage clients: imported only for s3://, gs://, oci://, azure:// data paths
    "boto3": "streaming's S3 client: remote data paths only",
    "google-cloud-storage": "streaming's GCS client: remote data paths only",
    "paramiko": "streaming's SFTP client: remote data paths only",
    "oci": "streaming's OCI client: remote data paths only",
    "azure-storage-blob": "streaming's Azure client: remote data paths only",
    "azure-storage-file-datalake": "streaming's Azure client: remote data paths only",
    "azure-identity": "streaming's Azure client: remote data paths only",
    "torchvision": "declared by streaming for its vision datasets, which the project does not import",
}


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    return normalize(re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0])


def _lines(path: Path) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines() if line.split("#", 1)[0].strip()]


def wheel_list(path: Path = WHEELS) -> dict[str, str]:
    """bench/gpu_wheels.txt as {normalized name: 'name==version'}; every line pins one version."""
    out = {}
    for line in _lines(path):
        if "==" not in line:
            raise ValueError(f"{path.name}: {line!r} must pin a version (NAME==VERSION): pip matches wheels exactly")
        out[requirement_name(line)] = line.replace(" ", "")
    return out


def image_packages(path: Path = IMAGE) -> set[str]:
    return {normalize(line) for line in _lines(path)}


def project_requirements() -> list[str]:
    """pyproject.toml's [project] dependencies (no extras: the GPU extras are Transformer Engine, not carried)."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]  # type: ignore[no-any-return]


def declared(dist: str) -> list[str]:
    """A distribution's own requirements, without extras and other-platform markers (from this machine's metadata)."""
    reqs = md.requires(dist) or []
    return [r for r in reqs if "extra ==" not in r and 'sys_platform == "win32"' not in r]


def uncovered() -> dict[str, str]:
    """Required distributions neither on the image, nor carried, nor in NOT_CARRIED -> who requires them."""
    image, wheels = image_packages(), wheel_list()
    todo = [(requirement_name(r), "the project") for r in project_requirements()]
    todo += [(requirement_name(r), "megatron-core") for r in declared("megatron-core")]
    seen: set[str] = set()
    missing: dict[str, str] = {}
    while todo:
        name, by = todo.pop()
        if name in seen or name in image or name in NOT_CARRIED:
            continue
        seen.add(name)
        if name not in wheels:
            missing[name] = by
            continue
        try:  # a carried wheel's own requirements must be satisfied there too (--no-deps installs none)
            todo += [(requirement_name(r), name) for r in declared(name)]
        except md.PackageNotFoundError:
            missing[name] = f"{by} (not installed here, so its requirements cannot be read)"
    return missing


def pip_args(dest: str) -> list[str]:
    """``pip download`` arguments for every listed wheel, built for the GPU machine's Python and platform."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        dest,
        *wheel_list().values(),
    ]


# ---------------------------------------------------------------------------------------------- image-only
def image_site(dest: Path, without: frozenset[str] = frozenset()) -> Path:
    """A folder of links to the installed distributions the GPU machine would have (the image's and the carried
    wheels', less ``without``): with ``python -S`` (no site-packages) and this folder and the checkout on
    PYTHONPATH, an interpreter imports exactly what the GPU machine can — an absent distribution is absent to
    ``import`` and to ``importlib.util.find_spec`` alike (tests/test_gpu_deps.py runs the trainer so)."""
    allowed = (image_packages() | set(wheel_list())) - {normalize(n) for n in without}
    dest.mkdir(parents=True, exist_ok=True)
    for dist in md.distributions():
        name = normalize(dist.metadata["Name"] or "")
        if name not in allowed or not dist.files:
            continue
        root = Path(str(dist.locate_file("")))
        tops = {f.parts[0] for f in dist.files if f.parts and f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(tops):
            src, link = root / top, dest / top
            if src.exists() and not link.exists() and not top.endswith(".pth"):
                link.symlink_to(src)
    return dest


def main(argv: list[str]) -> int:
    if argv[:1] == ["pip-args"]:
        print("\n".join(pip_args(argv[1] if len(argv) > 1 else str(REPO / "bench" / ".wheels"))))
        return 0
    if argv[:1] == ["check"]:
        missing = uncovered()
        for name, by in sorted(missing.items()):
            print(
                f"gpu_deps: {name} (required by {by}) is neither on the GPU image nor in {WHEELS.name}: add "
                f"{name}==VERSION there, or to NOT_CARRIED in bench/gpu_deps.py with the reason"
            )
        if not missing:
            print(f"gpu_deps: {len(wheel_list())} wheels cover what the GPU image lacks")
        return 1 if missing else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
