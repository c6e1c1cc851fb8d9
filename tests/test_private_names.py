"""Every private (underscore) name of megatron-core, torch and DeepSpeed the package uses is listed in
``elastic_pretrain/internals.py`` and exists in the installed versions with the recorded signature, so a
version change fails here, in CI, and not at the first async save on a cluster (issue 30, item 7).

The uses are found in the syntax tree of every module of the package: ``from lib.x import _y`` (or any
private part of an imported path), ``mod._y`` / ``mod.Cls._y`` on a name imported from a library (also
assigned, and as a constant in ``getattr``/``setattr``/``hasattr``), and every ``obj._y`` on an object the
tree cannot type (a layer, an optimizer, an engine): such a name must be the attribute of a listed library
class, or be named in :data:`NOT_A_LIBRARY`. ``self._y`` / ``cls._y`` are the class's own.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_pretrain import internals
from elastic_pretrain.errors import UserError
from tests.conftest import REPO

PACKAGE = REPO / "elastic_pretrain"
LIBRARIES = ("megatron", "torch", "deepspeed")

# private attributes read on objects the tree cannot type that belong to no library (what they are)
NOT_A_LIBRARY: dict[str, str] = {
    "_enc": "our tokenizer's tiktoken encoding (data/tokenizer.py)",
    "_special_tokens": "tiktoken Encoding's",
    "_mergeable_ranks": "tiktoken Encoding's",
    "_pat_str": "tiktoken Encoding's",
    "_elastic_pretrain_standin": "our marker on a stood-in module (data/streaming_compat.py)",
    "_name_or_path": "transformers PretrainedConfig's (export/folder.py)",
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Every name a module binds by an import (anywhere in it) -> the dotted path it stands for."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return out


def _chain(node: ast.expr) -> tuple[ast.expr, list[str]]:
    """``a.b.c`` -> (the root expression ``a``, ["b", "c"])."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return node, parts[::-1]


def private_uses(source: str, where: str) -> Iterator[tuple[str, str, str]]:
    """(kind, name, location) of every private name ``source`` uses: kind ``library`` with the dotted path for
    a name reached from a library import, ``object`` with the attribute name for one on an untyped object."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                path = f"{node.module}.{a.name}"
                if path.split(".")[0] in LIBRARIES and any(is_private(p) for p in path.split(".")):
                    yield "library", path, f"{where}:{node.lineno}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARIES and any(is_private(p) for p in a.name.split(".")):
                    yield "library", a.name, f"{where}:{node.lineno}"
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            root, parts = _chain(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):  # fmt: skip
            root, parts = _chain(node.args[0])
            parts = [*parts, node.args[1].value]
        else:
            continue
        if not any(is_private(p) for p in parts):
            continue
        last = max(i for i, p in enumerate(parts) if is_private(p))
        loc = f"{where}:{node.lineno}"
        if isinstance(root, ast.Name) and root.id in aliases:
            origin = aliases[root.id]
            if origin.split(".")[0] in LIBRARIES:
                yield "library", ".".join([origin, *parts[: last + 1]]), loc
            continue  # the standard library's, another package's module, or one of ours
        own = isinstance(root, ast.Name) and root.id in ("self", "cls")
        for i, p in enumerate(parts):
            if is_private(p) and not (own and i == 0):
                yield "object", p, loc


def package_uses() -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for kind, name, loc in private_uses(path.read_text(), str(path.relative_to(REPO))):
            out.setdefault((kind, name), []).append(loc)
    return out


def _class_attributes() -> dict[str, internals.Private]:
    """Attribute name -> the listed private attribute of a library class it stands for."""
    return {e.where.rsplit(".", 1)[1]: e for e in internals.PRIVATE if "." in e.where.split(":")[1]}


def test_every_private_name_the_package_uses_is_listed() -> None:
    uses = package_uses()
    listed = {e.dotted for e in internals.PRIVATE}
    on_classes = _class_attributes()
    unlisted = [f"{locs[0]}: {name}" for (kind, name), locs in uses.items() if kind == "library" and name not in listed]
    untyped = [f"{locs[0]}: .{name}" for (kind, name), locs in uses.items()
               if kind == "object" and name not in on_classes and name not in NOT_A_LIBRARY]  # fmt: skip
    assert not unlisted, "private library names missing from elastic_pretrain/internals.py PRIVATE: " + "; ".join(
        unlisted
    )
    assert not untyped, ("private attributes of untyped objects: list the library's in internals.PRIVATE, "
                         "or say whose they are in NOT_A_LIBRARY here: " + "; ".join(untyped))  # fmt: skip
    used = {name for kind, name in uses if kind == "library"} | {
        on_classes[name].dotted for kind, name in uses if kind == "object" and name in on_classes
    }
    assert sorted(listed - used) == [], "listed in internals.PRIVATE but no longer used: remove them"


def test_every_listed_name_exists_with_its_recorded_signature() -> None:
    from elastic_pretrain.engine.weights import import_deepspeed

    import_deepspeed()  # as the engine imports it (CPU accelerator), before its names are looked up
    problems = []
    for e in internals.PRIVATE:
        lib = f"{internals.DISTRIBUTION[e.library]} {internals.version(e.library)}"
        found = internals.resolve(e)
        if found is None:
            problems.append(f"{e.dotted}: missing in {lib}")
            continue
        name, obj = found
        if name != e.where.split(":")[1]:
            continue  # its later public name (a renamed private one): no signature recorded for it
        sig = None if e.instance else internals.signature(obj)
        if sig != e.signature:
            problems.append(f"{e.dotted} in {lib}: {sig} (recorded: {e.signature})")
    assert not problems, "private names changed (update the code that uses them, then internals.PRIVATE): " + (
        "; ".join(problems)
    )


def test_the_scanner_finds_each_kind_of_use() -> None:
    """Without this, the tests above could pass by finding nothing."""
    source = """
import torch._C as c
import megatron.core.x as mx
from megatron.core.y import _private, public
from torch.utils._pytree import tree_flatten
from deepspeed.utils import zero_to_fp32 as z
import os

def f(layer, self_like):
    c._current_graph_task_id()
    mx.Cls._method(1).public
    mx._glob = None
    getattr(z, "_merge")(1)
    os._exit(0)
    layer._forward_mlp(1)
    self.helper._inner()
    self._own()
"""
    found = sorted((kind, name) for kind, name, _ in private_uses(source, "m.py"))
    assert found == [("library", "deepspeed.utils.zero_to_fp32._merge"), ("library", "megatron.core.x.Cls._method"),
                     ("library", "megatron.core.x._glob"), ("library", "megatron.core.y._private"),
                     ("library", "torch._C"), ("library", "torch._C._current_graph_task_id"),
                     ("library", "torch.utils._pytree.tree_flatten"),
                     ("object", "_forward_mlp"), ("object", "_inner")]  # fmt: skip


def test_a_changed_signature_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None, packed_seq_params=None):  # type: ignore[no-untyped-def]
        return hidden_states

    monkeypatch.setattr(TransformerLayer, "_forward_mlp", _forward_mlp)
    with pytest.raises(AssertionError, match=r"TransformerLayer\._forward_mlp in megatron-core .*packed_seq_params"):
        test_every_listed_name_exists_with_its_recorded_signature()


@pytest.fixture
def fresh_require() -> Iterator[None]:
    internals.require.cache_clear()
    yield
    internals.require.cache_clear()


def test_a_missing_private_name_stops_the_model_build_in_one_line(
    mesh1, fresh_require, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The package itself refuses to start when a private name it calls is gone (a megatron-core version that
    dropped ``TransformerLayer._forward_pre_mlp_layernorm``), naming the version and the fix."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.parallel.megatron import build_model

    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single"])
    monkeypatch.delattr(TransformerLayer, "_forward_pre_mlp_layernorm")
    with pytest.raises(UserError) as err:
        build_model(job.model, job.parallel)
    text = str(err.value)
    assert "\n" not in text and text.startswith(
        f"megatron-core {internals.version('megatron')} has no "
        "megatron.core.transformer.transformer_layer.TransformerLayer._forward_pre_mlp_layernorm, which "
        "elastic-pretrain uses (tested with megatron-core 0.16.1): install megatron-core==0.16.1"
    )


def test_async_checkpoints_write_under_megatron_0_17s_name_of_the_results_queue(
    mesh1, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """megatron-core 0.17 renamed ``_get_write_results_queue()`` to ``get_write_results_queue(mp_mode='spawn')``
    (same module global): the async writer takes either; full and repeated (cached-plan) saves load back."""
    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from elastic_pretrain.checkpoint import parallel_io
    from elastic_pretrain.checkpoint.tensors import load_tensors, save_tensors
    from tests.dist.ckpt_reshard import build

    old = filesystem_async._get_write_results_queue

    def get_write_results_queue(mp_mode: str = "spawn"):  # type: ignore[no-untyped-def]
        return old()

    monkeypatch.delattr(filesystem_async, "_get_write_results_queue")
    monkeypatch.setattr(filesystem_async, "get_write_results_queue", get_write_results_queue, raising=False)
    assert "mp_mode" in inspect.signature(filesystem_async.get_write_results_queue).parameters
    net, _, optimizer = build("single")
    saves, queue = parallel_io.trainer_saves(), AsyncCallsQueue()
    for i in range(3):  # the third save reuses the plan (checkpoint/snapshot.py: _repeat)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
        (tmp_path / str(i)).mkdir()
        request, _ = save_tensors(net, optimizer, tmp_path / str(i), saves, use_async=True)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    want = {k: v.clone() for k, v in net.state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    load_tensors(net, None, tmp_path / "2")
    assert [k for k, v in net.state_dict().items() if isinstance(v, torch.Tensor) and not torch.equal(v, want[k])] == []


def test_the_multistorage_writer_takes_megatron_0_17s_name_of_the_bucket_writer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """megatron-core 0.17 renamed ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (a process per file)
    to ``write_preloaded_data_multithread`` (a thread per file), same arguments: the writer of a
    multistorageclient save (checkpoint/snapshot.py) calls whichever the installed version has, and a version
    with neither is refused in one line."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from elastic_pretrain.checkpoint import snapshot

    cls = filesystem_async.FileSystemWriterAsync
    assert internals.write_preloaded_data() is cls.write_preloaded_data_multiproc  # megatron-core 0.16.1
    calls: list[tuple[object, ...]] = []

    def write_preloaded_data_multithread(*args: object) -> None:
        calls.append(args)

    monkeypatch.delattr(cls, "write_preloaded_data_multiproc")
    monkeypatch.setattr(cls, "write_preloaded_data_multithread", write_preloaded_data_multithread, raising=False)
    snapshot._write_snapshot(0, [], True, 3, [], "queue")  # use_msc: megatron's writer writes the buckets
    assert calls == [([], True, 3, [], "queue")]
    monkeypatch.delattr(cls, "write_preloaded_data_multithread")
    with pytest.raises(UserError, match=r"neither FileSystemWriterAsync\.write_preloaded_data_multithread"):
        internals.write_preloaded_data()
