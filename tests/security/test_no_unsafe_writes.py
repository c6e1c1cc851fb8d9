"""Every file the package writes goes through ``elastic_pretrain/files.py`` (issue 35, item 5): a run directory,
checkpoint or export may hold planted links, and only the writer there never follows one. This walks the
syntax tree of every module (like test_no_unsafe_deserialisation.py) and fails on any other write: ``open``
for writing, ``Path.write_text``/``write_bytes``/``mkdir``/``touch``/``rename``/``replace``, ``os.open`` with
write flags, ``os.replace``/``rename``/``makedirs``/``symlink``, ``shutil`` copies and moves, ``savefig``,
``torch.save``/``np.save``/``json.dump``/``yaml.dump`` into anything but a stream of ``files.atomic_file`` or
a ``BytesIO``, and the libraries' own writers (``save_pretrained``, ``export_chrome_trace``, …). Each one
left is on ALLOWED with the reason it cannot write through a planted link.
"""

from __future__ import annotations

import ast

from tests.conftest import REPO

PACKAGE = REPO / "elastic_pretrain"
WRITER = "elastic_pretrain/files.py"  # the writer itself

_FRESH_TMP = "into the .tmp-step_<N>/ that CheckpointStore.prepare just created empty (files.ensure_dir)"
# (module path, enclosing function/class, what) -> why it is safe. Keep the reasons true.
ALLOWED: dict[tuple[str, str, str], str] = {
    # --- the shard-verification cache (data/verified.py): the user's own folder, not a run directory
    ("elastic_pretrain/data/verified.py", "cache_dir", "path.mkdir"): (
        "creates the user's own cache folder (0700) under $XDG_CACHE_HOME or ~/.cache, never a run directory, "
        "checkpoint or export; it is then lstat'ed and not used when a link, not the user's, or writable by others"
    ),
    ("elastic_pretrain/data/verified.py", "_locked", "os.open(write flags)"): (
        "an empty lock file opened O_NOFOLLOW (a planted link is refused) in the checked 0700 cache folder; "
        "nothing is written to it (records go through files.write_atomic)"
    ),
    # --- checkpoints: the store's own directories, and the libraries that write tensors into them
    ("elastic_pretrain/checkpoint/store.py", "CheckpointStore.commit", "os.replace"): (
        "renames the store's own .tmp-step_<N> (made by prepare) to step_<N>; a link at step_<N> is moved to "
        ".trash- first by _remove (rename moves the link itself, never its target)"
    ),
    ("elastic_pretrain/checkpoint/store.py", "CheckpointStore._remove", "os.replace"): (
        "renames a step_<N> to .trash-step_<N> (removed with files.remove_tree first): a link is renamed as a "
        "link, and rmtree never follows one"
    ),
    ("elastic_pretrain/checkpoint/snapshot.py", "SnapshotSaveStrategy._repeat", "os.makedirs"): (
        f"megatron's call, kept: model_optim/ exists already, {_FRESH_TMP}"
    ),
    ("elastic_pretrain/checkpoint/tensors.py", "save_tensors", "dist_checkpointing.save"): (
        f"megatron writes the tensor files (through checkpoint/file_write.py: files.open_new) {_FRESH_TMP}"
    ),
    ("elastic_pretrain/checkpoint/file_write.py", "_write_item_direct", "torch.save"): (
        "into the CrcStream over a file from files.open_new"
    ),
    ("elastic_pretrain/engine/convert.py", "_save_megatron", "dist_checkpointing.save"): (
        f"megatron writes {_FRESH_TMP}"
    ),
    ("elastic_pretrain/engine/convert.py", "_save_deepspeed", "engine.save_checkpoint"): (
        f"DeepSpeed writes {_FRESH_TMP}"
    ),
    ("elastic_pretrain/engine/deepspeed.py", "DeepSpeedTensors.save", "self.engine.save_checkpoint"): (
        f"DeepSpeed writes {_FRESH_TMP}"
    ),
    # --- exports: written into a folder that write_export checked to be new or empty
    ("elastic_pretrain/export/hf_export.py", "write_export", "save_file"): (
        "safetensors writes model.safetensors into the export folder write_export checked new or empty"
    ),
    ("elastic_pretrain/export/hf_export.py", "write_export", "config.save_pretrained"): (
        "transformers writes config.json into the export folder write_export checked new or empty"
    ),
    ("elastic_pretrain/export/hf_export.py", "write_export", "generation_config().save_pretrained"): (
        "transformers writes generation_config.json into the export folder write_export checked new or empty"
    ),
    ("elastic_pretrain/export/tokenizer.py", "export_tokenizer", "fast.save_pretrained"): (
        "transformers writes the tokenizer files into the export folder write_export checked new or empty"
    ),
    # --- the tracker's staging folder (files.ensure_dir below the run directory)
    ("elastic_pretrain/tracking/tracker.py", "MlflowTracker.log_artifact", "shutil.copytree"): (
        "a folder artifact copied into a new staging folder of the tracker's own (files.ensure_dir); no caller "
        "in the package logs a folder"
    ),
    # --- prepared datasets: data/prepare.py builds them in folders it creates (exist_ok=False) or has
    # checked to hold only its own files (docs/security.md, "prepare-data output"); the cache is data/shards.py's
    ("elastic_pretrain/data/shards.py", "MDSSink.__init__", "MDSWriter"): (
        "streaming writes the MDS shards of a split into a folder it creates itself (MDSWriter refuses an "
        "existing non-empty one); prepare-data removed the folder first (remove_leftovers: only its own files)"
    ),
    ("elastic_pretrain/data/shards.py", "WDSSink._drain", "wds.TarWriter"): (
        "a new tar shard in the split folder WDSSink.__init__ created (exist_ok=False)"
    ),
    ("elastic_pretrain/data/shards.py", "WDSSink.__init__", "directory.mkdir"): (
        "a new split folder of prepare-data's output (exist_ok=False: an existing one, or a link, is an error)"
    ),
    ("elastic_pretrain/data/shards.py", "StreamFiles.claim_cache", "self.root.mkdir"): (
        "the cache root the user's recipe names (data.local), created if missing; never a path from a checkpoint"
    ),
    ("elastic_pretrain/data/shards.py", "StreamFiles.claim_cache", "os.open(write flags)"): (
        "the cache marker, created with O_CREAT | O_EXCL | O_NOFOLLOW: a link at its name fails the create"
    ),
    # --- folders the user names on the command line, created or probed before anything is written
    ("elastic_pretrain/train/commands.py", "_prepare_run_dir", "run_dir.mkdir"): (
        "the run directory the user names (--run-dir or runs/<name>), refused first if it is a link"
    ),
    ("elastic_pretrain/train/commands.py", "_prepare_run_dir", "probe.touch"): (
        "touch(exist_ok=False) is O_CREAT | O_EXCL: a link at the probe's name fails the create, never followed"
    ),
    ("elastic_pretrain/experiments/runner.py", "check_runs_root", "runs_root.mkdir"): (
        "the --runs folder the user names, created if missing"
    ),
    ("elastic_pretrain/cli.py", "main", "os.open(write flags)"): (
        "opens /dev/null to take stdout after a broken pipe: nothing is written to a file"
    ),
    ("elastic_pretrain/data/shards.py", "_file_lock", "path.parent.mkdir"): (
        "the dataset cache folder of a remote stream (data/shards.py; issue 35 item 3 checks the cache root)"
    ),
    ("elastic_pretrain/data/shards.py", "_file_lock", "open(.., 'a')"): (
        "a lock file in the dataset cache, opened for flock only: nothing is written to it"
    ),
}


# a stream of files.atomic_file, a temporary path of files.atomic_path, a BytesIO: writing into them is safe
_SAFE_TARGETS = ("atomic_file", "atomic_path", "BytesIO")


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func) + "()"
    return "?"


def _writes_mode(mode: ast.expr | None) -> bool:
    """A file mode that writes (or one we cannot read off the source)."""
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True


_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
_ALWAYS = {  # method or function names that write wherever they are called
    "write_text", "write_bytes", "mkdir", "makedirs", "touch", "symlink_to", "hardlink_to",
    "save_pretrained", "save_file", "save_checkpoint", "to_csv", "mkfifo", "mknod",
    "symlink", "link", "truncate", "copyfile", "copy2", "copytree", "copymode", "copystat",
    "TarWriter", "ShardWriter", "MDSWriter",
}  # fmt: skip
_STREAM_WRITERS = {  # function -> index of its file argument (and the keyword naming it)
    "torch.save": (1, "f"), "np.save": (0, "file"), "np.savez": (0, "file"), "np.savez_compressed": (0, "file"),
    "np.savetxt": (0, "fname"), "json.dump": (1, "fp"), "yaml.dump": (1, "stream"), "yaml.safe_dump": (1, "stream"),
    "pickle.dump": (1, "file"), "dist_checkpointing.save": (1, "checkpoint_dir"),
}  # fmt: skip
_PATH_WRITERS = {"savefig": (0, "fname"), "export_chrome_trace": (0, "path")}  # methods, by name


def _findings(source: str, rel: str) -> list[tuple[str, str, str, int]]:
    """(module, enclosing scope, what, line) for every write in ``source`` that bypasses files.py."""
    tree = ast.parse(source, filename=rel)
    found: list[tuple[str, str, str, int]] = []

    def streams_of(fn: ast.AST) -> set[str]:
        """Names bound to a safe stream in ``fn``: ``with atomic_file(...) as f`` / ``open_new``, ``x = BytesIO()``."""
        names: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
                call = node.context_expr
                if isinstance(call, ast.Call) and _dotted(call.func).split(".")[-1] in _SAFE_TARGETS:
                    names.add(node.optional_vars.id)
            call = node.value if isinstance(node, ast.Assign) else None
            if isinstance(call, ast.Call) and _dotted(call.func).split(".")[-1] == "BytesIO":
                assert isinstance(node, ast.Assign)
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        return names

    def safe_stream(arg: ast.expr | None, streams: set[str]) -> bool:
        if isinstance(arg, ast.Call) and _dotted(arg.func) == "str" and len(arg.args) == 1:
            arg = arg.args[0]  # str(tmp) of an atomic_path
        if isinstance(arg, ast.Name) and arg.id in streams:
            return True
        return isinstance(arg, ast.Call) and _dotted(arg.func).split(".")[-1] == "BytesIO"

    def visit(node: ast.AST, scope: str, streams: set[str]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            scope = f"{scope.split('.')[0]}.{node.name}" if scope[:1].isupper() else node.name
            streams = streams | streams_of(node)
        elif isinstance(node, ast.ClassDef):
            scope = node.name
        if isinstance(node, ast.Call):
            what = _call_write(node, streams, safe_stream)
            if what:
                found.append((rel, scope, what, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, scope, streams)

    visit(tree, "<module>", streams_of(tree))
    return found


def _call_write(node: ast.Call, streams: set[str], safe_stream) -> str | None:  # type: ignore[no-untyped-def]
    func = _dotted(node.func)
    name = func.split(".")[-1]
    kw = {k.arg: k.value for k in node.keywords}
    args = node.args
    if func == "open":
        mode = kw.get("mode", args[1] if len(args) > 1 else None)
        return (
            f"open(.., {mode.value!r})"
            if _writes_mode(mode) and isinstance(mode, ast.Constant)
            else ("open(.., <mode>)" if _writes_mode(mode) else None)
        )
    if func == "os.open":
        flags = {n.attr for a in args[1:2] for n in ast.walk(a) if isinstance(n, ast.Attribute)}
        return "os.open(write flags)" if flags & _WRITE_FLAGS else None
    if func in ("os.fdopen", "io.open") or (name == "open" and isinstance(node.func, ast.Attribute)):
        pos = args[1:2] if func in ("os.fdopen", "io.open", "tarfile.open", "gzip.open") else args[:1]
        mode = kw.get("mode", pos[0] if pos else None)
        if isinstance(mode, ast.Constant) and not isinstance(mode.value, str):
            mode = None
        return f"{func}(.., {ast.unparse(mode)})" if _writes_mode(mode) else None
    if func in ("os.replace", "os.rename", "os.renames", "os.makedirs", "os.mkdir", "os.symlink", "os.link",
                "shutil.copy", "shutil.move", "os.truncate"):  # fmt: skip
        return func
    if name in _ALWAYS:
        return func
    if name in ("rename", "replace") and isinstance(node.func, ast.Attribute) and len(args) == 1 and not kw:
        return f"{func}(1 argument: Path.{name})"  # str.replace takes two
    if func in _STREAM_WRITERS or (name in _PATH_WRITERS and isinstance(node.func, ast.Attribute)):
        index, key = _STREAM_WRITERS[func] if func in _STREAM_WRITERS else _PATH_WRITERS[name]
        target = kw.get(key, args[index] if len(args) > index else None)
        if target is None and func.startswith("yaml."):
            return None  # yaml.dump(data) returns a string
        return None if safe_stream(target, streams) else func
    return None


def test_every_write_goes_through_files_py() -> None:
    found = [
        f
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(REPO).as_posix() != WRITER
        for f in _findings(p.read_text(), p.relative_to(REPO).as_posix())
    ]
    unexplained = [
        f"{m}:{line} in {scope}: {what}" for m, scope, what, line in found if (m, scope, what) not in ALLOWED
    ]
    assert not unexplained, (
        "a write that does not go through elastic_pretrain/files.py (use write_atomic / atomic_file / "
        "append_text / ensure_dir / copy_file, or add it to ALLOWED with why no planted link can redirect it):\n"
        + "\n".join(unexplained)
    )
    stale = set(ALLOWED) - {(m, scope, what) for m, scope, what, _ in found}
    assert not stale, f"ALLOWED names writes that no longer exist: {sorted(stale)}"


def test_the_walk_finds_each_write() -> None:
    """The detector itself: each way to write a file in a sample module is reported (so a pass means
    something), and the safe forms are not."""
    sample = (
        "import io, json, os, shutil, torch, numpy as np, yaml\n"
        "from elastic_pretrain.files import atomic_file\n"
        "def f(p, q, fig, obj):\n"
        "    open(p, 'w')\n"
        "    open(p, mode='ab')\n"
        "    p.open('a')\n"
        "    p.write_text('x')\n"
        "    p.write_bytes(b'x')\n"
        "    p.mkdir(parents=True)\n"
        "    p.replace(q)\n"
        "    os.replace(p, q)\n"
        "    os.open(p, os.O_WRONLY | os.O_CREAT)\n"
        "    os.fdopen(3, 'w')\n"
        "    shutil.copyfile(p, q)\n"
        "    shutil.copytree(p, q)\n"
        "    fig.savefig(p)\n"
        "    torch.save(obj, p)\n"
        "    json.dump(obj, p)\n"
        "    prof.export_chrome_trace(str(p))\n"
        "    open(p)\n"  # --- not writes: reads, strings, safe streams
        "    open(p, 'rb')\n"
        "    p.open()\n"
        "    os.open(p, os.O_RDONLY | os.O_NOFOLLOW)\n"
        "    'a-b'.replace('-', '_')\n"
        "    yaml.safe_dump(obj)\n"
        "    buf = io.BytesIO()\n"
        "    torch.save(obj, buf)\n"
        "    with atomic_file(p, root=q) as g:\n"
        "        torch.save(obj, g)\n"
        "        json.dump(obj, g)\n"
    )
    assert sorted(what for _, _, what, _ in _findings(sample, "sample.py")) == sorted(
        [
            "open(.., 'w')",
            "open(.., 'ab')",
            "p.open(.., 'a')",
            "p.write_text",
            "p.write_bytes",
            "p.mkdir",
            "p.replace(1 argument: Path.replace)",
            "os.replace",
            "os.open(write flags)",
            "os.fdopen(.., 'w')",
            "shutil.copyfile",
            "shutil.copytree",
            "fig.savefig",
            "torch.save",
            "json.dump",
            "prof.export_chrome_trace",
        ]
    )
