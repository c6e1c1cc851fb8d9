"""Checkpoint cost: a synchronous save and a load against a raw ``torch.save``/``torch.load`` of the same
tensors, and the time training is blocked by an async save against a sync one, phase by phase.

    .venv/bin/python bench/bench_checkpoint.py [--repeats 7] [--hidden 384] [--writer persistent|fork]
                                               [--staging background|inline] [--json out.json]

Two baselines for a save: ``torch.save`` as it is (the bytes reach the page cache; nothing is on disk when
it returns), and ``torch.save`` followed by an ``fsync`` of its file — the same bytes made durable, which is
what a checkpoint save must do before its commit marker (docs/checkpoints.md, "Guarantees"). Both are
printed; the issue's ratio is given against each.

One process, CPU, 1 thread; the default job's shape widened by ``--hidden`` (model + Adam moments). The
saves are the trainer's (``checkpoint/parallel_io.py:trainer_saves``: model + Adam state in model space
through megatron-core dist_checkpointing, torch_dist format, the structure validated and planned once;
``checkpoint/snapshot.py``). Each round runs raw save, sync save, async save, raw load, load back to back,
so that every ratio compares neighbours in time (the development machine is shared: its load moves
between rounds), each after an ``os.sync()`` (no operation pays for writing back the previous one's pages);
a warm-up round first. Prints min/median/max over the rounds (no asserts).

The async save's stall is what the training thread is blocked for: the save's call, plus (the staging copy
runs on a thread beside the next step) the wait of the next optimizer step for that copy — measured around
a real training step of the model (one micro-batch of random tokens), whose time against a plain step's
shows what the copy and the writer cost the step beside them. The save's call is split into phases (timers
around the functions it calls): the state dicts, the structure check, megatron's validation and
translation, planning, preparing the writes and the fork (a repeat save: the address check and its request);
"after the save" is what the first write to every saved tensor costs right after the save returns, against
the same writes with no writer alive: with ``--writer fork`` each page the forked writer still shares is
copied then (copy-on-write), a cost the next training step pays; with the persistent writer (the default,
checkpoint/writer.py) nothing is shared but the staging buffer. "stall + after" adds it to the stall.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore")

PHASES: dict[str, float] = defaultdict(float)


def timed_phase(owner: Any, name: str, label: str) -> None:
    """Wrap ``owner.name`` so that its time adds to ``PHASES[label]``."""
    fn = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def instrument() -> None:
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    from elastic_pretrain.checkpoint import optim_state, snapshot, writer

    timed_phase(optim_state, "sharded_optimizer_state", "Adam state dict (boxes, step all-reduce)")
    timed_phase(snapshot.SaveStrategies, "for_state", "structure check (fingerprint, agreement)")
    timed_phase(serialization, "save_preprocess", "megatron validation + factories")
    timed_phase(serialization.get_default_save_common_strategy().__class__, "save_common", "common.pt (rank 0)")
    timed_phase(snapshot.SnapshotSaveStrategy, "_repeat", "repeat save: the request (objects pickled)")
    timed_phase(snapshot, "_memory", "repeat save: tensor addresses checked")
    timed_phase(mcore_torch, "mcore_to_pyt_state_dict", "translation to torch DCP")
    timed_phase(mcore_torch, "save_state_dict_async_plan", "planning + write buckets")
    timed_phase(snapshot.SnapshotWriter, "prepare_write_data", "planning: of which write buckets")
    timed_phase(writer.Staging, "place", "hand-off: of which placing in the staging buffer")
    timed_phase(writer.Staging, "copy", "the staging copy (background: on its thread)")


def leaf_tensors(sd: Any, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor a sharded state dict would write, by key (the same bytes for ``torch.save``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(sd, dict):
        for v in sd.values():
            leaf_tensors(v, out)
    elif isinstance(sd, (ShardedTensor, ShardedTensorFactory)):
        # every leaf once: a key holds several (a stacked expert tensor, the Adam state's boxes of a slice)
        out[f"{len(out)}:{sd.key}"] = sd.data
    return out


def spread(xs: list[float], fmt: str = "{:.3f}") -> str:
    return " / ".join(fmt.format(v) for v in (min(xs), statistics.median(xs), max(xs)))


def widened_tiny(h: int) -> tuple[Any, Any, Any, Any, Any]:
    """The tiny job widened to hidden ``h`` in one process, built with its DDP wrapper and optimizer (Adam state
    allocated), the results queue started as the Checkpointer does (the writers report through it):
    ``(job, net, ddp, optimizer, scheduler)``. Shared with checkpoint_public.py."""
    from elastic_pretrain.checkpoint import optim_state
    from elastic_pretrain.checkpoint.manager import start_write_results_queue
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.parallel.mesh import init_mesh
    from elastic_pretrain.train.session import build_optimizer, wrap_ddp

    overrides = ["parallel=single", f"model.hidden_size={h}", f"model.ffn_hidden_size={h * 8 // 3}",
                 f"model.moe_ffn_hidden_size={h}"]  # fmt: skip
    job = load_job("jobs/tiny-cpu.yaml", overrides)
    init_mesh(job.parallel, seed=0)
    start_write_results_queue()
    net = build_model(job.model, job.parallel)
    ddp = wrap_ddp(job, net)
    optimizer, scheduler = build_optimizer(job, ddp)
    optim_state.ensure_state(optimizer)
    return job, net, ddp, optimizer, scheduler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument(
        "--writer",
        choices=("persistent", "fork"),
        default="persistent",
        help="the async save's writer (checkpoint.async_writer)",
    )
    parser.add_argument(
        "--staging",
        choices=("background", "inline"),
        default="background",
        help="the persistent writer's staging copy: on a thread beside the next step (the default) "
        "or on the training thread before the save returns",
    )
    parser.add_argument("--json", type=Path, help="also write every round's timings here (to pool several runs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from elastic_pretrain.checkpoint import optim_state, parallel_io
    from elastic_pretrain.checkpoint.manager import load_tensors, save_tensors
    from elastic_pretrain.checkpoint.writer import WriterQueue
    from elastic_pretrain.parallel.mesh import teardown
    from elastic_pretrain.parallel.pipeline import MicroBatch
    from elastic_pretrain.schedule import ScheduleController
    from elastic_pretrain.train.step import TrainStep

    h = args.hidden
    job, net, ddp, optimizer, scheduler = widened_tiny(h)
    # a real training step of this model (random tokens): forward and backward read the saved tensors, the
    # optimizer step writes them (and waits for a background staging copy first)
    train_step = TrainStep(ddp, optimizer, scheduler, seq_len=job.data.seq_len, max_loops=job.exit_depths,
                           micro_batch_size=job.train.micro_batch_size)  # fmt: skip
    controller = ScheduleController(job.schedule, max_loops=job.model.max_loops, seed=0,
                                    layers=job.model.core_layers_built,
                                    total_tokens=job.train.steps * job.tokens_per_step)  # fmt: skip
    n_micro = 1  # one micro-batch: a short step, so that its noise does not hide the save's cost
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, job.model.vocab_size, (n_micro, job.train.micro_batch_size, job.data.seq_len + 1),
                          generator=gen)  # fmt: skip

    def step() -> float:
        plans = controller.step_plans(step=0, micro_batches=n_micro, replica=0)
        t0 = time.perf_counter()
        train_step([MicroBatch(batch[i], plan) for i, plan in plans])
        return time.perf_counter() - t0

    for _ in range(2):
        step()  # warm-up
    instrument()
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    n = 0

    def fresh() -> Path:
        nonlocal n
        n += 1
        d = root / f"c{n}"
        d.mkdir()
        return d

    model_sd = net.sharded_state_dict()
    tensors = leaf_tensors(
        {"model": model_sd, "optim": optim_state.sharded_optimizer_state(optimizer, model_sd)[0]}, {}
    )
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    live = list(net.parameters()) + [t.data for t in tensors.values()]
    queue = WriterQueue(args.writer, background=args.staging == "background")
    last: dict[str, Path] = {}

    def touch() -> float:
        """Write every saved tensor in place (as a training step does), timed."""
        t0 = time.perf_counter()
        with torch.no_grad():
            for t in live:
                t.mul_(1.0)
        return time.perf_counter() - t0

    waits: list[float] = []  # time the training thread spent waiting for a background staging copy
    if queue.writer is not None:
        staged = queue.writer.staged

        def timed_staged() -> None:
            t0 = time.perf_counter()
            staged()
            waits.append(time.perf_counter() - t0)

        queue.writer.staged = timed_staged  # type: ignore[method-assign]

    def async_save(saves: Any, then: Callable[[], float] | None = None) -> dict[str, float]:
        """An async save, then ``then`` (the next training step, timed) or the first writes to every saved
        tensor (``touch``, after waiting for the staging copy as an optimizer step would)."""
        PHASES.clear()
        os.sync()
        t0, c0 = time.perf_counter(), time.process_time()
        request, _ = save_tensors(net, optimizer, fresh(), saves, use_async=True)
        t1 = time.perf_counter()
        waits.clear()
        queue.schedule_async_request(request)
        t2, c2 = time.perf_counter(), time.process_time()  # training continues here (CPU: all its threads)
        times = {"hand-off to the writer (fork / staging copy)": t2 - t1, "call": t2 - t0, "stall_cpu": c2 - c0}
        if then is not None:
            times["next step"] = then()
            times["waited"] = sum(waits)  # inside the next step's optimizer step
        else:
            queue.staged()
            times["waited"] = sum(waits)
            times["cow"] = touch()
        queue.maybe_finalize_async_calls(blocking=True)
        times["written"] = time.perf_counter() - t0
        times["stall"] = times["call"] + times["waited"]
        if then is None:
            times["touch"] = touch()
        return {**PHASES, **times}

    saves = parallel_io.trainer_saves()
    first = async_save(parallel_io.trainer_saves())  # a new structure: validated and planned

    def clock(fn: Callable[[], Any]) -> float:
        os.sync()  # no timed operation pays for writing back the previous one's pages
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def cpu(fn: Callable[[], Any]) -> tuple[float, float]:
        """(wall, CPU) seconds of ``fn``: CPU of this process and of the children it waited for (the writer)."""
        os.sync()
        c0, t = os.times(), clock(fn)
        c1 = os.times()
        return t, sum(getattr(c1, k) - getattr(c0, k) for k in ("user", "system", "children_user", "children_system"))

    def raw_save() -> None:
        last["raw"] = fresh() / "all.pt"
        torch.save(tensors, last["raw"])

    def raw_save_no_record_crc() -> None:
        from elastic_pretrain.checkpoint.file_write import no_record_checksums

        with no_record_checksums():
            torch.save(tensors, fresh() / "all.pt")

    def raw_save_durable() -> None:
        with open(fresh() / "all.pt", "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())

    def sync_save() -> None:
        last["sync"] = fresh()
        save_tensors(net, optimizer, last["sync"], saves)

    rounds: list[dict[str, Any]] = []
    for r in range(args.repeats + 1):  # round 0: warm-up (the structure validated and its plan cached)
        row: dict[str, Any] = {"raw": clock(raw_save), "raw_nocrc": clock(raw_save_no_record_crc)}
        row["raw_fsync"], row["raw_fsync_cpu"] = cpu(raw_save_durable)
        row["sync"], row["sync_cpu"] = cpu(sync_save)
        row["async"] = async_save(saves)
        row["step"] = statistics.median([step() for _ in range(2)])
        row["async_step"] = async_save(saves, then=step)
        row["raw_in"] = clock(lambda: torch.load(last["raw"], weights_only=True))
        row["sync_in"] = clock(lambda: load_tensors(net, optimizer, last["sync"], adam_step=1.0))
        if r:
            rounds.append(row)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
    queue.close()
    shutil.rmtree(root, ignore_errors=True)
    teardown()

    if args.json:
        args.json.write_text(
            json.dumps(
                {"nbytes": nbytes, "writer": args.writer, "load": os.getloadavg(), "first": first, "rounds": rounds},
                indent=1,
            )
        )
    report(rounds, first, nbytes, len(tensors), h, args.writer)


def report(rounds: list[dict[str, Any]], first: dict[str, float], nbytes: int, count: int, h: int, kind: str) -> None:
    gib = nbytes / 2**30
    keys = ("raw", "raw_nocrc", "raw_fsync", "sync", "raw_in", "sync_in", "step")
    col = {k: [row[k] for row in rounds] for k in keys}
    stall = [row["async"]["stall"] for row in rounds]
    after = [row["async"]["cow"] - row["async"]["touch"] for row in rounds]
    print(
        f"model + Adam state: {nbytes / 2**20:.1f} MiB in {count} tensors (hidden {h}); async writer: {kind}; "
        f"min / median / max of {len(rounds)} interleaved rounds; load average now {os.getloadavg()[0]:.1f}"
    )
    for label, k in (
        ("raw torch.save", "raw"),
        ("  without record CRC32s", "raw_nocrc"),
        ("raw torch.save + fsync", "raw_fsync"),
        ("sync save", "sync"),
        ("raw torch.load", "raw_in"),
        ("load (load_tensors)", "sync_in"),
    ):
        print(f"  {label:26s}{spread(col[k])} s   {statistics.median(col[k]) / gib:.2f} s/GiB")
    print(
        f"  async save, then at once a write to every saved tensor (no step between): blocked {spread(stall)} s "
        f"(the call {spread([r['async']['call'] for r in rounds])}, waiting for the staging copy "
        f"{spread([r['async']['waited'] for r in rounds])})"
    )
    stall_cpu, sync_cpu = [row["async"]["stall_cpu"] for row in rounds], [row["sync_cpu"] for row in rounds]
    print(
        f"  the call, CPU time        {spread(stall_cpu)} s   (sync save, CPU time with its writer: "
        f"{spread(sync_cpu)} s; torch.save + fsync: {spread([row['raw_fsync_cpu'] for row in rounds])} s)"
    )
    print(f"  async save until written  {spread([row['async']['written'] for row in rounds])} s")
    print(f"  first writes after the save, extra over no writer alive: {spread([a * 1e3 for a in after], '{:.1f}')} ms")
    nxt = [row["async_step"] for row in rounds]
    step_stall = [a["call"] + a["waited"] for a in nxt]
    delta = [a["next step"] - row["step"] for a, row in zip(nxt, rounds)]
    print(f"an async save, then a training step (a plain step: {spread(col['step'])} s):")
    print(
        f"  the call {spread([a['call'] * 1e3 for a in nxt], '{:.1f}')} ms; the optimizer step waited for the "
        f"staging copy {spread([a['waited'] * 1e3 for a in nxt], '{:.1f}')} ms"
    )
    print(
        f"  the step after it minus a plain step: {spread([d * 1e3 for d in delta], '{:.1f}')} ms (contention "
        "with the copy and the writer; step-to-step noise included)"
    )
    print("ratios, per round (min / median / max)")

    def ratio(label: str, xs: list[float], ys: list[float], fmt: str = "{:.2f}") -> None:
        print(f"  {label:58s} {spread([x / y for x, y in zip(xs, ys)], fmt)}x")

    ratio("sync save throughput vs torch.save (not durable)", col["raw"], col["sync"])
    ratio("sync save throughput vs torch.save without record CRC32s", col["raw_nocrc"], col["sync"])
    ratio("sync save throughput vs torch.save + fsync (durable)", col["raw_fsync"], col["sync"])
    ratio("load throughput vs torch.load", col["raw_in"], col["sync_in"])
    ratio("async stall (the call + the optimizer step's wait) vs sync save", step_stall, col["sync"], "{:.3f}")
    ratio("the same, with a write to every tensor at once (no step)", stall, col["sync"], "{:.3f}")
    ratio(
        "the call + (the next step - a plain step), vs sync save",
        [a["call"] + d for a, d in zip(nxt, delta)],
        col["sync"],
        "{:.3f}",
    )
    ratio("the call's CPU time vs sync save's", stall_cpu, sync_cpu, "{:.3f}")
    with_after = [s + a for s, a in zip(stall, after)]
    ratio("async stall + first writes after it, vs sync save", with_after, col["sync"], "{:.3f}")
    print(
        f"the async save's call by phase, ms (min / median / max); the first save of a structure: {first['call']:.3f} s"
    )
    skip = ("stall", "stall_cpu", "written", "cow", "touch", "call", "waited", "next step")
    labels = [k for k in rounds[0]["async"] if k not in skip]
    for k in labels:  # (the write buckets are part of planning, the staging copy part of the hand-off)
        ms = [row["async"].get(k, 0.0) * 1000 for row in rounds]
        print(f"  {k:44s} {spread(ms, '{:.1f}')}   (first save {first.get(k, 0.0) * 1000:.1f})")
    outer = [k for k in labels if ": of which" not in k and "on its thread" not in k]
    rest = [(row["async"]["call"] - sum(row["async"].get(k, 0.0) for k in outer)) * 1000 for row in rounds]
    print(f"  {'the rest (model state dict, megatron glue)':44s} {spread(rest, '{:.1f}')}")


if __name__ == "__main__":
    main()
