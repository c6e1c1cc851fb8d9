"""The package's layering rules that hold by construction (docs/architecture.md, "Run directory"):
``*/commands.py`` modules are leaves (only the CLI imports them), and ``rundir.py`` — the contract that
names every file of a run — sits at the bottom and imports nothing from the package."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "elastic_pretrain"


def _module(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, root: Path = REPO) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function (absolute names)."""
    module = _module(path, root)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from ..x import y
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # from elastic_pretrain.eval import commands
    return names


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_commands_are_leaves() -> None:
    offenders = [
        f"{_module(p)} imports {name}"
        for p in _modules()
        if p != PACKAGE / "cli.py"
        for name in sorted(imported(p))
        if name.startswith("elastic_pretrain.") and name.split(".")[-1] == "commands"
    ]
    assert not offenders, "only cli.py may import a commands module: " + "; ".join(offenders)


def test_rundir_imports_nothing_from_the_package() -> None:
    upward = sorted(n for n in imported(PACKAGE / "rundir.py") if n.split(".")[0] == "elastic_pretrain")
    assert not upward, f"elastic_pretrain/rundir.py must stay at the bottom; it imports {upward}"


def test_the_walker_sees_lazy_relative_and_from_package_imports(tmp_path: Path) -> None:
    """Imports inside functions, relative ones and ``from pkg import commands`` are all found (without
    that, the tests above could not fail)."""
    path = tmp_path / "elastic_pretrain" / "x" / "y.py"
    path.parent.mkdir(parents=True)
    path.write_text(
        "import elastic_pretrain.rundir\n"
        "def f():\n"
        "    from elastic_pretrain.eval.commands import g\n"
        "    from ..train import commands\n"
        "    from elastic_pretrain.data import commands as c\n"
    )
    got = imported(path, tmp_path)
    assert {"elastic_pretrain.rundir", "elastic_pretrain.eval.commands", "elastic_pretrain.train.commands",
            "elastic_pretrain.data.commands"} <= got, got
