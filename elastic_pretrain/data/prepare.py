"""prepare-data: documents -> tokens -> packed fixed-length sequences -> shards + manifest.

Documents are tokenised, each followed by EOS, concatenated and cut into rows of seq_len+1 tokens
(the trailing partial row of each split is dropped and counted). The split is per document by a
hash of its name, so the held-out set is stable. The manifest is written last and atomically; a
re-run with a complete manifest for the same recipe does nothing, and a re-run after an interrupted
preparation starts the split directories over.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from elastic_pretrain.config import to_dict
from elastic_pretrain.data.config import DataConfig, PrepareConfig, TokenizerConfig, local_path
from elastic_pretrain.data.difficulty import DifficultySink
from elastic_pretrain.data.manifest import MANIFEST, Manifest, SplitInfo, read_manifest, verify_shard, write_manifest
from elastic_pretrain.data.shards import add_index_hashes, make_sink
from elastic_pretrain.data.sources import Document, iter_documents, list_files
from elastic_pretrain.data.synthetic import token_difficulty
from elastic_pretrain.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, token_dtype
from elastic_pretrain.errors import UserError

SPLITS = ("train", "val")
_CHUNK_CHARS = 1 << 20  # documents per worker task, by size: big enough to amortise pickling


def is_val(name: str, fraction: float) -> bool:
    """Deterministic held-out choice by document name (sha1 -> uniform in [0, 1))."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha1(name.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < fraction


def recipe_of(cfg: DataConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """What decides the shard contents; a manifest with a different recipe is not reused."""
    assert cfg.prepare is not None
    prep = {k: v for k, v in to_dict(cfg.prepare).items() if k not in ("num_workers", "output")}
    if prep.get("synthetic") is None:  # absent from the recipes of manifests written before it existed
        prep.pop("synthetic", None)
    if cfg.prepare.source == "stdlib":
        prep["python"] = sys.version.split()[0]
    return {"format": cfg.format, "seq_len": cfg.seq_len, "tokenizer": tokenizer.fingerprint, "prepare": prep}


# ------------------------------------------------------------------------------------ tokenising
_worker_tok: Tokenizer | None = None


def _init_worker(tok_cfg: TokenizerConfig) -> None:
    global _worker_tok
    _worker_tok = load_tokenizer(tok_cfg)


def _encode_chunk(chunk: list[tuple[int, str]]) -> list[tuple[int, np.ndarray]]:
    assert _worker_tok is not None
    return [(split, _encode(_worker_tok, text)) for split, text in chunk]


def _encode(tok: Tokenizer, text: str) -> np.ndarray:
    ids = tok.encode_array(text) if isinstance(tok, ByteTokenizer) else np.asarray(tok.encode(text))
    out = np.empty(len(ids) + 1, dtype=token_dtype(tok.vocab_size))
    out[:-1] = ids
    out[-1] = tok.eos_id  # the document separator
    return out


def _chunks(docs: Iterable[tuple[int, str]]) -> Iterator[list[tuple[int, str]]]:
    chunk: list[tuple[int, str]] = []
    size = 0
    for item in docs:
        chunk.append(item)
        size += len(item[1])
        if size >= _CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _tokenised(cfg: DataConfig, tok: Tokenizer, docs: Iterable[tuple[int, str]]) -> Iterator[tuple[int, np.ndarray]]:
    """(split, tokens+EOS) in document order; a process pool for non-byte tokenizers.

    Byte-level encoding is a memcpy, faster than pickling the text to a worker, so it stays here.
    ``imap`` keeps the document order, which keeps the shards deterministic.
    """
    assert cfg.prepare is not None
    workers = cfg.prepare.num_workers or min(8, os.cpu_count() or 1)
    if isinstance(tok, ByteTokenizer) or workers <= 1:
        for split, text in docs:
            yield split, _encode(tok, text)
        return
    for chunk in ordered_map(_encode_chunk, _chunks(docs), workers, _init_worker, (cfg.tokenizer,)):
        yield from chunk


def ordered_map(
    fn: Any, items: Iterable[Any], workers: int, initializer: Any, initargs: tuple[Any, ...]
) -> Iterator[Any]:
    """``fn`` over ``items`` in ``workers`` processes, results in input order, at most ``2 * workers``
    items in flight. A worker that raises, or dies (a Rust panic, a segfault, the OOM killer), ends the
    map with a :class:`UserError`: ``multiprocessing.Pool`` would replace the dead worker and wait forever
    for its result."""
    # spawn: the parent may hold torch / Rust tokenizer threads, which fork would copy half-initialised
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=initializer, initargs=initargs)
    pending: collections.deque[Future[Any]] = collections.deque()
    try:
        it = iter(items)
        for item in it:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                break
        while pending:
            result = _result(pending.popleft())
            for item in itertools.islice(it, 1):
                pending.append(pool.submit(fn, item))
            yield result
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Future[Any]) -> Any:
    try:
        return future.result()
    except UserError:
        raise
    except BrokenProcessPool:
        raise UserError(
            "prepare-data: a tokenizer worker process died (crashed, or killed for memory): rerun with "
            "prepare.num_workers=1 to see the error, or fix the tokenizer file"
        ) from None
    except Exception as err:
        raise UserError(f"prepare-data: a tokenizer worker failed ({type(err).__name__}: {str(err)[:200]})") from None


# --------------------------------------------------------------------------------------- packing
class _Packer:
    """Concatenates tokenised documents of one split and writes full rows of ``sample_tokens``."""

    def __init__(self, sink: Any, sample_tokens: int, cap_tokens: int | None) -> None:
        self.sink, self.n, self.cap = sink, sample_tokens, cap_tokens
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.rows = 0
        self.documents = 0
        self.dropped = 0

    @property
    def full(self) -> bool:
        return self.cap is not None and self.rows * self.n >= self.cap

    def add(self, tokens: np.ndarray) -> None:
        self.documents += 1
        self.pending.append(tokens)
        self.pending_len += len(tokens)
        if self.pending_len >= 64 * self.n:  # batch rows: numpy reshapes instead of per-token Python
            self._flush()

    def _flush(self, final: bool = False) -> None:
        if not self.pending:
            return
        buf = np.concatenate(self.pending)
        rows = len(buf) // self.n
        if self.cap is not None:
            rows = min(rows, max(0, math.ceil(self.cap / self.n) - self.rows))
        if rows:
            self.sink.write(buf[: rows * self.n].reshape(rows, self.n))
            self.rows += rows
        rest = buf[rows * self.n :]
        self.pending, self.pending_len = ([rest], len(rest)) if len(rest) and not self.full else ([], 0)
        if final or self.full:
            self.dropped += len(rest)

    def finish(self) -> SplitInfo:
        self._flush(final=True)
        shards = self.sink.finish()
        index = getattr(self.sink, "index_sha256", None)  # MDS: index.json's checksum
        return SplitInfo(
            sequences=self.rows, tokens=self.rows * self.n, documents=self.documents, shards=shards, index_sha256=index
        )


# ------------------------------------------------------------------------------------------- main
def _existing(
    out: Path, recipe: dict[str, Any], verify: str, inputs: dict[str, Any] | None, say: Callable[[str], None]
) -> Manifest | None:
    """A complete, matching, intact previous preparation of the same inputs (then there is nothing to do).

    None: build (again). Damaged or missing shards and changed inputs are rebuilt, not refused: the
    shards are a deterministic function of the recipe and the inputs, so a re-run is the repair."""
    if not (out / MANIFEST).is_file():
        return None
    manifest = read_manifest(out)
    if manifest.recipe != recipe:
        raise UserError(
            f"{out}: holds shards of a different recipe; choose another prepare.output or delete {out} to rebuild"
        )
    change = inputs_change(manifest.stats.get("inputs"), inputs)
    if change:
        say(f"{out}: inputs changed since the shards were built ({change}): rebuilding")
        return None
    for split, info in manifest.splits.items():
        for shard in info.shards + (info.difficulty or []):
            problem = verify_shard(out / split / shard.name, shard, verify)
            if problem:
                say(f"{out}: shard {split}/{shard.name} {problem}: rebuilding the shards")
                return None
    if manifest.format == "mds" and any(s.index_sha256 is None for s in manifest.splits.values()):
        add_index_hashes(manifest, out)  # a manifest from before index.json was hashed: check it, then hash it
        write_manifest(manifest, out)
    seen = manifest.stats.get("inputs")
    if seen and inputs:
        say(f"{out}: up to date ({seen['files']:,} input files unchanged)")
    elif recipe["prepare"].get("source") == "synthetic":
        say(f"{out}: up to date with the recipe (generated from prepare.seed)")
    elif inputs:  # built before the inputs were recorded: added files cannot be seen
        say(f"{out}: up to date with the recipe (its input files were not recorded; delete {out} to rebuild)")
    else:
        say(f"{out}: up to date with the recipe (the inputs cannot be listed: shards kept as they are)")
    return manifest


# The files prepare-data writes into a split directory: MDS shards and index, WebDataset shards.
_OWN_FILE = re.compile(r"shard\.\d{5,}\.mds|shard-\d{6,}\.tar|index\.json|difficulty\.\d{5,}\.npy")


def remove_leftovers(out: Path) -> None:
    """Delete the split directories of an interrupted preparation (there is no manifest), but only if they
    hold nothing except files prepare-data writes: ``prepare.output`` may name a folder with data of its own."""
    for split in SPLITS:
        folder = out / split
        if not folder.exists() and not folder.is_symlink():
            continue
        if folder.is_symlink() or not folder.is_dir():
            foreign = ""
        else:
            names = sorted(p.name for p in folder.iterdir() if not _OWN_FILE.fullmatch(p.name) or not _plain(p))
            if not names:
                continue
            foreign = "/" + names[0]
        raise UserError(
            f"{out}: {split}{foreign} was not written by prepare-data and there is no {MANIFEST}, so the "
            f"folder is not overwritten: set prepare.output to a new or empty folder, or move {folder} away"
        )
    for split in SPLITS:
        if (out / split).is_dir():
            for path in (out / split).iterdir():
                path.unlink()
            (out / split).rmdir()


def _plain(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def input_fingerprint(prep: PrepareConfig) -> dict[str, Any] | None:
    """Count, bytes and a digest of the input files' names and sizes (None: the inputs cannot be listed,
    e.g. deleted after preparing; the shards are then taken as they are; or generated, source synthetic)."""
    if prep.source == "synthetic":
        return None
    try:
        files = sorted(list_files(prep), key=lambda f: f[1])
    except UserError:
        return None
    digest, total = hashlib.sha1(), 0
    for path, name in files:
        size = path.stat().st_size
        total += size
        digest.update(f"{name}\t{size}\n".encode())
    return {"files": len(files), "bytes": total, "sha1": digest.hexdigest()}


def inputs_change(before: dict[str, Any] | None, now: dict[str, Any] | None) -> str | None:
    """What changed between two :func:`input_fingerprint` s, in words; None if nothing (or unknown)."""
    if not before or not now or before.get("sha1") == now["sha1"]:
        return None
    if before.get("files") != now["files"] or before.get("bytes") != now["bytes"]:
        files = f"{before.get('files', 0):,} -> {now['files']:,} files"
        return f"{files}, {before.get('bytes', 0):,} -> {now['bytes']:,} bytes"
    return f"{now['files']:,} files, same total size, different names or sizes"


def _val_cap(prep: PrepareConfig, sample_tokens: int) -> int | None:
    if prep.max_tokens is None:
        return None
    share = prep.val_fraction / (1.0 - prep.val_fraction)
    return max(sample_tokens, math.ceil(prep.max_tokens * share))


class LineProgress:
    """Progress for a log or CI (stderr not a terminal): one line per tenth of the work or per
    ``interval_s``, whichever comes first, never a carriage return (tqdm's bar glues into one line there)."""

    def __init__(self, total: int | None, desc: str, *, interval_s: float = 30.0, file: Any = None) -> None:
        self.total, self.desc, self.interval_s = total, desc, interval_s
        self.file = file if file is not None else sys.stderr
        self.n = self._shown = 0
        self._start = self._last = time.perf_counter()

    def update(self, n: int) -> None:
        self.n += n
        now = time.perf_counter()
        if (self.total and self.n - self._shown >= self.total / 10) or now - self._last >= self.interval_s:
            self._say(now)

    def _say(self, now: float) -> None:
        rate = self.n / max(now - self._start, 1e-9)
        of = f"/{self.total:,} tokens ({100 * self.n / self.total:.0f}%)" if self.total else " tokens"
        print(f"{self.desc}: {self.n:,}{of}, {rate:,.0f} tok/s", file=self.file, flush=True)
        self._shown, self._last = self.n, now

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None and self.n != self._shown:
            self._say(time.perf_counter())


def _progress(total: int | None, desc: str, enabled: bool) -> Any:
    """tqdm's bar on a terminal, :class:`LineProgress` elsewhere, nothing when disabled (``--quiet``)."""
    if enabled and not sys.stderr.isatty():
        return LineProgress(total, desc)
    return tqdm(
        total=total, unit="tok", unit_scale=True, desc=desc, disable=not enabled, file=sys.stderr, smoothing=0.1
    )


def prepare_data(cfg: DataConfig, *, progress: bool = True, say: Callable[[str], None] = lambda _: None) -> Manifest:
    """Build the shards and manifest described by ``cfg.prepare``; returns the (new or existing) manifest.
    ``say`` receives one line on why nothing was done or why the shards are rebuilt."""
    if cfg.prepare is None:
        raise UserError("data.prepare: the recipe has no prepare section; add one (see data/stdlib-code.yaml)")
    prep = cfg.prepare
    tok = load_tokenizer(cfg.tokenizer)
    out = local_path(prep.output)
    recipe = recipe_of(cfg, tok)
    inputs = input_fingerprint(prep)
    existing = _existing(out, recipe, cfg.verify, inputs, say)
    if existing is not None:
        return existing
    dtype, sample_tokens = token_dtype(tok.vocab_size), cfg.seq_len + 1
    remove_leftovers(out)  # of an interrupted run or a stale build: only prepare-data's own files go
    (out / MANIFEST).unlink(missing_ok=True)  # a rebuild cut short then reads as an interrupted run
    caps = {"train": prep.max_tokens, "val": _val_cap(prep, sample_tokens)}
    packers = [
        _Packer(
            make_sink(
                cfg.format, out / s, sample_tokens=sample_tokens, dtype=dtype, samples_per_shard=prep.samples_per_shard
            ),
            sample_tokens,
            caps[s],
        )
        for s in SPLITS
    ]
    labels = _difficulty_packers(cfg, out, packers) if prep.source == "synthetic" else None
    assign = prep.synthetic.assign if prep.synthetic else ""
    counts: dict[str, int] = {}
    docs = _split_documents(iter_documents(prep, counts, seq_len=cfg.seq_len), prep.val_fraction, packers)
    start = time.perf_counter()
    bar = _progress(prep.max_tokens, f"prepare {out.name}", progress)
    with bar:
        for which, tokens in _tokenised(cfg, tok, docs):
            if not packers[which].full:
                packers[which].add(tokens)
                if labels is not None:  # packed exactly as the tokens: row i labels token row i
                    labels[which].add(token_difficulty(tokens, tok.eos_id, assign))
                kept = len(tokens) if prep.max_tokens is None else min(len(tokens), max(0, prep.max_tokens - bar.n))
                bar.update(kept if which == 0 else 0)  # training tokens kept (the cap cuts the last document)
            if all(p.full for p in packers):
                break
    splits = {name: p.finish() for name, p in zip(SPLITS, packers)}
    for name, label_packer in zip(SPLITS, labels or []):
        splits[name].difficulty = label_packer.finish().shards
    if splits["train"].sequences == 0:
        raise UserError(
            f"prepare: the inputs hold fewer than seq_len+1={sample_tokens} tokens; add text or lower seq_len"
        )
    if prep.val_fraction > 0 and splits["val"].sequences == 0:
        raise UserError(
            f"prepare: the held-out documents hold fewer than {sample_tokens} tokens; raise "
            "prepare.val_fraction or add documents"
        )
    manifest = Manifest(
        format=cfg.format,
        seq_len=cfg.seq_len,
        dtype=dtype.name,
        tokenizer={
            "kind": cfg.tokenizer.kind,
            "fingerprint": tok.fingerprint,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
        },
        splits=splits,
        recipe=recipe,
        stats={
            **counts,
            **({"inputs": inputs} if inputs else {}),
            "dropped_tail_tokens": sum(p.dropped for p in packers),
            "seconds": round(time.perf_counter() - start, 2),
        },
    )
    write_manifest(manifest, out)
    return manifest


def _difficulty_packers(cfg: DataConfig, out: Path, packers: list[_Packer]) -> list[_Packer]:
    """Packers of the per-token difficulty beside ``packers`` (same rows, same caps; data/difficulty.py)."""
    assert cfg.prepare is not None
    n = cfg.seq_len + 1
    return [
        _Packer(DifficultySink(out / s, sample_tokens=n, samples_per_shard=cfg.prepare.samples_per_shard), n, p.cap)
        for s, p in zip(SPLITS, packers)
    ]


def _split_documents(docs: Iterable[Document], fraction: float, packers: list[_Packer]) -> Iterator[tuple[int, str]]:
    """(0 = train | 1 = val, text); documents of a split whose cap is reached are not even tokenised."""
    for name, text in docs:
        split = int(is_val(name, fraction))
        if not packers[split].full:
            yield split, text
        elif all(p.full for p in packers):
            return


def manifest_summary(manifest: Manifest) -> str:
    """One line per split, for the CLI."""
    lines = []
    for name, s in manifest.splits.items():
        size = sum(sh.bytes for sh in s.shards)
        lines.append(
            f"{name}: {s.sequences:,} sequences x {manifest.seq_len + 1} tokens = {s.tokens:,} tokens, "
            f"{s.documents:,} documents, {len(s.shards)} {manifest.format} shards, {size / 1e6:.1f} MB"
        )
    skipped = manifest.stats.get("skipped_not_utf8", 0)
    if skipped:
        lines.append(f"skipped: {skipped:,} input files that are not UTF-8 text")
    return "\n".join(lines)
