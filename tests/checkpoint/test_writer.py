"""The checkpoint writer (checkpoint/writer.py, docs/checkpoints.md "Async save"): a save writes its files in
the trainer or in one persistent writer process, never in a process forked per save or per file; the
files are the bytes megatron's writer writes, checksummed as they are written; an async save's snapshot is
a copy into a staging buffer kept across saves; a writer that dies fails that save (not the run) and the
next save starts another."""

from __future__ import annotations

import dataclasses
import io
import os
import queue
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from elastic_pretrain.checkpoint import parallel_io
from elastic_pretrain.checkpoint.file_write import no_record_checksums, write_buckets
from elastic_pretrain.checkpoint.manager import Checkpointer
from elastic_pretrain.checkpoint.snapshot import compact
from elastic_pretrain.checkpoint.store import CheckpointStore, crc32_file, verify
from elastic_pretrain.checkpoint.tensors import ModelTensors, save_tensors
from elastic_pretrain.checkpoint.writer import Staging
from elastic_pretrain.checkpoint.writer_main import staged_tensor
from elastic_pretrain.job import public_dict
from elastic_pretrain.rundir import RunFiles
from tests.checkpoint.runs import differing
from tests.checkpoint.test_async_snapshot import restore_step, snapshot, train_a_little


def _no_fork(*args: Any, **kwargs: Any) -> int:
    raise AssertionError("a save forked the trainer")


def test_saves_fork_nothing_and_one_writer_process_writes_every_async_save(parts, monkeypatch) -> None:
    """megatron forks a writer per async save and one more process per file in every save; here neither. The
    writer has the stop signals blocked (a signal forwarded to the job step must not end it mid-save)."""
    job, mesh, run_dir, net, optimizer = parts
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, ModelTensors(net, optimizer), {})
    monkeypatch.setattr(os, "fork", _no_fork)  # the writer is spawned (fork + exec in C), the rest in-process
    pids = []
    for step in (1, 2, 3):
        ckpt.save(step)
        pids.append(ckpt.queue.writer.process.pid)
        train_a_little(net, optimizer, by=1.0)
    ckpt.save(4, blocking=True)
    writer = ckpt.queue.writer
    blocked = int(Path(f"/proc/{pids[0]}/status").read_text().split("SigBlk:")[1].split()[0], 16)
    assert all(blocked >> (sig - 1) & 1 for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)), hex(blocked)
    ckpt.close()
    assert len(set(pids)) == 1 and writer.process is None  # one writer for all saves, ended by close()
    assert writer.staging.allocated == 1  # one buffer, reused by every save of this structure
    committed = CheckpointStore(RunFiles(run_dir).checkpoints).committed()
    assert [c.step for c in committed] == [1, 2, 3, 4]
    for c in committed:
        verify(c.path)


def test_inline_staging_copies_before_the_save_returns(parts) -> None:
    """The hand-off of device tensors (a GPU's, whose copy is the device-to-host copy) and of
    ``background=False``: the copy is done when the save returns — no thread, no optimizer hook — so a
    change made right after it, without waiting, never reaches the checkpoint."""
    job, mesh, run_dir, net, optimizer = parts
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, ModelTensors(net, optimizer), {})
    assert ckpt.queue is not None and ckpt.queue.writer is not None
    ckpt.queue.writer.background = False
    want = snapshot(net, optimizer)
    ckpt.save(1)
    assert ckpt.queue.writer.copying is None and ckpt.queue.writer.guard is None
    train_a_little(net, optimizer, by=2.0)
    ckpt.close()
    restore_step(ckpt, run_dir, 1)
    assert not differing(snapshot(net, optimizer), want)


def test_the_fork_writer_still_snapshots(parts) -> None:
    """``checkpoint.async_writer=fork``: megatron's writer forked per save; the checkpoint holds the values
    from before training changed them."""

    job, mesh, run_dir, net, optimizer = parts
    job = dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, async_writer="fork"))
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, ModelTensors(net, optimizer), {})
    assert ckpt.queue.writer is None
    want = snapshot(net, optimizer)
    ckpt.save(1)
    train_a_little(net, optimizer, by=2.0)
    ckpt.close()
    restore_step(ckpt, run_dir, 1)
    assert not differing(snapshot(net, optimizer), want)


def test_a_dead_writer_fails_its_save_and_the_next_save_starts_another(parts) -> None:
    job, mesh, run_dir, net, optimizer = parts
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, ModelTensors(net, optimizer), {})
    ckpt.save(1)  # the writer was just spawned: still starting up when it is killed
    os.kill(ckpt.queue.writer.process.pid, signal.SIGKILL)
    with pytest.raises(CheckpointException, match=r"writer process died \(exit code -9\)"):
        ckpt.wait()  # raised on every rank by megatron's finalize (a BaseException, as a failed write's)
    ckpt.save(2)
    ckpt.close()
    committed = CheckpointStore(RunFiles(run_dir).checkpoints).committed()
    assert [c.step for c in committed] == [2]  # step 1 never committed; step 2 by a new writer
    verify(committed[0].path)


def test_a_failed_staging_copy_fails_its_save_and_the_next_save_commits(parts, monkeypatch) -> None:
    """The staging copy runs on a thread: an error there fails that save on every rank (as a failed write),
    and the writer, which never got the request, writes the next one."""
    job, mesh, run_dir, net, optimizer = parts
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, ModelTensors(net, optimizer), {})
    copy = Staging.copy

    def broken(self: Staging, live: list[torch.Tensor]) -> None:
        raise MemoryError("no room in /dev/shm")

    monkeypatch.setattr(Staging, "copy", broken)
    ckpt.save(1)
    with pytest.raises(CheckpointException, match="staging copy failed: MemoryError: no room in /dev/shm"):
        ckpt.wait()
    monkeypatch.setattr(Staging, "copy", copy)
    ckpt.save(2)
    ckpt.close()
    committed = CheckpointStore(RunFiles(run_dir).checkpoints).committed()
    assert [c.step for c in committed] == [2]
    verify(committed[0].path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_view_is_written_as_just_its_elements_without_a_copy(dtype: torch.dtype) -> None:
    """A sync save (and a forked writer) hands torch.save each view as a tensor over the same memory whose
    storage is just the view's elements: the bytes torch.save writes for a clone, and no copy."""
    from elastic_pretrain.checkpoint.snapshot import elements_only, is_view

    base = torch.arange(1000).to(dtype)
    view = base[100:400].view(20, 15)
    got = elements_only(view)
    assert is_view(view) and not is_view(got) and got.data_ptr() == view.data_ptr() and torch.equal(got, view)
    ours, clone = io.BytesIO(), io.BytesIO()
    torch.save(got, ours)
    torch.save(view.clone(), clone)
    assert ours.getvalue() == clone.getvalue()
    strided = base[:600].view(20, 30)[:, ::2]  # not contiguous: copied
    assert elements_only(strided).data_ptr() != strided.data_ptr() and torch.equal(elements_only(strided), strided)
    assert elements_only(base) is base  # owns its storage: as it is


def test_the_stream_checksums_and_sizes_what_it_writes_whatever_the_write_sizes(tmp_path: Path) -> None:
    """Small writes gathered, large ones checksummed on the helper thread while written, writeback started
    every 8 MiB: the file's CRC32 and size are the stream's."""
    import random
    import zlib

    from elastic_pretrain.checkpoint.file_write import PARALLEL_CRC, WRITEBACK, CrcStream

    rng = random.Random(0)
    sizes = [rng.choice([1, 7, 100, 4096, PARALLEL_CRC - 1, PARALLEL_CRC, 3 * PARALLEL_CRC + 5]) for _ in range(60)]
    sizes += [WRITEBACK + 1, 0, 3]
    path = tmp_path / "f"
    with open(path, "wb") as raw:
        stream = CrcStream(raw)
        for n in sizes:
            assert stream.write(memoryview(rng.randbytes(n))) == n
            assert stream.tell() == raw.tell() + len(stream.gathered)
        stream.close()
    data = path.read_bytes()
    assert stream.size == len(data) == sum(sizes) and stream.crc == zlib.crc32(data) == crc32_file(path)


def test_torch_save_record_checksums_are_off_only_inside_the_write() -> None:
    before = torch.serialization.get_crc32_options()
    with pytest.raises(RuntimeError, match="boom"), no_record_checksums():
        assert torch.serialization.get_crc32_options() is False
        raise RuntimeError("boom")
    assert torch.serialization.get_crc32_options() == before


def test_staging_copies_the_elements_into_one_buffer_per_structure_and_the_writer_saves_just_those() -> None:
    flat = torch.arange(40, dtype=torch.float32)
    a, b = flat[:10].view(2, 5), flat[20:26].to(torch.bfloat16)  # a view of a larger buffer, another dtype
    items = [("item a", a), ("item b", b), ("empty", flat[:0])]
    buckets = [("f0", "k", ([("bytes item", io.BytesIO(b"x"))], items))]
    staging = Staging()
    staged, fresh = staging.stage(buckets)
    assert fresh is not None and fresh.is_shared() and staging.allocated == 1
    slots = [slot for _, slot in staged[0][2][1]]
    assert staged[0][2][0] is buckets[0][2][0]
    assert [item for item, _ in staged[0][2][1]] == ["item a", "item b", "empty"]
    view = memoryview(fresh.numpy())  # what the writer process does with the buffer it receives
    for slot, (_, want) in zip(slots, items):
        got = staged_tensor(view, slot)
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert got.untyped_storage().nbytes() == want.numel() * want.element_size()  # torch.save writes no more
        saved, expected = io.BytesIO(), io.BytesIO()
        torch.save(got, saved)
        torch.save(want.clone(), expected)
        assert saved.getvalue() == expected.getvalue()
    writer_a = staged_tensor(view, slots[0])
    flat.add_(1)
    assert not torch.equal(writer_a, a)  # a copy, not the live tensor: training changes it, the snapshot stays
    _, none = staging.stage(buckets)
    assert none is None and staging.allocated == 1 and torch.equal(writer_a, a)  # the same buffer, refreshed
    staging.stage([("f0", "k", ([], [("item a", a), ("item b", flat[:7])]))])
    assert staging.allocated == 2  # another shape: another buffer


def test_the_files_are_megatrons_bytes_and_checksummed_as_written(parts, tmp_path: Path) -> None:
    """The same buckets written by megatron's per-file writer and by ours: the same bytes (with torch.save's
    per-record CRC32 off in both, as ours writes) and write results; the record is the file's size and
    CRC32 without reading it back; checkpoints written so load (async and sync: the same tensors)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from elastic_pretrain.checkpoint.store import take_writer_records

    _, _, _, net, optimizer = parts
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    request, _ = save_tensors(net, optimizer, ours, parallel_io.trainer_saves(), use_async=True)
    _, transform_list, _ = request.async_fn.args
    buckets = compact(request.async_fn_args[1])
    results: Any = queue.Queue()
    write_buckets(transform_list, 0, buckets, results)
    mine = results.get_nowait()
    assert isinstance(mine, dict) and len(mine) == len(buckets), mine
    for i, (path, key, data) in enumerate(buckets):
        local: Any = queue.Queue()
        count: Any = queue.Queue()
        count.put(i)
        with no_record_checksums():  # ours leaves the zip records' CRC32 out (the file's CRC32 covers them)
            FileSystemWriterAsync.write_preloaded_data(
                transform_list, i, (str(theirs / Path(path).name), key, data), local, count, True
            )  # fmt: skip
        _, their_results = local.get_nowait()
        assert their_results == mine[i]
        assert (theirs / Path(path).name).read_bytes() == Path(path).read_bytes()
    records = take_writer_records(ours, 0)
    assert records and records == {Path(p).name: [Path(p).stat().st_size, crc32_file(Path(p))] for p, _, _ in buckets}
