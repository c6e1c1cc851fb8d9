"""Import mosaicml-streaming next to the CPU torch wheel.

``streaming`` eagerly imports ``streaming.vision``, which needs torchvision, and the only torchvision pip
installs beside the CPU torch is a CUDA build that cannot import; so a minimal stand-in provides the two names
it uses, only when no real torchvision is importable. :func:`import_streaming_lean` imports the MDS reader,
writer and downloader without ``streaming``'s package ``__init__``s (~6 s of transformers imports per rank).
docs/install.md, the "No torchvision either" paragraphs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

_NAMES = ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional")


def _module(name: str, *, package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name)
    # transformers calls importlib.util.find_spec("torchvision"): a module needs a real __spec__
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        mod.__path__ = []
    return mod


def _real_torchvision_importable() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # a CUDA build next to CPU torch raises RuntimeError, not ImportError
        for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[key]
        return False
    return True


def install_torchvision_standin() -> bool:
    """Register the stand-in if needed; returns True when it was installed."""
    if "torchvision" in sys.modules or _real_torchvision_importable():
        return False
    import torch.utils.data

    class VisionDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
        """Only so ``streaming.vision`` imports; never instantiated by elastic-pretrain."""

        def __init__(
            self, root: Any = None, transforms: Any = None, transform: Any = None, target_transform: Any = None
        ) -> None:
            self.root, self.transforms = root, transforms
            self.transform, self.target_transform = transform, target_transform

    def to_tensor(pic: Any) -> Any:
        raise NotImplementedError("torchvision is not installed (CPU setup): image decoding is unavailable")

    tv, ds, tr, trf = (_module(n, package=n in ("torchvision", "torchvision.transforms")) for n in _NAMES)
    tv.__dict__["_elastic_pretrain_standin"] = True
    ds.__dict__["VisionDataset"] = VisionDataset
    trf.__dict__["to_tensor"] = to_tensor
    tv.__dict__.update(datasets=ds, transforms=tr)
    tr.__dict__["functional"] = trf
    sys.modules.update(dict(zip(_NAMES, (tv, ds, tr, trf), strict=True)))
    return True


_EAGER_PACKAGES = ("streaming", "streaming.base")  # their __init__ re-exports everything (transformers included)


def _deferred_package(name: str) -> types.ModuleType:
    """The real package ``name`` (its spec, ``__path__``) with its ``__init__`` not run yet: submodules
    import from its path; the first package-level name looked up runs the ``__init__`` (PEP 562)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        raise ModuleNotFoundError(f"no package {name!r}: install mosaicml-streaming (scripts/setup.sh)", name=name)
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def run_init(attr: str) -> Any:
        if attr.startswith("__"):  # dunders (``__all__``, ``__wrapped__`` probes) never trigger the import
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        del module.__dict__["__getattr__"]
        install_torchvision_standin()  # streaming/__init__ imports streaming.vision
        loader.exec_module(module)
        return getattr(module, attr)

    module.__dict__["__getattr__"] = run_init
    return module


def import_streaming_lean() -> None:
    """Make ``streaming``'s submodules (``streaming.base.format``, ``.storage``, ...) importable without
    running the ``__init__`` of ``streaming`` and ``streaming.base``. Use it before importing a submodule;
    a later ``import streaming`` (or :func:`import_streaming`) still gets the whole package."""
    for name in _EAGER_PACKAGES:
        if name in sys.modules:
            continue
        module = _deferred_package(name)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def cloud_downloader() -> Any:
    """streaming's ``CloudDownloader`` (s3, gs, oci, azure, hf, sftp, dbfs, local paths), importable in a
    fresh process: ``streaming.base.storage`` imports ``streaming.base.util``, which imports
    ``streaming.base.format``, whose reader imports ``bytes_to_int`` back from the half-initialised
    ``util`` (a circular import that the package ``__init__``s happen to order right). Importing
    ``streaming.base.format`` first completes ``util`` before ``storage`` asks for it (issue 35, item 4)."""
    import_streaming_lean()
    import streaming.base.format  # noqa: F401  (before storage: see above)
    from streaming.base.storage import CloudDownloader

    return CloudDownloader


def import_streaming() -> types.ModuleType:
    """``import streaming`` that works on the CPU-only stack. Use this, never a bare import."""
    install_torchvision_standin()
    import streaming

    streaming.StreamingDataset  # noqa: B018  (runs the __init__s if import_streaming_lean deferred them)
    return streaming
