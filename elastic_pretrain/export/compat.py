"""Load ``transformers`` models on the project's CPU stack.

The CPU venv holds PyPI's torchvision, a CUDA build that mosaicml-streaming pulls in and that cannot
import beside the CPU torch wheel (``operator torchvision::nms does not exist``;
``data/streaming_compat.py``). transformers imports torchvision as soon as the package is installed
(``modeling_utils`` → the object-detection losses → ``image_utils``), so no model class imports.
:func:`hide_broken_torchvision` tells transformers torchvision is absent when it cannot be imported.
It imports neither megatron nor the rest of elastic_pretrain; an environment with a working
torchvision (or none) is left alone.
"""

from __future__ import annotations

import importlib.util
import sys


def _torchvision_works() -> bool:
    mod = sys.modules.get("torchvision")
    if mod is not None:
        return not getattr(mod, "_elastic_pretrain_standin", False)
    if importlib.util.find_spec("torchvision") is None:
        return True  # not installed: transformers already knows
    try:
        import torchvision  # noqa: F401
    except Exception:  # the CUDA build raises RuntimeError, not ImportError
        for key in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[key]
        return False
    return True


def hide_broken_torchvision() -> None:
    """Call before the first transformers model import (idempotent)."""
    if _torchvision_works():
        return
    from transformers.utils import import_utils

    import_utils._torchvision_available = False  # read by is_torchvision_available()
