"""Document sources for prepare-data: the CPython standard library, text files, JSONL, Parquet.

A source yields ``(name, text)`` pairs in a deterministic order. The name identifies the document
(relative path, ``file:line`` or ``file:row``) and decides the train/val split by its hash, so the
held-out set does not move when documents are added or the order changes.
"""

from __future__ import annotations

import glob
import json
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from elastic_pretrain.data import synthetic
from elastic_pretrain.data.config import PrepareConfig, local_path
from elastic_pretrain.errors import UserError

Document = tuple[str, str]
_FILE_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".json", ".parquet")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    """The running interpreter's standard library (real text that ships with every Python)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _walk(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``; no suffixes: every file that is not hidden."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and (suffixes or not d.startswith(".")))
        out.extend(
            Path(dirpath) / f for f in filenames if (f.endswith(suffixes) if suffixes else not f.startswith("."))
        )
    return sorted(out)


def file_suffixes(cfg: PrepareConfig) -> tuple[str, ...]:
    """The suffixes a directory walk keeps; empty: every file (a forced ``input_format`` reads any name)."""
    if cfg.suffixes:
        return tuple(cfg.suffixes)
    if cfg.source == "stdlib":
        return (".py",)
    return _FILE_SUFFIXES if cfg.input_format == "auto" else ()


def list_files(cfg: PrepareConfig) -> list[tuple[Path, str]]:
    """(file, document-name prefix) pairs, sorted, then shuffled by ``cfg.seed`` at file granularity.

    The shuffle spreads the sources (e.g. stdlib packages) across shards, which WebDataset's
    window shuffle relies on; it is seeded, so the file order is still deterministic.
    """
    if cfg.source == "stdlib":
        root = stdlib_root()
        suffixes = file_suffixes(cfg)
        files = [(p, p.relative_to(root).as_posix()) for p in _walk(root, suffixes)]
    else:
        suffixes = file_suffixes(cfg)
        found: dict[Path, str] = {}
        for spec in cfg.inputs:
            matches = sorted(glob.glob(str(local_path(spec)), recursive=True)) if glob.has_magic(spec) else [spec]
            if not matches:
                raise UserError(f"prepare.inputs: {spec!r} matches no file; fix the path or glob")
            for m in matches:
                p = local_path(m)
                if p.is_dir():
                    found.update((f, f"{p.name}/{f.relative_to(p).as_posix()}") for f in _walk(p, suffixes))
                elif p.is_file():
                    found[p] = p.name
                else:
                    raise UserError(f"prepare.inputs: {p} does not exist; fix the path")
        files = sorted(found.items())
    if not files:
        which = f"with suffixes {', '.join(suffixes)}" if suffixes else "(hidden files are left out)"
        raise UserError(f"prepare: no input files {which}; check prepare.inputs/suffixes")
    random.Random(cfg.seed).shuffle(files)
    return files


def _kind(path: Path, cfg: PrepareConfig) -> str:
    if cfg.input_format != "auto":
        return cfg.input_format
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(path.suffix, "text")


def _jsonl(path: Path, name: str, field: str) -> Iterator[Document]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{path}:{lineno}: not UTF-8 text; convert it (iconv -t UTF-8) or drop it") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{lineno}: not valid JSON ({err.msg}); fix or drop the line") from None
            text = obj.get(field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise UserError(f"{path}:{lineno}: no string field {field!r}; set prepare.text_field")
            yield f"{name}:{lineno}", text


def _parquet(path: Path, name: str, field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError variants
        raise UserError(f"{path}: not a readable Parquet file ({err}); fix or remove it") from None
    if field not in pf.schema_arrow.names:
        raise UserError(f"{path}: no column {field!r} (has {', '.join(pf.schema_arrow.names)}); set prepare.text_field")
    row = 0
    # row-group batches keep memory bounded on large files
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str):
                yield f"{name}:{row}", text
            row += 1


def iter_documents(cfg: PrepareConfig, counts: dict[str, int], *, seq_len: int = 0) -> Iterator[Document]:
    """All documents of the configured source; undecodable text files are counted in ``counts``. A synthetic
    source generates documents of ``seq_len`` characters forever (data/synthetic.py)."""
    if cfg.source == "synthetic":
        assert cfg.synthetic is not None  # PrepareConfig checks it
        yield from synthetic.documents(cfg.synthetic, seed=cfg.seed, chars=seq_len)
        return
    for path, name in list_files(cfg):
        kind = _kind(path, cfg)
        if kind == "jsonl":
            yield from _jsonl(path, name, cfg.text_field)
        elif kind == "parquet":
            yield from _parquet(path, name, cfg.text_field)
        else:
            try:
                yield name, path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                # stdlib ships a few deliberately mis-encoded test files: binary, not text
                counts["skipped_not_utf8"] = counts.get("skipped_not_utf8", 0) + 1
