"""The write of a rank's tensor files, shared by a synchronous save, megatron's forked writer and the persistent
writer process (checkpoint/writer.py): each file of the rank's write buckets is written in the calling
process, in megatron's torch_dist format (DCP's ``_write_item``: the same bytes megatron's writer writes),
through a stream that computes the file's CRC32 from the bytes as they are written, then fsynced; the files'
records go beside them for the commit (checkpoint/store.py). A module of its own so that the snapshot
(checkpoint/snapshot.py) and the writer can both use it without importing each other."""

from __future__ import annotations

import inspect
import os
import zlib
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import filesystem as dcp_filesystem

WriteBucket = tuple[Any, str, tuple[list[Any], list[Any]]]  # filesystem_async.WriteBucket: one file's writes


class CrcStream:
    """A file opened for writing that keeps the CRC32 and the size of what was written to it (DCP and
    ``torch.save`` write sequentially: tell, write; no seek)."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.crc, self.size = raw, 0, 0

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        n = self.raw.write(data)
        self.size += n
        return int(n)

    def tell(self) -> int:
        return int(self.raw.tell())

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def writable(self) -> bool:
        return True


def _format_kwargs() -> dict[str, Any]:
    """megatron's argument to ``_write_item``: the torch.save format where torch knows several."""
    if "serialization_format" in inspect.signature(dcp_filesystem._write_item).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        return {"serialization_format": SerializationFormat.TORCH_SAVE}
    return {}


def write_bucket(transform_list: list[Any], bucket: WriteBucket) -> tuple[list[Any], list[int]]:
    """Write one file of a write plan (fsynced); (its DCP ``WriteResult``s, [size, crc32] of the file)."""
    file_name, storage_key, (bytes_data, tensor_data) = bucket
    kwargs = _format_kwargs()
    _write_item: Any = dcp_filesystem._write_item  # megatron's call: (transforms, stream, data, item, key)
    with open(file_name, "wb") as raw:
        stream = CrcStream(raw)
        results = [_write_item(*transform_list, stream, data, item, storage_key, **kwargs) for item, data in bytes_data]
        for item, tensor in tensor_data:
            if tensor.device.type != "cpu":
                raise RuntimeError(f"{file_name}: a {tensor.device} tensor reached the writer (stage it first)")
            results.append(_write_item(*transform_list, stream, tensor, item, storage_key, **kwargs))
        raw.flush()
        os.fsync(raw.fileno())
        if stream.size != raw.tell():  # something seeked: the running checksum is not the file's
            raise RuntimeError(f"{file_name}: written out of order; cannot checksum it while writing")
    return results, [stream.size, stream.crc]


def write_buckets(transform_list: list[Any], rank: int, buckets: list[WriteBucket], results_queue: Any) -> None:
    """Write every file of ``buckets`` in this process, then report as megatron's writer does: ``{bucket
    index: WriteResults}`` (or the exception) into ``results_queue``, read by megatron's finalize. The
    files' records (size, CRC32) go beside them for the commit (checkpoint/store.py)."""
    from elastic_pretrain.checkpoint.store import write_records

    out: dict[int, list[Any]] | Exception
    try:
        results, records = {}, {}
        for i, bucket in enumerate(buckets):
            results[i], records[Path(bucket[0]).name] = write_bucket(transform_list, bucket)
        if buckets:
            write_records(Path(buckets[0][0]).parent, rank, records)
        out = results
    except Exception as err:  # megatron's contract: the exception goes to the queue, finalize raises it
        out = err
    results_queue.put(out)
