"""Import mosaicml-streaming next to the CPU torch wheel.

``streaming/__init__.py`` eagerly imports ``streaming.vision``, which needs
``torchvision.datasets.VisionDataset`` and ``torchvision.transforms.functional.to_tensor``. The only
torchvision pip can install beside ``torch==2.13.0+cpu`` is a CUDA build whose import fails
(``operator torchvision::nms does not exist``), and installing it would drag in a CUDA torch.
We never use the vision datasets, so before importing ``streaming`` we register a minimal module
providing just those two names — only when a real torchvision is not importable. Everything else of
streaming (MDS writer/reader, StreamingDataset, remote download + local cache) is the real library.
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

        def __init__(self, root: Any = None, transforms: Any = None, transform: Any = None,
                     target_transform: Any = None) -> None:
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


def import_streaming() -> types.ModuleType:
    """``import streaming`` that works on the CPU-only stack. Use this, never a bare import."""
    install_torchvision_standin()
    import streaming

    return streaming
