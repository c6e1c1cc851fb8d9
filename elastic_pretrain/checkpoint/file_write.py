"""The write of a rank's tensor files, shared by a synchronous save, megatron's forked writer and the persistent
writer process (checkpoint/writer.py): each file of the rank's write buckets is written in the calling
process, in megatron's torch_dist format (DCP's ``_write_item``: the same bytes megatron's writer writes),
through a stream that computes the file's CRC32 from the bytes as they are written, then fsynced; the files'
records go beside them for the commit (checkpoint/store.py). A module of its own so that the snapshot
(checkpoint/snapshot.py) and the writer can both use it without importing each other.

Kept over DCP's own ``FileSystemWriter`` (issue #34 item 3): in ``bench/checkpoint_public.py`` DCP's sync
``save`` of the same tensors took a median 1.8–2.5x our sync save's time (docs/checkpoints.md)."""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from elastic_pretrain.files import open_new

WriteBucket = tuple[Any, str, tuple[list[Any], list[Any]]]  # filesystem_async.WriteBucket: one file's writes


PARALLEL_CRC = 256 << 10  # bytes: a write this large is checksummed on a helper thread while it is written
WRITEBACK = 8 << 20  # bytes: written data is handed to the disk in pieces this large, not all at the fsync

_crc_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it: a fork does not inherit threads, pool)


def _crc_thread() -> ThreadPoolExecutor:
    """This process's checksum thread (one; a forked child makes its own)."""
    global _crc_pool
    if _crc_pool is None or _crc_pool[0] != os.getpid():
        _crc_pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="checkpoint-crc"))
    return _crc_pool[1]


def _sync_file_range() -> Any:
    """Linux's ``sync_file_range`` (start writing a file's range to disk without waiting), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_start_writeback = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2


class CrcStream:
    """A file opened for writing that keeps the CRC32 and the size of what was written to it (DCP and
    ``torch.save`` write sequentially: tell, write; no seek).

    ``torch.save`` into a stream calls ``write`` some 30 times per tensor, mostly with a few bytes of zip
    framing: small writes are gathered in memory and checksummed and written together (one call per
    :data:`PARALLEL_CRC` bytes instead of thousands). Two things overlap with the write itself, so that a save
    costs little more than the bytes' copy into the page cache: the checksum of a large write runs on a helper
    thread while this one writes it (both release the GIL; the write returns after both, so the caller's
    buffer is not read after it returns), and every :data:`WRITEBACK` bytes the disk is told to start writing
    them (``sync_file_range``), so the fsync at the end waits for the last piece rather than for the whole
    file. Durability still comes from that fsync; :meth:`close` writes what is gathered."""

    def __init__(self, raw: Any, parallel: bool = True) -> None:
        self.raw, self.crc, self.size = raw, 0, 0
        self.parallel = parallel  # checksum large writes on the helper thread (False: on this one)
        self.gathered = bytearray()
        self.handed = 0  # bytes handed to the disk so far

    def write(self, data: Any) -> int:
        view = memoryview(data)
        n = view.nbytes
        self.size += n
        if n < PARALLEL_CRC:
            self.gathered += view
            if len(self.gathered) >= PARALLEL_CRC:
                self._write_gathered()
            return n
        self._write_gathered()
        if self.parallel:
            crc = _crc_thread().submit(zlib.crc32, view, self.crc)
            try:
                self.raw.write(view)
            finally:
                self.crc = crc.result()
        else:
            self.crc = zlib.crc32(view, self.crc)
            self.raw.write(view)
        if _start_writeback is not None and self.size - self.handed >= WRITEBACK:
            self.raw.flush()
            _start_writeback(self.raw.fileno(), self.handed, self.size - self.handed, SYNC_FILE_RANGE_WRITE)
            self.handed = self.size  # (a failure here is not an error: the fsync still makes the file durable)
        return n

    def _write_gathered(self) -> None:
        if self.gathered:
            self.crc = zlib.crc32(self.gathered, self.crc)
            self.raw.write(self.gathered)
            self.gathered = bytearray()

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        """Nothing: ``torch.save`` flushes after every tensor; :meth:`close` writes what is gathered."""

    def close(self) -> None:
        """Write what is gathered and flush the file (which stays open: the caller fsyncs and closes it)."""
        self._write_gathered()
        self.raw.flush()

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def writable(self) -> bool:
        return True


def _write_item_direct(stream: CrcStream, data: Any, item: Any, storage_key: str) -> WriteResult:
    """DCP's ``_write_item`` without stream transforms (megatron's writer has none): the same bytes and
    ``WriteResult``, written straight into ``stream`` (DCP wraps it in two more Python layers per write)."""
    offset = stream.size
    if item.type == WriteItemType.BYTE_IO:
        stream.write(data.getbuffer())
    else:
        torch.save(data, cast(IO[bytes], stream))  # (it writes, tells, flushes: all torch.save calls)
    length = stream.size - offset
    return WriteResult(index=item.index, size_in_bytes=length,
                       storage_data=dcp_filesystem._StorageInfo(storage_key, offset, length))  # fmt: skip


def _format_kwargs() -> dict[str, Any]:
    """megatron's argument to ``_write_item``: the torch.save format where torch knows several."""
    if "serialization_format" in inspect.signature(dcp_filesystem._write_item).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        return {"serialization_format": SerializationFormat.TORCH_SAVE}
    return {}


@contextlib.contextmanager
def no_record_checksums() -> Iterator[None]:
    """``torch.save`` without the CRC32 of every zip record it writes (``torch.serialization.
    set_crc32_options``), for the duration. That CRC is ~35 ms per 113 MiB on one core here; ``torch.load``
    never checks it (torch's own note on the option); the file's CRC32, which :class:`CrcStream` computes
    beside the write and the commit records, covers the same bytes and is checked before every resume."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def write_bucket(transform_list: list[Any], bucket: WriteBucket, parallel: bool = True) -> tuple[list[Any], list[int]]:
    """Write one file of a write plan (fsynced); (its DCP ``WriteResult``s, [size, crc32] of the file).
    ``parallel``: checksum large writes on a helper thread (a sync save, which training waits for); a
    background writer checksums on its own thread and leaves the other core to training."""
    file_name, storage_key, (bytes_data, tensor_data) = bucket
    kwargs = _format_kwargs()
    _write_item: Any = dcp_filesystem._write_item  # megatron's call: (transforms, stream, data, item, key)
    # stream transforms (none in megatron's writer) go through DCP's own _write_item
    direct = all(not getattr(t, "extensions", ()) for t in transform_list)
    with open_new(Path(file_name)) as raw, no_record_checksums():  # no link followed (files.py)
        stream = CrcStream(raw, parallel)
        results = []
        for item, data in [*bytes_data, *tensor_data]:
            if isinstance(data, torch.Tensor) and data.device.type != "cpu":
                raise RuntimeError(f"{file_name}: a {data.device} tensor reached the writer (stage it first)")
            if direct:
                results.append(_write_item_direct(stream, data, item, storage_key))
            else:
                results.append(_write_item(*transform_list, stream, data, item, storage_key, **kwargs))
        stream.close()
        os.fsync(raw.fileno())
        if stream.size != raw.tell():  # something seeked: the running checksum is not the file's
            raise RuntimeError(f"{file_name}: written out of order; cannot checksum it while writing")
    return results, [stream.size, stream.crc]


def write_buckets(
    transform_list: list[Any], rank: int, buckets: list[WriteBucket], results_queue: Any, parallel: bool = True
) -> None:
    """Write every file of ``buckets`` in this process, then report as megatron's writer does: ``{bucket
    index: WriteResults}`` (or the exception) into ``results_queue``, read by megatron's finalize. The
    files' records (size, CRC32) go beside them for the commit (checkpoint/store.py)."""
    from elastic_pretrain.checkpoint.store import write_records

    out: dict[int, list[Any]] | Exception
    try:
        results, records = {}, {}
        for i, bucket in enumerate(buckets):
            results[i], records[Path(bucket[0]).name] = write_bucket(transform_list, bucket, parallel)
        if buckets:
            write_records(Path(buckets[0][0]).parent, rank, records)
        out = results
    except Exception as err:  # megatron's contract: the exception goes to the queue, finalize raises it
        out = err
    results_queue.put(out)
