"""The package's import graph: no cycles between modules, and ``model/`` never imports upward.

The graph is read from the source (``ast``), so it sees every import a module can run: top-level and
function-level alike. Imports under ``if TYPE_CHECKING:`` are left out: they never execute (annotations
only), so they cannot form a cycle at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "elastic_pretrain"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# The model is the bottom layer (docs/architecture.md): it may import itself, the config helpers and errors.
MODEL_MAY_NOT_IMPORT = ("eval", "train", "checkpoint", "parallel", "experiments", "launch", "tracking", "export",
                        "data", "engine", "job", "cli")

# Issue #20 (its checkpoint / run-directory / commands part): job.py imports eval/commands.py
# (resolve_checkpoint), which imports job.py back; checkpoint/manager.py imports job.py, which imports
# checkpoint/manager.py back (shape_changes). Delete these entries when that part lands: the test fails
# while an entry no longer closes a cycle. No other exceptions.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST):
    """Every Import/ImportFrom under ``node``, skipping ``if TYPE_CHECKING:`` bodies (their ``else`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                if isinstance(stmt, ast.Import | ast.ImportFrom):
                    yield stmt
                yield from _imports(stmt)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _imports(child)


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (``from pkg import name`` counts ``pkg.name`` when that
    is a module, else ``pkg``)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # `import a.b.c` of a name inside a module: its module
                    t = t.rpartition(".")[0]
                if t.startswith(PACKAGE) and t in files and t != mod:
                    deps.add(t)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def path_within(graph: dict[str, set[str]], scc: list[str]) -> list[str]:
    """One cycle through the component, for the message: a → … → a."""
    members, start = set(scc), scc[0]
    trail, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[trail[-1]] if w in members)
        back = [w for w in nxt if w in trail]
        if back:
            return [*trail[trail.index(back[0]):], back[0]]
        fresh = [w for w in nxt if w not in seen]
        trail.append(fresh[0])
        seen.add(fresh[0])


def test_the_graph_sees_function_level_imports_and_skips_type_checking(tmp_path):
    """The reader itself: function-level imports are edges, TYPE_CHECKING imports are not."""
    graph = import_graph()
    # eval/commands.py imports the loader inside _eval only
    assert "elastic_pretrain.data.loader" in graph["elastic_pretrain.eval.commands"]
    src = "if TYPE_CHECKING:\n    import a\nelse:\n    import b\ndef f():\n    import c\n"
    assert [n.names[0].name for n in _imports(ast.parse(src)) if isinstance(n, ast.Import)] == ["b", "c"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph()
    sccs = [set(scc) for scc in cycles(graph)]
    stale = sorted(e for e in KNOWN_CYCLE_EDGES
                   if e[1] not in graph.get(e[0], set()) or not any(set(e) <= scc for scc in sccs))
    assert not stale, f"{stale} no longer close an import cycle: delete them from KNOWN_CYCLE_EDGES"
    for a, b in KNOWN_CYCLE_EDGES:
        graph[a] = graph[a] - {b}
    found = [" → ".join(path_within(graph, scc)) for scc in cycles(graph)]
    assert not found, "import cycles (break them; see docs/architecture.md for the layers):\n" + "\n".join(found)


def test_model_does_not_import_upward():
    graph = import_graph()
    banned = tuple(f"{PACKAGE}.{name}" for name in MODEL_MAY_NOT_IMPORT)
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in graph.items()
        if mod.startswith(f"{PACKAGE}.model")
        for dep in deps
        if dep in banned or dep.startswith(tuple(b + "." for b in banned))
    )
    assert not bad, "model/ is the bottom layer and may not import upward:\n" + "\n".join(bad)
