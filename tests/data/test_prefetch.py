"""PrefetchedBatches (issue 31, item 3): batches read ahead in a thread are the batches read in place, the
saved state is what was consumed (exact resume), a reader's error surfaces on the training thread as
itself, pinning happens only with CUDA, and the reader thread ends."""

from __future__ import annotations

import gc
import json
import shutil
import threading
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from elastic_pretrain.config import build
from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.loader import TokenBatches
from elastic_pretrain.data.prefetch import PrefetchedBatches
from elastic_pretrain.errors import UserError

THREAD = "prefetch-batches"


class Counted(TokenBatches):
    """A real loader that counts its finished step reads, so a test can wait until the reads ahead are done,
    and records the thread of each read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads = threading.Semaphore(0)
        self.threads: list[str] = []

    def next_step(self) -> list[torch.Tensor]:
        self.threads.append(threading.current_thread().name)
        out = super().next_step()
        self.reads.release()
        return out

    def settle(self, n: int) -> None:
        """Wait until ``n`` step reads have finished (the reads ahead included)."""
        for _ in range(n):
            assert self.reads.acquire(timeout=60), "a read ahead never finished"


def make(cfg: DataConfig, *, dp_rank: int = 0, dp_size: int = 1) -> Counted:
    return Counted(cfg, micro_batch_size=2, num_micro_batches=2, dp_rank=dp_rank, dp_size=dp_size, seed=7)


def steps(loader: TokenBatches | PrefetchedBatches, n: int) -> list[list[torch.Tensor]]:
    return [loader.next_step() for _ in range(n)]


def assert_same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            torch.testing.assert_close(u, v, rtol=0, atol=0)


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


@pytest.mark.parametrize("fmt", ["mds", "wds"])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_batches_read_ahead_are_the_batches_read_in_place(request: pytest.FixtureRequest, fmt: str, depth: int) -> None:
    cfg = request.getfixturevalue(f"prepared_{fmt}")
    plain, fetched = make(cfg), PrefetchedBatches(make(cfg), depth=depth)
    for _ in range(8):
        assert_same(steps(fetched, 1), steps(plain, 1))
        assert fetched.state_dict() == plain.state_dict()
    fetched.close()


def test_slots_read_ahead_and_a_changed_deal_reads_again(prepared_mds: DataConfig) -> None:
    """Compute-balanced steps read the next step's dealt slots ahead; when the next call asks for other
    slots (the phase switch deals anew), the read ahead is dropped and the right slots come."""
    plain = make(prepared_mds, dp_size=2)
    fetched = PrefetchedBatches(make(prepared_mds, dp_size=2), depth=1)
    deals = [[0, 1, 2], [3], [1, 2], [0, 3], [2]]
    aheads = [[3], [0, 3], [1, 2], [2], None]  # step 2 asks for [1, 2] but [0, 3] was read ahead
    for slots, ahead in zip(deals, aheads):
        want = plain.next_step_slots(slots)
        assert_same([fetched.next_step_slots(slots, ahead=ahead)], [want])
        assert fetched.state_dict() == plain.state_dict()
    fetched.close()


def test_state_is_what_was_consumed_and_resumes_exactly(prepared_mds: DataConfig) -> None:
    """After k consumed steps the state equals the plain loader's although the reader is 2 steps further,
    and a prefetching loader resumed from it (through JSON, as a checkpoint stores it) continues exactly;
    loading a state with reads ahead (a fault rollback) drops them."""
    plain = make(prepared_mds)
    ahead = make(prepared_mds)
    fetched = PrefetchedBatches(ahead, depth=2)
    k = 3
    assert_same(steps(fetched, 1), steps(plain, 1))
    first = fetched.state_dict()
    assert_same(steps(fetched, k - 1), steps(plain, k - 1))
    ahead.settle(k + 2)  # the reader has read steps k+1 and k+2 ahead: its own position is (k+2)·G
    assert ahead.position == (k + 2) * ahead.global_batch_size
    state = json.loads(json.dumps(fetched.state_dict()))
    assert state == plain.state_dict() and state["position"] == k * ahead.global_batch_size

    resumed = PrefetchedBatches(make(prepared_mds), depth=2)
    resumed.load_state_dict(state)
    assert_same(steps(resumed, 4), steps(plain, 4))

    fetched.load_state_dict(first)  # a rollback to step 1 with steps k+1.. read ahead: they are dropped
    assert_same(steps(fetched, 4), steps(restored(prepared_mds, first), 4))
    for loader in (fetched, resumed):
        loader.close()


def restored(cfg: DataConfig, state: dict[str, Any]) -> TokenBatches:
    loader = make(cfg)
    loader.load_state_dict(state)
    return loader


def damaged_copy(cfg: DataConfig, dest: Path) -> tuple[DataConfig, int]:
    """A private copy of ``cfg``'s shards with one bit flipped in a shard that a later step reads first,
    and that step: the reads before it pass, its read fails the shard's sha256 check (shards are verified
    on first use)."""
    assert cfg.prepare is not None
    shutil.copytree(cfg.prepare.output, dest)
    copy = build(DataConfig, {"format": cfg.format, "seq_len": cfg.seq_len, "streams": [{"path": str(dest)}]})
    probe = make(copy)
    seen: set[int] = set()
    for step in range(20):
        start = step * probe.global_batch_size
        _, index = probe.order(np.arange(start, start + probe.local_batch_size))
        shards = {int(np.searchsorted(probe.readers[0].offsets, i, side="right")) - 1 for i in index.tolist()}
        if step and shards - seen:
            victim = dest / "train" / probe.readers[0].shards[min(shards - seen)].name
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0x01
            victim.write_bytes(bytes(data))
            return copy, step
        seen |= shards
    raise AssertionError("no step reads a new shard")


def test_an_error_in_the_reader_thread_surfaces_on_the_training_thread(
    prepared_mds: DataConfig, tmp_path: Path
) -> None:
    cfg, bad = damaged_copy(prepared_mds, tmp_path / "ds")
    plain = make(cfg)
    steps(plain, bad)
    with pytest.raises(UserError) as in_place:
        plain.next_step()
    loader = make(cfg)
    fetched = PrefetchedBatches(loader, depth=1)
    steps(fetched, bad)  # step `bad` was read ahead, and failed, while these were handed out
    with pytest.raises(UserError) as ahead:
        fetched.next_step()
    assert type(ahead.value) is type(in_place.value) and str(ahead.value) == str(in_place.value)
    assert "\n" not in str(ahead.value) and "fails its sha256 checksum" in str(ahead.value)
    assert loader.threads[bad] == THREAD  # the failed read ran in the reader thread; its traceback came along
    assert ahead.value.__traceback__ is not None and "samples" in [f.name for f in traceback.extract_tb(ahead.tb)]
    assert fetched.state_dict() == plain.state_dict()  # nothing of the failed step consumed
    with pytest.raises(UserError, match="fails its sha256 checksum"):  # a retry reads the same step again
        fetched.next_step()
    fetched.close()


def test_pinned_only_with_cuda_and_on_the_training_threads_device(
    prepared_mds: DataConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU contract of the CUDA path: with CUDA every micro-batch handed out is the copy ``pin_memory()``
    returned, made in the reader thread after it selected the training thread's device; without CUDA
    ``pin_memory()`` is never called. (This machine has no GPU: the CUDA calls are stand-ins that record.)"""
    pinned: list[str] = []
    devices: list[tuple[int, str]] = []

    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        pinned.append(threading.current_thread().name)
        out = self.clone()
        out.was_pinned = True  # type: ignore[attr-defined]
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    expected = steps(make(prepared_mds), 3)
    off = PrefetchedBatches(make(prepared_mds), depth=1)  # no CUDA here
    assert_same(steps(off, 3), expected)
    off.close()
    assert pinned == [] and off.device is None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: devices.append((d, threading.current_thread().name)))
    on = PrefetchedBatches(make(prepared_mds), depth=1)
    got = steps(on, 3)
    on.close()
    assert_same(got, expected)
    assert all(getattr(t, "was_pinned", False) for micro in got for t in micro)
    # step 1 is read in place (nothing was ahead yet), steps 2 and 3 (and 4, unless close cancelled it) ahead
    assert pinned[:2] == ["MainThread"] * 2 and set(pinned[2:]) == {THREAD} and len(pinned) in (6, 8)
    assert devices == [(3, THREAD)]


def test_the_reader_thread_ends_on_close_and_when_collected(prepared_mds: DataConfig) -> None:
    before = set(reader_threads())
    fetched = PrefetchedBatches(make(prepared_mds), depth=2)
    steps(fetched, 2)
    (thread,) = set(reader_threads()) - before
    assert thread.daemon  # never holds the interpreter at exit
    fetched.close()
    assert not thread.is_alive()
    assert_same(steps(fetched, 1), steps(make(prepared_mds), 3)[2:])  # after close: read in place
    assert set(reader_threads()) - before == set()

    dropped = PrefetchedBatches(make(prepared_mds), depth=1)
    steps(dropped, 2)
    (thread,) = set(reader_threads()) - before
    del dropped
    gc.collect()
    thread.join(timeout=60)
    assert not thread.is_alive()
