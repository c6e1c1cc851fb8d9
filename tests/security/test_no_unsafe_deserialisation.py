"""No code path in ``elastic_pretrain/`` unpickles data from a checkpoint, a shard or a manifest
(issue 13): every ``pickle`` load, ``torch.load`` without ``weights_only=True``, ``np.load`` without
``allow_pickle=False``, ``allow_pickle=True``, ``weights_only=False`` and webdataset auto-decoding is
found by walking the syntax tree of every module (multi-line calls included, docstrings excluded),
and each one left must be on ALLOWED with the reason it is safe.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "elastic_pretrain"

# (module path, enclosing function/class, what) -> why it is safe. Keep the reasons true.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("elastic_pretrain/checkpoint/safe_load.py", "_MetadataUnpickler", "subclass of pickle.Unpickler"): (
        "its find_class resolves only the exact (module, name) pairs of a DCP metadata file and refuses "
        "dotted names; tests/security/test_checkpoint_inputs.py feeds it the os.system bypass"
    ),
}

_PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
_PICKLE_LOADERS = {"load", "loads", "Unpickler", "_Unpickler"}


def _const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _findings(source: str, rel: str) -> list[tuple[str, str, str, int]]:
    """(module, enclosing scope, what, line) for every unsafe deserialisation in ``source``."""
    tree = ast.parse(source, filename=rel)
    found: list[tuple[str, str, str, int]] = []
    bases: set[int] = set()  # a base class is reported as the subclass, not again as an attribute

    def visit(node: ast.AST, scope: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            scope = node.name
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                bases.add(id(base))
                name = _dotted(base)
                if name.split(".")[0] in _PICKLE_MODULES and name.split(".")[-1] in _PICKLE_LOADERS:
                    found.append((rel, scope, f"subclass of {name}", node.lineno))
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and id(node) not in bases
            and node.value.id in _PICKLE_MODULES
            and node.attr in _PICKLE_LOADERS
        ):
            found.append((rel, scope, f"{node.value.id}.{node.attr}", node.lineno))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLE_MODULES | {"torch"}:
            for alias in node.names:
                if alias.name in _PICKLE_LOADERS:
                    found.append((rel, scope, f"from {node.module} import {alias.name}", node.lineno))
        if isinstance(node, ast.Import):  # an alias would hide pickle.loads from the checks above
            for alias in node.names:
                if alias.name in _PICKLE_MODULES and alias.asname:
                    found.append((rel, scope, f"import {alias.name} as {alias.asname}", node.lineno))
        if isinstance(node, ast.Call):
            func = _dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            if func.endswith("torch.load") and not _const(kw.get("weights_only"), True):
                found.append((rel, scope, f"{func}( without weights_only=True", node.lineno))
            if func in ("np.load", "numpy.load", "numpy.lib.format.read_array") and not _const(
                kw.get("allow_pickle"), False
            ):
                found.append((rel, scope, f"{func}( without allow_pickle=False", node.lineno))
            if _const(kw.get("allow_pickle"), True) or (
                "allow_pickle" in kw and not isinstance(kw["allow_pickle"], ast.Constant)
            ):
                found.append((rel, scope, "allow_pickle= not False", node.lineno))
            if "weights_only" in kw and not _const(kw["weights_only"], True):
                found.append((rel, scope, "weights_only= not True", node.lineno))
            if func.split(".")[0] in ("wds", "webdataset") and func.split(".")[-1] in ("decode", "autodecode"):
                found.append((rel, scope, f"{func}( (webdataset decoders unpickle .pyd/.pkl/.pth)", node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, "<module>")
    return found


def test_no_unpickling_outside_the_allow_list() -> None:
    found = [f for p in sorted(PACKAGE.rglob("*.py")) for f in _findings(p.read_text(), p.relative_to(REPO).as_posix())]
    unexplained = [
        f"{m}:{line} in {scope}: {what}" for m, scope, what, line in found if (m, scope, what) not in ALLOWED
    ]
    assert not unexplained, "unsafe deserialisation (fix it, or add it to ALLOWED with why it is safe):\n" + "\n".join(
        unexplained
    )
    stale = set(ALLOWED) - {(m, scope, what) for m, scope, what, _ in found}
    assert not stale, f"ALLOWED names calls that no longer exist: {sorted(stale)}"


def test_the_walk_finds_each_pattern() -> None:
    """The detector itself: each forbidden form in a sample module is reported (so a pass means something)."""
    sample = (
        "import pickle, torch, numpy as np, webdataset as wds\n"
        "import pickle as pk\n"
        "from pickle import loads\n"
        "from torch import load\n"
        "class U(pickle.Unpickler): pass\n"
        "def f(b, p):\n"
        "    pickle.loads(b)\n"
        "    torch.load(p)\n"
        "    torch.load(\n        p, map_location='cpu', weights_only=False\n    )\n"
        "    np.load(p)\n"
        "    np.load(p, allow_pickle=True)\n"
        "    wds.decode()\n"
        "    torch.load(p, weights_only=True)\n"
        "    np.load(p, allow_pickle=False)\n"
    )
    assert sorted(what for _, _, what, _ in _findings(sample, "sample.py")) == sorted(
        [
            "from pickle import loads",
            "from torch import load",
            "import pickle as pk",
            "subclass of pickle.Unpickler",
            "pickle.loads",
            "torch.load( without weights_only=True",
            "torch.load( without weights_only=True",
            "weights_only= not True",
            "np.load( without allow_pickle=False",
            "np.load( without allow_pickle=False",
            "allow_pickle= not False",
            "wds.decode( (webdataset decoders unpickle .pyd/.pkl/.pth)",
        ]
    )


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (self.command,)


def test_third_party_loads_of_checkpoint_files_are_restricted(tmp_path: Path) -> None:
    """The loads outside our package that read checkpoint files: DCP's ``pickle.load`` of ``.metadata``
    and ``torch.load(weights_only=False)`` of byte items (both swapped by ``restricted_unpickling``),
    and megatron's ``torch.load(common.pt)`` without the argument (safe by torch's default, >= 2.6)."""
    import io

    import torch
    from torch.distributed.checkpoint import default_planner, filesystem

    from elastic_pretrain.checkpoint import safe_load

    with safe_load.restricted_unpickling():
        assert filesystem.pickle.load is safe_load._SafePickle.load
        with pytest.raises(AttributeError):
            _ = filesystem.pickle.loads  # a future DCP that calls loads must not get the real one
        assert default_planner.DefaultLoadPlanner.load_bytes is safe_load._load_bytes
    assert filesystem.pickle is pickle and default_planner.DefaultLoadPlanner.load_bytes is not safe_load._load_bytes
    marker = tmp_path / "PWNED"
    blob = io.BytesIO()
    torch.save({"x": _RunsCommand(f"touch {marker}")}, blob)
    blob.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(blob, map_location="cpu")  # exactly megatron's load_common call
    assert not marker.exists()
