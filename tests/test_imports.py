"""The package's import graph: no cycles between modules, and no import against the declared package order.

The graph is read from the source (``ast``), so it sees every import a module can run: top-level and
function-level alike. Imports under ``if TYPE_CHECKING:`` are left out: they never execute (annotations
only), so they cannot form a cycle at run time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = "elastic_pretrain"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# The declared order of the package, lowest layer first; docs/architecture.md draws the same picture. A module
# imports its own node and nodes of lower layers only: never a node of its own layer (siblings are independent)
# or of a higher one. A node is a top-level module or subpackage, except two layers that cut across packages:
# every package's ``config.py`` (its typed config, nested by JobConfig: a leaf over the base layers) and every
# ``commands.py`` (argv -> one call; only cli.py imports them, tests/test_layering.py).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "rundir", "_import_hooks", "provenance"),  # import nothing of the package
    ("config",),  # field(), build(), YAML, overrides, parse_bytes
    ("jsonsafe", "files", "internals", "quiet"),
    ("*/config",),  # ModelConfig, DataConfig, TrainConfig, CheckpointConfig, SlurmConfig...
    ("model", "data", "tracking", "schedule"),  # schedule: depth plans, ScheduleConfig, ExpertLayout, controller
    ("parallel",),  # process groups, build_model, DDP, the pipeline runner
    ("checkpoint", "job"),  # storage (builds no model, knows no JobConfig); the schema (JobConfig: reads no file)
    ("job_loader", "eval"),  # a job file (presets, a decider's base checkpoint); the evaluator
    ("train",),  # the loop, the megatron session and step
    ("engine",),  # build_session: megatron's or DeepSpeed's; load_model from either engine's checkpoint
    ("launch", "experiments", "export", "config_reference"),
    ("*/commands",),
    ("cli",),
)

# Imports against the order that must stay, each with its reason; empty, and best kept so. Keys are (importer,
# imported) modules. The test fails when an entry no longer imports or is no longer against the order.
ALLOWED: dict[tuple[str, str], str] = {}


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
            return [*trail[trail.index(back[0]) :], back[0]]
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


def node(module: str) -> str:
    """The node of LAYERS a module belongs to (``elastic_pretrain.train.step`` -> ``train``)."""
    parts = module.split(".")
    if len(parts) == 1:  # the package's __init__ only installs the import hook
        return "_import_hooks"
    if len(parts) == 3 and parts[2] in ("config", "commands"):
        return f"*/{parts[2]}"
    return parts[1]


def against_order(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every (importer, imported) module pair whose nodes differ and whose imported node is not below."""
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    return sorted(
        (a, b) for a, deps in graph.items() for b in deps if node(a) != node(b) and rank[node(b)] >= rank[node(a)]
    )


def test_no_import_cycles():
    graph = import_graph()
    found = [" → ".join(path_within(graph, scc)) for scc in cycles(graph)]
    assert not found, "import cycles (break them; see docs/architecture.md for the layers):\n" + "\n".join(found)


def test_every_node_has_a_place_in_the_order():
    declared = [name for layer in LAYERS for name in layer]
    assert len(declared) == len(set(declared)), "a node appears twice in LAYERS"
    present = {node(m) for m in import_graph()}
    assert present == set(declared), (
        f"not in LAYERS (place them): {sorted(present - set(declared))}; "
        f"in LAYERS but not in the package (delete them): {sorted(set(declared) - present)}"
    )


def test_no_import_against_the_declared_order():
    """Lazy (function-level) imports count: a cycle through a function is still a cycle of the design."""
    found = against_order(import_graph())
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"{stale} no longer import against the order: delete them from ALLOWED"
    bad = [f"{a} ({node(a)}) imports {b} ({node(b)})" for a, b in found if (a, b) not in ALLOWED]
    assert not bad, (
        "imports against the declared order (tests/test_imports.py LAYERS, docs/architecture.md): "
        "move the code to the layer that owns it\n" + "\n".join(bad)
    )


def test_the_order_check_sees_siblings_and_upward_imports():
    """The checker itself, on a made-up graph: a sibling import and an upward one are found, a downward one is not."""
    graph = {
        "elastic_pretrain.model.looped": {"elastic_pretrain.data.loader", "elastic_pretrain.config"},
        "elastic_pretrain.parallel.mesh": {"elastic_pretrain.train.step", "elastic_pretrain.model.looped"},
        "elastic_pretrain.job": {"elastic_pretrain.train.config"},
    }
    assert against_order(graph) == [
        ("elastic_pretrain.model.looped", "elastic_pretrain.data.loader"),
        ("elastic_pretrain.parallel.mesh", "elastic_pretrain.train.step"),
    ]
    assert node("elastic_pretrain") == "_import_hooks" and node("elastic_pretrain.eval.commands") == "*/commands"


def test_docs_architecture_draws_the_declared_order():
    """docs/architecture.md's first mermaid picture is LAYERS, top row first (``L12["cli.py"]``...)."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    picture = text.split("```mermaid\n", 1)[1].split("```", 1)[0]
    rows = re.findall(r'^\s*L\d+\["([^"]*)"\]', picture, flags=re.M)
    drawn = tuple(
        tuple(name.strip().removesuffix(".py").removesuffix("/") for name in row.split("·")) for row in reversed(rows)
    )
    assert drawn == LAYERS, f"docs/architecture.md draws {drawn}, tests/test_imports.py declares {LAYERS}"
