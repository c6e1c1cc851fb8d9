"""Document sources for prepare-data: the CPython standard library, text files, JSONL, Parquet.

A source yields ``(name, text)`` pairs in a deterministic order. The name identifies the document
(relative path, ``file:line`` or ``file:row``) and decides the train/val split by its hash, so the
held-out set does not move when documents are added or the order changes.
"""

from __future__ import annotations

import glob
import os
import random
import stat
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from elastic_pretrain.data import synthetic
from elastic_pretrain.data.config import PrepareConfig, local_path
from elastic_pretrain.errors import UserError
from elastic_pretrain.jsonsafe import loads as json_loads

Document = tuple[str, str]
_FILE_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".json", ".parquet")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# Decoded text a Parquet file may yield: PARQUET_EXPANSION bytes per byte of the file, at least
# PARQUET_MIN_TEXT. Text compresses 3-5x (zstd, snappy); a dictionary page repeated by its indices
# turned 135 KB into 4 GB (issue 35, item 7): no honest corpus file comes near 100x.
PARQUET_EXPANSION = 100
PARQUET_MIN_TEXT = 64 << 20
PARQUET_BATCH_TEXT = 64 << 20  # decoded at once per batch of rows; a batch above it goes row by row


def stdlib_root() -> Path:
    """The running interpreter's standard library (real text that ships with every Python)."""
    return Path(sysconfig.get_paths()["stdlib"])


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading if it is a regular file (links followed); a one-line error otherwise.

    Opened without blocking and checked on the descriptor, so a FIFO (which would block the open or the
    read forever) or a device such as /dev/zero (endless) is refused even if it replaced a file after
    the listing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise UserError(f"prepare.inputs: cannot open {path} ({err.strerror}); fix the path") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_regular(path)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _not_regular(path: Path) -> UserError:
    return UserError(
        f"prepare.inputs: {path} is not a regular file (a FIFO, device or socket); remove it from the "
        "corpus or narrow prepare.inputs/suffixes"
    )


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:  # a dangling link: not an input
        return False


def _walk(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``; no suffixes: every file that is not hidden."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and (suffixes or not d.startswith(".")))
        out.extend(
            Path(dirpath) / f for f in filenames if (f.endswith(suffixes) if suffixes else not f.startswith("."))
        )
    odd = next((p for p in sorted(out) if os.path.exists(p) and not _regular(p)), None)
    if odd is not None:  # a FIFO hangs the read, /dev/zero never ends (issue 35, item 7)
        raise _not_regular(odd)
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
                elif _regular(p):
                    found[p] = p.name
                elif p.exists():
                    raise _not_regular(p)
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
    with open_regular(path) as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{path}:{lineno}: not UTF-8 text; convert it (iconv -t UTF-8) or drop it") from None
            if not line.strip():
                continue
            obj = json_loads(line, f"{path}:{lineno}", fix="fix or drop the line")  # deep nesting too: one line
            text = obj.get(field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise UserError(f"{path}:{lineno}: no string field {field!r}; set prepare.text_field")
            yield f"{name}:{lineno}", text


def _parquet(path: Path, name: str, field: str) -> Iterator[Document]:
    """Rows of ``field``, at most ``PARQUET_EXPANSION`` x the file's size of text in all.

    The column is read as a dictionary (``read_dictionary``): a value its pages repeat a thousand
    times is decoded once, and each row is materialised only when it is yielded, so memory stays
    near one row (plus the dictionary) whatever the indices repeat. The footer's uncompressed sizes
    are checked before a row group is read; pyarrow decompresses page by page, each at most 2 GiB by
    the format, so a footer that lies about them can still cost one page."""
    import pyarrow.parquet as pq

    with open_regular(path) as f:
        limit = max(PARQUET_MIN_TEXT, PARQUET_EXPANSION * os.fstat(f.fileno()).st_size)
        try:
            pf = pq.ParquetFile(f, read_dictionary=[field])
            names = pf.schema_arrow.names
        except Exception as err:  # pyarrow raises ArrowInvalid / OSError variants
            raise UserError(f"{path}: not a readable Parquet file ({err}); fix or remove it") from None
        if field not in names:
            raise UserError(f"{path}: no column {field!r} (has {', '.join(names)}); set prepare.text_field")
        bomb = UserError(
            f"{path}: column {field!r} expands to more than {limit:,} characters of text ({PARQUET_EXPANSION}x the "
            "file, at least 64 MiB): a compression bomb, not a corpus; remove it or split the file"
        )
        meta = pf.metadata
        column = names.index(field)
        if any(meta.row_group(g).column(column).total_uncompressed_size > limit for g in range(meta.num_row_groups)):
            raise bomb
        row = text_bytes = 0
        for batch in pf.iter_batches(columns=[field], batch_size=1024):
            for text in _batch_texts(batch.column(0)):
                if isinstance(text, str):
                    text_bytes += len(text)
                    if text_bytes > limit:
                        raise bomb
                    yield f"{name}:{row}", text
                row += 1


def _batch_texts(values: Any) -> Iterator[Any]:
    """The rows of a batch: all at once when they decode to at most PARQUET_BATCH_TEXT bytes (each
    distinct value's length times how often the indices name it: nothing repeated is decoded), else
    one by one. (The batch's dictionary holds the row group's values so far: measuring all of it for
    every batch would be quadratic.)"""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(values.type) and pa.types.is_string(values.type.value_type):
        counts = pc.value_counts(values.indices)
        lengths = pc.binary_length(values.dictionary.take(counts.field("values")))
        size = pc.sum(pc.multiply(pc.cast(lengths, pa.int64()), counts.field("counts"))).as_py() or 0
        if size <= PARQUET_BATCH_TEXT:
            yield from values.to_pylist()
            return
    for i in range(len(values)):
        yield values[i].as_py()


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
            with open_regular(path) as f:
                data = f.read()
            try:
                yield name, data.decode("utf-8")
            except UnicodeDecodeError:
                # stdlib ships a few deliberately mis-encoded test files: binary, not text
                counts["skipped_not_utf8"] = counts.get("skipped_not_utf8", 0) + 1
