"""Run a function of ours right after a third-party module's own code ran, before anything imports from it.

Installed by ``elastic_pretrain/__init__.py``, so it is in place before any module of the package imports
megatron-core. One entry today: ``megatron.core.jit`` → :func:`elastic_pretrain.parallel.cpu_compat.after_megatron_jit`
(the ``eager_jit_fuser`` CPU patch, docs/cpu-patches.md). Torch-free: importing the package must stay cheap
(the checkpoint writers' helper process imports it without torch).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from types import ModuleType
from typing import Any

# module -> "package.module:function" called with the module once its code has run
AFTER_IMPORT = {"megatron.core.jit": "elastic_pretrain.parallel.cpu_compat:after_megatron_jit"}


class _ThenCall(importlib.abc.Loader):
    """The module's own loader, then ``target(module)``; every other loader method is the original's."""

    def __init__(self, loader: Any, target: str) -> None:
        self._loader = loader
        self._target = target

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        where, name = self._target.split(":")
        getattr(importlib.import_module(where), name)(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in AFTER_IMPORT:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenCall(spec.loader, AFTER_IMPORT[fullname])
                return spec
        return None


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (once per interpreter)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
