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
    assert {
        "elastic_pretrain.rundir",
        "elastic_pretrain.eval.commands",
        "elastic_pretrain.train.commands",
        "elastic_pretrain.data.commands",
    } <= got, got


def test_the_run_directory_page_names_every_file_of_the_contract() -> None:
    from elastic_pretrain.rundir import CheckpointFiles, RunFiles

    page = (REPO / "docs" / "run-directory.md").read_text()
    run, ckpt = RunFiles(Path("R")), CheckpointFiles(Path("C"))
    paths = [getattr(run, p) for p in vars(RunFiles) if isinstance(getattr(RunFiles, p), property)]
    paths += [run.hang_dump(0), run.profile_trace(0), run.step_dir(1), run.eval_dir("step_1")]
    paths += [getattr(ckpt, p) for p in vars(CheckpointFiles)
              if isinstance(getattr(CheckpointFiles, p), property) and isinstance(getattr(ckpt, p), Path)]  # fmt: skip
    paths.append(ckpt.rng(0))
    names = {
        p.relative_to(p.parts[0])
        .as_posix()
        .replace("rank_00000", "rank_<R>")
        .replace("rank_0", "rank_<R>")
        .replace("step_1", "step_<N>")
        for p in paths
        if p.parts[0] in ("R", "C") and len(p.parts) > 1
    }
    missing = sorted(n for n in names if f"`{n}" not in page)
    assert not missing, f"docs/run-directory.md does not list {missing}"
