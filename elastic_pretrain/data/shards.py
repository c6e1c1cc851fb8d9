"""Shard files of packed token sequences: writers (prepare-data) and per-split readers (training).

MDS goes through mosaicml-streaming's own writer and shard reader, checked against ``index.json``; WebDataset
is read member by member with our own ``.npy`` header check (webdataset's default decoders would unpickle).
Not ``StreamingDataset``: its order, partitioning and resume state are its own, while ours is a pure function
of the global sample position (``order.py``), which exact resume at another DP size needs. Remote shards come
through streaming's ``CloudDownloader`` under an ``fcntl`` lock in the stream's cache directory.
docs/data.md, "Reading: `TokenBatches`" and "Remote streams and the local cache"; docs/security.md, "WebDataset tars".
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import re
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from elastic_pretrain.data.config import DataConfig, StreamConfig, is_data_name, is_remote, local_path
from elastic_pretrain.data.manifest import (
    MANIFEST,
    Manifest,
    ShardInfo,
    SplitInfo,
    check_compatible,
    read_manifest,
    sha256_file,
)
from elastic_pretrain.data.streaming_compat import cloud_downloader, import_streaming_lean
from elastic_pretrain.data.tokenizer import Tokenizer
from elastic_pretrain.data.verified import verify_shard_once
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import inside
from elastic_pretrain.jsonsafe import loads as json_loads

log = logging.getLogger(__name__)
WDS_PATTERN = "shard-%06d.tar"
WDS_MEMBER = re.compile(r"(\d{10})\.tokens\.npy")  # the only tar member WDSSink writes: <row key>.tokens.npy
MDS_INDEX = "index.json"
WDS_MEMBER_TOKENS = 1 << 16  # tokens per tar member (see WDSSink)


# ----------------------------------------------------------------------------------------- writers
class MDSSink:
    """Fixed-size token rows into MDS shards of exactly ``samples_per_shard`` rows (the last may be short)."""

    def __init__(self, directory: Path, *, sample_tokens: int, dtype: np.dtype[Any], samples_per_shard: int) -> None:
        import_streaming_lean()  # not import_streaming: its transformers import costs ~6 s per rank
        from streaming.base.format.mds.writer import MDSWriter

        self.directory = directory
        # a fixed shape makes the column fixed-size: no per-sample length header, pure offsets
        self._writer = MDSWriter(
            out=str(directory),
            columns={"tokens": f"ndarray:{dtype.name}:{sample_tokens}"},
            compression=None,
            size_limit=1 << 30,
            progress_bar=False,
            exist_ok=False,
        )
        # MDSWriter cuts shards by bytes; set the limit so a shard holds exactly samples_per_shard rows
        row = sample_tokens * dtype.itemsize + self._writer.extra_bytes_per_sample
        self._writer.size_limit = self._writer.extra_bytes_per_shard + samples_per_shard * row

    def write(self, rows: np.ndarray) -> None:
        for row in rows:
            self._writer.write({"tokens": row})

    def finish(self) -> list[ShardInfo]:
        self._writer.finish()
        self.index_sha256 = sha256_file(self.directory / MDS_INDEX)  # the manifest covers index.json too
        index = json.loads((self.directory / MDS_INDEX).read_text())
        return [
            ShardInfo(
                name=s["raw_data"]["basename"],
                samples=s["samples"],
                bytes=s["raw_data"]["bytes"],
                sha256=sha256_file(self.directory / s["raw_data"]["basename"]),
            )
            for s in index["shards"]
        ]


class WDSSink:
    """Token rows in WebDataset tar shards of exactly ``samples_per_shard`` rows (the last may be short).

    A tar member costs ~1 KB of headers and ~0.4 ms of ``tarfile`` CPU, so one member per 129-token row
    would make shards 8x larger than the tokens and writing 30x slower than MDS. Each member
    ``<key>.tokens.npy`` therefore holds a block of consecutive rows (~64 K tokens); ``key`` is the
    split index of its first row. Readers still see rows: the manifest counts rows, not members.
    """

    def __init__(self, directory: Path, *, sample_tokens: int, dtype: np.dtype[Any], samples_per_shard: int) -> None:
        directory.mkdir(parents=True, exist_ok=False)
        self.directory, self._sps = directory, samples_per_shard
        self._rows_per_member = max(1, WDS_MEMBER_TOKENS // sample_tokens)
        self._pending: list[np.ndarray] = []
        self._count = 0  # rows written
        self._shards: list[ShardInfo] = []
        self._tar: Any = None

    def write(self, rows: np.ndarray) -> None:
        self._pending.append(rows)
        buffered = sum(len(r) for r in self._pending)
        if buffered >= self._rows_per_member:
            self._drain(final=False)

    def _drain(self, *, final: bool) -> None:
        import webdataset as wds

        rows = np.concatenate(self._pending) if self._pending else np.empty((0, 0))
        start = 0
        while len(rows) - start >= self._rows_per_member or (final and start < len(rows)):
            if self._tar is None:
                self._tar = wds.TarWriter(str(self.directory / (WDS_PATTERN % len(self._shards))))
            room = self._sps - self._count % self._sps  # a member never straddles two shards
            n = min(self._rows_per_member, room, len(rows) - start)
            self._tar.write({"__key__": f"{self._count:010d}", "tokens.npy": rows[start : start + n]})
            self._count, start = self._count + n, start + n
            if self._count % self._sps == 0:
                self._close_shard()
        self._pending = [rows[start:]] if start < len(rows) else []

    def _close_shard(self) -> None:
        self._tar.close()
        self._tar = None
        path = self.directory / (WDS_PATTERN % len(self._shards))
        samples = self._count - sum(s.samples for s in self._shards)
        self._shards.append(
            ShardInfo(name=path.name, samples=samples, bytes=path.stat().st_size, sha256=sha256_file(path))
        )

    def finish(self) -> list[ShardInfo]:
        self._drain(final=True)
        if self._tar is not None:
            self._close_shard()
        return self._shards


def make_sink(fmt: str, directory: Path, **kw: Any) -> MDSSink | WDSSink:
    return MDSSink(directory, **kw) if fmt == "mds" else WDSSink(directory, **kw)


# ---------------------------------------------------------------------------------------- fetching
@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch(remote: str, local: Path, *, timeout: float = 120.0) -> Path:
    """Download ``remote`` to ``local`` once (streaming's downloader; tmp + rename inside, lock outside)."""
    if local.is_file():
        return local
    downloader = cloud_downloader()
    with _file_lock(local):
        if not local.is_file():
            try:
                downloader.direct_download(remote, str(local), timeout)
            except Exception as err:  # boto/gcs/hf raise many types; the message is what matters
                raise UserError(
                    f"cannot fetch {remote} ({type(err).__name__}: {err}); check the URI, "
                    "credentials and network, or prepare the data locally"
                ) from None
    return local


CACHE_MARKER = ".elastic-pretrain-cache"  # written in a cache root that elastic-pretrain created


class StreamFiles:
    """Where a stream's files live locally: the directory itself, or a cache filled from a remote.

    With ``local`` set, ``path`` is a source to copy from even when it is a plain directory or
    ``file://`` URI (a slow shared filesystem cached on local disk; also how the tests exercise the
    remote code path without network). Without ``local``, a local ``path`` is read in place.

    A cache root that does not exist yet (or is an empty directory) is claimed with the file
    :data:`CACHE_MARKER`; a damaged cached copy is deleted for a refetch only under such a root, so a
    ``local:`` naming ``~`` or a folder of the user's own never loses a file (issue 35, item 3).
    """

    def __init__(self, stream: StreamConfig) -> None:
        self.remote: str | None = None
        if stream.local:
            # streaming's LocalDownloader handles scheme-less paths; it has no "file" scheme
            self.remote = stream.path if is_remote(stream.path) else str(local_path(stream.path))
        self.root = local_path(stream.local) if stream.local else local_path(stream.path)
        self.where = stream.path

    def local(self, split: str, name: str) -> Path:
        """``<root>/<split>/<name>``, refused unless both are plain names and the path stays in ``root``.

        The names come from the manifest, which may be someone else's (docs/security.md); read_manifest
        already refuses other names: this is the last line before a delete or a download."""
        path = self.root / split / name
        if not (is_data_name(split) and is_data_name(name)) or not inside(path, self.root):
            raise UserError(
                f"{self.where}: the manifest names {split}/{name}, which is not a file inside {self.root}; "
                "the manifest is damaged or hostile: delete the cache and prepare the data again"
            )
        return path

    def claim_cache(self) -> None:
        """Create the cache root with its marker, or mark an existing empty directory (the ranks of one
        machine may race here: the marker is created exclusively, and either one's is as good)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with os.scandir(self.root) as entries:
            if os.path.lexists(self.root / CACHE_MARKER) or any(entries):
                return
        with contextlib.suppress(FileExistsError):
            os.close(os.open(self.root / CACHE_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))

    def owns_cache(self) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.root / CACHE_MARKER).st_mode)
        except OSError:
            return False

    def refetch(self, split: str, name: str) -> Path:
        """Drop a cached copy that failed verification and download it again (remote streams only)."""
        local = self.local(split, name)
        if not self.owns_cache():
            raise UserError(
                f"{self.where}: cached {split}/{name} fails verification, and {self.root} has no {CACHE_MARKER} "
                "(elastic-pretrain did not create that folder, so it deletes nothing there); delete the "
                "damaged file yourself or point the stream's local: at a new folder"
            )
        with _file_lock(local):
            local.unlink(missing_ok=True)
        return self.file(split, name)

    def manifest(self) -> Manifest:
        if self.remote:
            self.claim_cache()
            fetch(f"{self.remote.rstrip('/')}/{MANIFEST}", self.root / MANIFEST)
        return read_manifest(self.root)

    def file(self, split: str, name: str) -> Path:
        local = self.local(split, name)
        if self.remote and not local.is_file():
            fetch(f"{self.remote.rstrip('/')}/{split}/{name}", local)
        return local


# ----------------------------------------------------------------------------------------- readers
class SplitReader:
    """Random access to the packed sequences of one split of one stream, checking every shard once.

    Shards are verified against the manifest (size, and sha256 unless ``verify: size``) on first use.
    With ``on_bad_shard: skip`` every shard is verified up front instead, because which shards exist
    decides the sample count and so the order, which every rank must agree on.
    """

    def __init__(self, cfg: DataConfig, stream: StreamConfig, tokenizer: Tokenizer) -> None:
        self.cfg, self.files = cfg, StreamFiles(stream)
        self.where = f"{stream.path} [{stream.split}]"
        self.manifest = self.files.manifest()
        check_compatible(self.manifest, seq_len=cfg.seq_len, tokenizer=tokenizer, where=stream.path, fmt=cfg.format)
        self.split_name = stream.split
        split: SplitInfo = self.manifest.split(stream.split, stream.path)
        self.skipped: list[str] = []
        shards = split.shards
        if cfg.on_bad_shard == "skip":
            shards = [s for s in shards if self._check(s, raise_error=False)]
        elif cfg.format == "wds":
            self._check_present_sizes(shards)
        if not shards or sum(s.samples for s in shards) == 0:
            raise UserError(f"{self.where}: no readable sequences; re-run prepare-data or drop the stream")
        self.shards = shards
        self.offsets = np.asarray(SplitInfo(sequences=0, tokens=0, documents=0, shards=shards).shard_offsets())
        self._checked: set[str] = {s.name for s in shards} if cfg.on_bad_shard == "skip" else set()
        self._mds: dict[str, Any] = {}
        self._wds: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.shard_offsets = self.offsets  # public alias for the order (wds shuffles within shard windows)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _check_present_sizes(self, shards: list[ShardInfo]) -> None:
        """Compare the size of every shard file already on disk with the manifest (a stat each, no read).

        A WebDataset stream's order holds one int64 per row of an epoch (order.py), sized by the
        manifest's sample counts, which check_shape bounds by the shards' claimed bytes: this makes
        those claims the files' real sizes before any table is built (a lying manifest asked for
        14.9 GiB, issue 35 item 7). Shards of a remote stream not fetched yet are checked on fetch."""
        for info in shards:
            path = self.files.local(self.split_name, info.name)
            with contextlib.suppress(OSError):
                size = path.stat().st_size
                if size != info.bytes:
                    self._check(info)  # the one-line error of a damaged shard (or a refetch of a cached one)

    def _check(self, info: ShardInfo, *, raise_error: bool = True) -> bool:
        try:
            path = self.files.file(self.split_name, info.name)
            problem = verify_shard_once(path, info, self.cfg.verify)  # hashed once per machine (data/verified.py)
            if problem is not None and self.files.remote:  # a damaged cache copy: fetch it once more
                problem = verify_shard_once(self.files.refetch(self.split_name, info.name), info, self.cfg.verify)
        except UserError as err:
            if raise_error:
                raise
            problem = str(err)
        if problem is None:
            return True
        msg = f"{self.where}: shard {info.name} {problem}"
        if raise_error:
            raise UserError(f"{msg}; delete it and re-run prepare-data (or re-download), or set data.on_bad_shard=skip")
        self.skipped.append(info.name)
        log.warning("%s; skipping it (%d skipped in this split)", msg, len(self.skipped))
        return False

    def _shard(self, k: int) -> Path:
        info = self.shards[k]
        if info.name not in self._checked:
            self._check(info)
            self._checked.add(info.name)
        return self.files.file(self.split_name, info.name)

    def get(self, index: int) -> np.ndarray:
        """The sequence at split-local ``index`` (uint16/uint32, seq_len+1 tokens)."""
        k = int(np.searchsorted(self.offsets, index, side="right")) - 1
        local = index - int(self.offsets[k])
        mds = self.cfg.format == "mds"
        row = self._mds_row(k, local) if mds else self._wds_rows(k)[local]
        if row.shape != (self.cfg.seq_len + 1,):
            raise UserError(
                f"{self.where}: shard {self.shards[k].name} holds rows of {row.shape}, expected "
                f"({self.cfg.seq_len + 1},); re-run prepare-data"
            )
        return row

    def _mds_row(self, k: int, local: int) -> np.ndarray:
        try:
            row: np.ndarray = self._mds_reader(k).get_item(local)["tokens"]
        except (ValueError, IndexError, OSError) as err:  # changed under us since check_mds_layout
            raise UserError(
                f"{self.where}: shard {self.shards[k].name} row {local} cannot be read ({type(err).__name__}: "
                f"{err}); delete it and re-run prepare-data (or re-download)"
            ) from None
        return row

    def _mds_reader(self, k: int) -> Any:
        name = self.shards[k].name
        if name not in self._mds:
            path = self._shard(k)
            entry = self._mds_index()[name]  # built from the manifest (checked against index.json's)
            check_mds_layout(path, self.shards[k], self.manifest, self.where)
            import_streaming_lean()
            from streaming.base.format import reader_from_json

            self._mds[name] = reader_from_json(str(path.parent), "", entry)
        return self._mds[name]

    def _mds_index(self) -> dict[str, dict[str, Any]]:
        """Shard name -> its index.json entry, once index.json matched the manifest's hash and entries."""
        if not hasattr(self, "_index"):
            expected = self.manifest.splits[self.split_name].index_sha256
            if expected is None:
                raise UserError(
                    f"{self.where}: manifest.json has no checksum of index.json (written before "
                    "elastic-pretrain hashed it); run `elastic-pretrain prepare-data <recipe>` on that output "
                    "again to add it (it checks the shards and index.json, and re-tokenises nothing)"
                )
            path = self.files.file(self.split_name, MDS_INDEX)
            try:
                data = path.read_bytes()
            except OSError as err:
                raise UserError(f"{self.where}: unreadable index.json ({err}); re-run prepare-data") from None
            if hashlib.sha256(data).hexdigest() != expected:
                raise UserError(
                    f"{self.where}: index.json fails its sha256 checksum (corrupt or replaced); delete it and "
                    "re-run prepare-data (or re-download)"
                )
            self._index = check_mds_index(data, self.manifest, self.shards, self.where)
        return self._index

    def _wds_rows(self, k: int) -> np.ndarray:
        name = self.shards[k].name
        if name in self._wds:
            self._wds.move_to_end(name)
            return self._wds[name]
        info = self.shards[k]
        rows = read_wds_shard(self._shard(k), info.samples, self.where, self.manifest.dtype, self.cfg.seq_len + 1)
        self._wds[name] = rows
        while len(self._wds) > self.cfg.wds_window + 1:  # the window being read, plus one across a boundary
            self._wds.popitem(last=False)
        return rows


def mds_entry(manifest: Manifest, info: ShardInfo) -> dict[str, Any]:
    """The index.json entry MDSSink writes for shard ``info`` (one raw ``ndarray`` column of tokens):
    the only entry a reader accepts, so streaming never decodes a pickled (``pkl``) or other column."""
    n = manifest.seq_len + 1
    return {
        "column_encodings": [f"ndarray:{manifest.dtype}:{n}"],
        "column_names": ["tokens"],
        "column_sizes": [n * np.dtype(manifest.dtype).itemsize],
        "compression": None,
        "format": "mds",
        "hashes": [],
        "raw_data": {"basename": info.name, "bytes": info.bytes, "hashes": {}},
        "samples": info.samples,
        "version": 2,
        "zip_data": None,
    }


def check_mds_index(data: bytes, manifest: Manifest, shards: list[ShardInfo], where: str) -> dict[str, dict[str, Any]]:
    """Shard name -> reader entry for ``shards``, after index.json (``data``) matched :func:`mds_entry`
    for each of them; a one-line UserError naming the first difference otherwise."""
    try:
        index = json_loads(data, f"{where}: index.json", fix="re-run prepare-data")
        entries = index["shards"] if isinstance(index, dict) and isinstance(index.get("shards"), list) else None
    except UserError:
        raise
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{where}: unreadable index.json ({err}); re-run prepare-data") from None
    if entries is None:
        raise UserError(f"{where}: malformed index.json (no list of shards); re-run prepare-data")
    by_name = {
        e["raw_data"].get("basename"): e for e in entries if isinstance(e, dict) and isinstance(e.get("raw_data"), dict)
    }
    out = {}
    for info in shards:
        want, got = mds_entry(manifest, info), by_name.get(info.name)
        if got is None:
            raise UserError(f"{where}: index.json has no entry for {info.name}; re-run prepare-data")
        diff = next((key for key in want if got.get(key) != want[key]), None)
        if diff is not None:
            raise UserError(
                f"{where}: index.json declares {info.name} with {diff}={got.get(diff)!r}, prepare-data writes "
                f"{want[diff]!r} (only raw token columns are read, never pickled ones); re-run prepare-data"
            )
        size_limit = got.get("size_limit")
        out[info.name] = {**want, "size_limit": size_limit if isinstance(size_limit, int) else None}
    return out


def check_mds_layout(path: Path, info: ShardInfo, manifest: Manifest, where: str) -> None:
    """The shard's own header agrees with the manifest: ``samples``, then ``samples + 1`` offsets that
    step by exactly one row and end at the end of the file (how MDSWriter lays out a fixed-size column).

    streaming's reader seeks to whatever offsets the header holds; a header (or an index.json) claiming
    more rows than the file holds made it read past the end (issue 35, item 8). Read once per shard:
    4 bytes per row, after the manifest bounded the row count by the file's size."""
    row = (manifest.seq_len + 1) * np.dtype(manifest.dtype).itemsize
    n = info.samples
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(4 * (n + 2)), dtype="<u4")
        size = os.fstat(f.fileno()).st_size
    offsets = head[1:].astype(np.int64)
    problem = None
    if len(head) != n + 2 or int(head[0]) != n:
        problem = f"has a header for {int(head[0]) if len(head) else 0} rows, the manifest says {n}"
    elif not (offsets[0] >= 4 * (n + 2) and int(offsets[-1]) == size and bool(np.all(np.diff(offsets) == row))):
        problem = f"has row offsets that do not step by {row} bytes to the end of its {size} bytes"
    if problem is not None:
        raise UserError(f"{where}: shard {info.name} {problem}; delete it and re-run prepare-data (or re-download)")


def add_index_hashes(manifest: Manifest, out: Path) -> None:
    """Fill in the index.json checksum of each split of a manifest written before it was hashed, once
    index.json matches :func:`mds_entry` for every shard the (already verified) manifest lists."""
    for split, info in manifest.splits.items():
        if info.index_sha256 is None:
            try:
                data = (out / split / MDS_INDEX).read_bytes()
            except OSError as err:
                why = f"unreadable {split}/{MDS_INDEX} ({err})"
                raise UserError(f"{out}: {why}; delete {out} and run prepare-data again") from None
            check_mds_index(data, manifest, info.shards, f"{out} [{split}]")
            info.index_sha256 = hashlib.sha256(data).hexdigest()


NPY_HEADER_MAX = 4096  # np.save pads its header to 64 bytes; ours are 128


def load_token_block(data: bytes, dtype: str | None, row_tokens: int | None = None) -> np.ndarray | str:
    """A 2-D unsigned ``.npy`` array from ``data``, its header checked against the bytes that follow
    before anything is allocated (np.load would size its buffer from the header's shape); a string
    saying what is wrong otherwise. Never unpickles (object arrays are refused by dtype)."""
    buf = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(buf)
        if version not in ((1, 0), (2, 0)):
            return f"is a .npy file of version {version}, np.save writes 1.0"
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, got = read_header(buf)
    except (ValueError, SyntaxError, TypeError, RecursionError) as err:
        return f"is not a .npy array ({type(err).__name__}: {err})"
    ok_dtype = got.kind == "u" and (dtype is None or got == np.dtype(dtype))
    if len(shape) != 2 or fortran or not ok_dtype or (row_tokens is not None and shape[1] != row_tokens):
        return f"holds a {got} array of shape {shape}, not rows of {dtype or 'unsigned'} token ids"
    if shape[0] * shape[1] * got.itemsize != len(data) - buf.tell():
        return f"declares shape {shape} in {len(data) - buf.tell()} bytes of data"
    return np.frombuffer(data, dtype=got, offset=buf.tell()).reshape(shape)


def read_wds_shard(
    path: Path, samples: int, where: str, dtype: str | None = None, row_tokens: int | None = None
) -> np.ndarray:
    """All rows of one tar shard, in key order, as one 2-D array.

    Only what WDSSink writes is read: regular members named ``<10-digit key>.tokens.npy``, each a
    2-D unsigned ``.npy`` array (:func:`load_token_block`). Any other member — a ``.pyd``, ``.pkl`` or
    ``.pth`` that webdataset's default decoders would unpickle, a link, a directory, a sparse member —
    is refused, so no byte of a shard is ever unpickled (docs/security.md). A member's declared size
    must fit the file and the rows the manifest still expects (``row_tokens`` tokens each) before it is
    read: a sparse member expands to its declared size in zeros."""

    def refuse(why: str) -> UserError:
        return UserError(
            f"{where}: shard {path.name} {why}; delete it and re-run prepare-data, or set data.on_bad_shard=skip"
        )

    blocks: list[tuple[str, np.ndarray]] = []
    left = samples  # rows the manifest still expects: with the file's size, bounds each member before it is read
    row_bytes = row_tokens * np.dtype(dtype).itemsize if row_tokens and dtype else None
    try:
        size = path.stat().st_size
        with tarfile.open(path, mode="r:") as tar:
            for member in tar:
                m = WDS_MEMBER.fullmatch(member.name)
                if m is None or not member.isreg() or member.issparse():
                    raise refuse(
                        f"holds member {member.name!r}, which prepare-data never writes (only "
                        "<key>.tokens.npy token arrays are read)"
                    )
                f = tar.extractfile(member)
                assert f is not None  # a regular member
                room = size if row_bytes is None else min(size, NPY_HEADER_MAX + max(left, 0) * row_bytes)
                if member.size > room:  # a sparse member of a 1.5 KB tar declared 2 GiB of zeros
                    raise refuse(
                        f"member {member.name} declares {member.size} bytes, more than the file's {size} bytes "
                        f"or the {left} rows still expected can hold"
                    )
                block = load_token_block(f.read(member.size), dtype, row_tokens)
                if isinstance(block, str):
                    raise refuse(f"member {member.name} {block}")
                left -= len(block)
                blocks.append((m.group(1), block))
    except UserError:
        raise
    except (tarfile.TarError, OSError, ValueError, EOFError) as err:  # bad tar, bad npy header, pickled npy
        raise refuse(f"cannot be read ({type(err).__name__}: {err})") from None
    blocks.sort(key=lambda b: b[0])
    rows = np.concatenate([b for _, b in blocks]) if blocks else np.empty((0, 0))
    if len(rows) != samples:
        raise UserError(
            f"{where}: shard {path.name} holds {len(rows)} samples, the manifest says {samples}; re-run prepare-data"
        )
    return rows
