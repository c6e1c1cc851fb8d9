"""An async save writes the state of the instant it started (checkpoint/snapshot.py, docs/checkpoints.md
"Async save"): training changes every parameter and Adam moment right after the save returns, and the
checkpoint holds the values from before; the training thread hands the writer views, not copies, and the
writer compacts them (files of the state's size); the save plan is reused while the structure is unchanged
and rebuilt when it changes; async and sync checkpoints of one state are bitwise equal."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_pretrain.checkpoint import parallel_io
from elastic_pretrain.checkpoint.manager import Checkpointer
from elastic_pretrain.checkpoint.snapshot import SaveStrategies, is_view
from elastic_pretrain.checkpoint.store import read_trainer_state
from elastic_pretrain.checkpoint.tensors import ModelTensors, save_tensors
from elastic_pretrain.checkpoint.writer import Staging
from elastic_pretrain.job import public_dict
from elastic_pretrain.rundir import CheckpointFiles, RunFiles
from tests.checkpoint.conftest import STATES
from tests.checkpoint.runs import differing, tensors
from tests.dist.ckpt_reshard import owned_slices


def snapshot(net: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    out = {f"param {n}": p.detach().clone() for n, p in net.named_parameters()}
    for name, _, _, _, t in owned_slices(optimizer, net):
        out.update({f"{s} {name}": t[s].detach().clone() for s in STATES})
    return out


@torch.no_grad()
def train_a_little(net: Any, optimizer: Any, by: float) -> None:
    """What training does while the writer runs: every parameter and Adam moment changes, in place."""
    for p in net.parameters():
        p.add_(by)
    for _, _, _, _, t in owned_slices(optimizer, net):
        for s in STATES:
            t[s].mul_(-1.0).add_(by)


class TrainALittle(torch.optim.Optimizer):
    """:func:`train_a_little` as an optimizer step (every torch optimizer's step waits for a staging copy)."""

    def __init__(self, net: Any, optimizer: Any) -> None:
        super().__init__([torch.zeros(1)], {})
        self.net, self.inner, self.by = net, optimizer, 0.0

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        train_a_little(self.net, self.inner, self.by)


@pytest.fixture
def slow_staging(monkeypatch):  # type: ignore[no-untyped-def]
    """The staging copy made slow (0.3 s before it starts): a change racing it lands in the checkpoint."""
    copy = Staging.copy

    def slow_copy(self: Staging, live: list[torch.Tensor]) -> None:
        time.sleep(0.3)
        copy(self, live)

    monkeypatch.setattr(Staging, "copy", slow_copy)


def restore_step(ckpt: Checkpointer, run_dir: Path, step: int) -> None:
    """Load the committed checkpoint of ``step`` into the checkpointer's tensors and objects."""
    step_dir = RunFiles(run_dir).step_dir(step)
    ckpt.restore(step_dir, read_trainer_state(step_dir))


@pytest.mark.parametrize("how", ["optimizer step", "settle, then in place"])
def test_async_checkpoints_hold_the_values_from_before_training_changed_them(parts, slow_staging, how: str) -> None:
    """The staging copy runs on a thread, here made slow (0.3 s), so that a change racing it would land in
    the checkpoint: an optimizer step, or anything that calls ``settle()`` first, waits for it."""
    job, mesh, run_dir, net, optimizer = parts
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, ModelTensors(net, optimizer), {})
    assert job.checkpoint.async_save and job.checkpoint.async_writer == "persistent"
    trainer_step = TrainALittle(net, optimizer)
    want = {}
    for step in (1, 2, 3, 4):  # the first builds the plan, the second validates it, the rest reuse it
        want[step] = snapshot(net, optimizer)
        ckpt.save(step)
        assert ckpt.pending == step  # the writer is running...
        assert ckpt.queue is not None and ckpt.queue.writer is not None and ckpt.queue.writer.copying is not None
        if how == "optimizer step":  # ...while the trainer changes everything it saves
            trainer_step.by = float(step)
            trainer_step.step()
        else:
            ckpt.settle()
            train_a_little(net, optimizer, by=float(step))
        assert ckpt.queue.writer.copying is None and ckpt.queue.writer.guard is None  # waited, hook removed
    ckpt.close()
    assert ckpt.strategy.rebuilt == 1  # one structure: validated and planned once, reused three times
    after = snapshot(net, optimizer)
    for step in (1, 2, 3, 4):
        restore_step(ckpt, run_dir, step)
        got = snapshot(net, optimizer)
        assert not differing(got, want[step]), f"step {step}: {differing(got, want[step])[:3]}"
        assert differing(got, after)  # the modification was real: the checkpoint is not today's state


def test_a_change_that_does_not_wait_for_the_staging_copy_reaches_the_checkpoint(parts, slow_staging) -> None:
    """The control of the test above: the same slow copy, the change made in place without waiting — the
    checkpoint holds changed values (so the test above would see a missing wait)."""
    job, mesh, run_dir, net, optimizer = parts
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, ModelTensors(net, optimizer), {})
    want = snapshot(net, optimizer)
    ckpt.save(1)
    train_a_little(net, optimizer, by=5.0)
    ckpt.close()
    restore_step(ckpt, run_dir, 1)
    assert differing(snapshot(net, optimizer), want)


def test_async_and_sync_checkpoints_of_one_state_are_bitwise_equal(parts, tmp_path: Path) -> None:
    job, mesh, run_dir, net, optimizer = parts
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, ModelTensors(net, optimizer), {})
    for step in (1, 2, 3):
        ckpt.save(step)  # async; the third reuses the cached plan
    ckpt.save(4, blocking=True)
    ckpt.close()
    files = [CheckpointFiles(RunFiles(run_dir).step_dir(s)) for s in (3, 4)]
    async_t, sync_t = (tensors(f.path, tmp_path / f"{f.step}.pt") for f in files)
    assert async_t and not differing(async_t, sync_t)


def test_the_training_thread_hands_the_writer_views_and_the_writer_compacts_them(parts, tmp_path: Path) -> None:
    """No copy before the fork: the request's tensors share the parameters' and Adam state's memory; the
    files hold just the saved elements (a view written as such would write its whole buffer)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    _, _, _, net, optimizer = parts
    live = {p.untyped_storage().data_ptr() for p in net.parameters()}
    for _, _, _, _, t in owned_slices(optimizer, net):
        live |= {t[s].untyped_storage().data_ptr() for s in STATES}
    queue = AsyncCallsQueue()
    saves = parallel_io.trainer_saves()
    for i in range(3):
        out = tmp_path / f"c{i}"
        out.mkdir()
        request, _ = save_tensors(net, optimizer, out, saves, use_async=True)
        handed = [t for _, _, (_, items) in request.async_fn_args[1] for _, t in items]
        assert handed and all(t.untyped_storage().data_ptr() in live for t in handed)
        assert sum(is_view(t) for t in handed) > len(handed) // 2  # the parameters: views of DDP's buffer
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        nbytes = sum(t.numel() * t.element_size() for t in handed)
        written = sum(f.stat().st_size for f in out.glob("*.distcp"))
        assert nbytes <= written <= nbytes + 4096 * len(handed), (written, nbytes)
    queue.close()


def test_a_changed_structure_is_validated_and_planned_again(parts) -> None:
    _, _, _, net, _ = parts
    made: list[int] = []
    saves = SaveStrategies(lambda: made.append(len(made)) or len(made))
    sd = net.sharded_state_dict()
    assert saves.for_state(sd) == (1, True)
    assert saves.for_state(net.sharded_state_dict()) == (1, False)  # same structure, new tensors: reused
    key = next(k for k, v in sd.items() if hasattr(v, "global_offset") and v.global_shape)
    shape = sd[key].global_shape
    moved = {**sd, key: dataclasses.replace(sd[key], global_shape=(shape[0] + 1, *shape[1:]))}
    assert saves.for_state(moved) == (2, True)
    assert saves.for_state({**sd, "extra": 1}) == (3, True)  # a new entry
    assert saves.rebuilt == 3


def test_the_commit_takes_the_writers_checksums_instead_of_reading_the_tensors(parts, monkeypatch) -> None:
    """The writer checksums the tensor files as it writes them (an async save's writer process, a sync save's
    trainer); nobody reads them back: the commit reads only the small files, and the checkpoints verify."""
    from elastic_pretrain.checkpoint import store

    job, mesh, run_dir, net, optimizer = parts
    read: list[Path] = []
    crc32 = store.crc32_file
    monkeypatch.setattr(store, "crc32_file", lambda p, durable=False: read.append(p) or crc32(p, durable))
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, ModelTensors(net, optimizer), {})
    ckpt.save(1)
    ckpt.save(2, blocking=True)  # written by this process: a read back would be seen here
    ckpt.close()
    assert read and not [p for p in read if p.suffix == ".distcp"], read
    for step in (1, 2):
        step_dir = RunFiles(run_dir).step_dir(step)
        marker = store.verify(step_dir)
        assert any(k.endswith(".distcp") for k in marker["files"])
        assert not list(step_dir.rglob("*records*"))  # removed before the commit


def test_a_writer_record_that_does_not_match_the_file_is_not_taken(tmp_path: Path) -> None:
    from elastic_pretrain.checkpoint.store import crc32_file, file_records

    f = tmp_path / "__0_0.distcp"
    f.write_bytes(b"tensor bytes")
    size, crc = f.stat().st_size, crc32_file(f)
    assert file_records(tmp_path, [f], {f.name: [size, 7]}) == {f.name: [size, 7]}  # taken as the writer's
    assert file_records(tmp_path, [f], {f.name: [size + 1, 7]}) == {f.name: [size, crc]}  # another size
    assert file_records(tmp_path, [f], {f.name: "junk"}) == {f.name: [size, crc]}  # type: ignore[dict-item]


def _inner(saves: SaveStrategies) -> Any:
    """The SnapshotSaveStrategy under the (DP = 1: absent) fully parallel wrapper."""
    return getattr(saves.strategy, "base_strategy", saves.strategy)


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir()) if f.is_file() and f.name != ".metadata"}


def _metadata(d: Path) -> Any:
    from elastic_pretrain.checkpoint.safe_load import load_metadata

    with open(d / ".metadata", "rb") as f:
        return load_metadata(f)


def test_repeat_saves_write_what_a_full_save_writes(parts, tmp_path: Path) -> None:
    """From the third save of a structure on (megatron's plan validated), a save reuses the last full save's
    write items: the files are byte for byte those of a full save of the same state, and hold the values of
    the moment of the save."""
    from elastic_pretrain.checkpoint.tensors import load_tensors

    _, _, _, net, optimizer = parts
    saves = parallel_io.trainer_saves()
    want = {}
    for i in (1, 2, 3, 4):
        train_a_little(net, optimizer, by=0.25 * i)
        want[i] = snapshot(net, optimizer)
        (tmp_path / f"s{i}").mkdir()
        save_tensors(net, optimizer, tmp_path / f"s{i}", saves)
    assert _inner(saves).repeats == 2  # saves 3 and 4
    full = parallel_io.trainer_saves()  # a fresh strategy: the full path (first save of the structure)
    (tmp_path / "full").mkdir()
    save_tensors(net, optimizer, tmp_path / "full", full)
    assert _inner(full).repeats == 0
    assert _files(tmp_path / "s4") == _files(tmp_path / "full")
    ours, theirs = _metadata(tmp_path / "s4"), _metadata(tmp_path / "full")
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    for i in (3, 2):
        load_tensors(net, optimizer, tmp_path / f"s{i}", adam_step=1.0)
        assert not differing(snapshot(net, optimizer), want[i])


def test_a_reallocated_tensor_takes_the_full_path(parts, tmp_path: Path) -> None:
    from elastic_pretrain.checkpoint.tensors import load_tensors

    _, _, _, net, optimizer = parts
    saves = parallel_io.trainer_saves()
    for i in (1, 2, 3):
        (tmp_path / f"s{i}").mkdir()
        save_tensors(net, optimizer, tmp_path / f"s{i}", saves)
    assert _inner(saves).repeats == 1
    _, _, _, _, t = next(iter(owned_slices(optimizer, net)))
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    state = next(st for st in inner.state.values() if st["exp_avg"].untyped_storage().data_ptr()
                 == t["exp_avg"].untyped_storage().data_ptr())  # fmt: skip
    state["exp_avg"] = state["exp_avg"].clone() + 3.0  # reallocated (and changed)
    want = snapshot(net, optimizer)
    (tmp_path / "s4").mkdir()
    save_tensors(net, optimizer, tmp_path / "s4", saves)
    assert _inner(saves).repeats == 1  # not a repeat: an Adam moment moved
    train_a_little(net, optimizer, by=1.0)
    load_tensors(net, optimizer, tmp_path / "s4", adam_step=1.0)
    assert not differing(snapshot(net, optimizer), want)


def test_a_repeat_save_pickles_the_sharded_objects_again(mesh1, tmp_path: Path) -> None:
    """Sharded objects are values (TE's FP8 metadata on a GPU): each save writes the current ones."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    weight = torch.arange(12.0).view(3, 4)
    saves = parallel_io.trainer_saves()
    for i in (1, 2, 3, 4):
        state = {"w": ShardedTensor.from_rank_offsets("w", weight),
                 "extra": ShardedObject("extra", {"amax": float(i)}, (1,), (0,))}  # fmt: skip
        strategy, validate = saves.for_state(state)
        (tmp_path / f"s{i}").mkdir()
        dist_checkpointing.save(state, str(tmp_path / f"s{i}"), sharded_strategy=strategy,
                                validate_access_integrity=validate)  # fmt: skip
    assert _inner(saves).repeats == 2
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(3, 4)),
                "extra": ShardedObject("extra", None, (1,), (0,))}  # fmt: skip
    from elastic_pretrain.checkpoint.safe_load import load_sharded

    loaded = load_sharded(template, tmp_path / "s4", what="test")
    assert loaded["extra"] == {"amax": 4.0} and torch.equal(loaded["w"], weight)
