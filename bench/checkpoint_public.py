"""Our checkpoint writer against the public checkpoint APIs, on the issue's two targets (issue #34 item 3):
an async save blocks training for at most 0.10x a sync save, and a sync save runs at least 0.5x the
throughput of a raw ``torch.save`` of the same tensors.

    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_public.py [--repeats 3] [--hidden 256] [--dcp-prebuilt]
        [--arms ours,mcore,dcp-thread,dcp-process] [--json out.json]

Every arm saves the same model + Adam state (the bench_checkpoint.py setup: the tiny job widened by
``--hidden``, one process, CPU, 1 thread), into a fresh directory, after an ``os.sync()``; each round runs the
arms back to back so that every ratio compares neighbours in time (the machine is shared). The baseline,
``torch.save`` of the same tensors, runs in every round. Arms:

* ``ours``: the trainer's save (checkpoint/parallel_io.py: ``trainer_saves``; checkpoint/snapshot.py,
  writer.py: cached plan, repeat saves, staging buffer + persistent writer process);
* ``mcore``: megatron-core's public ``dist_checkpointing.save`` of the same sharded state dict with its
  default torch_dist strategy, async through its public ``AsyncCallsQueue`` (a writer forked per save: the
  fork is the snapshot; its ``persistent=True`` worker reads the live tensors without a copy on a CPU, so it
  is no snapshot and not measured);
* ``dcp``: ``torch.distributed.checkpoint.save`` / ``async_save`` of the same tensors as a flat dict, built
  from the same sharded state dict on every save as the other arms build theirs (``--dcp-prebuilt``: handed
  over ready-made, a lower bound; neither is megatron's torch_dist layout, which reshards), async with
  DCP's ``DefaultStager`` (staging copy on a background thread; pinned memory needs CUDA, so off here) and
  the thread or the process checkpointer.

An async arm's **stall** is the time until training may write the saved tensors again: the call, plus the
wait for its snapshot (our staging copy; DCP's ``staging_completion``; megatron's fork has it at return).
It leaves out what the snapshot costs later (the fork's copy-on-write page copies: bench_checkpoint.py
``--writer fork`` measures those). Every arm's sync save fsyncs its files; the raw ``torch.save`` does not
(bench_checkpoint.py also prints the durable baseline). Prints min / median / max per ratio; no asserts.
The numbers and the decision taken from them: docs/checkpoints.md, "Ours or the public APIs".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore")

_spec = importlib.util.spec_from_file_location("bench_checkpoint", Path(__file__).with_name("bench_checkpoint.py"))
assert _spec is not None and _spec.loader is not None
bench_checkpoint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--arms", default="ours,mcore,dcp-thread,dcp-process", help="comma-separated")
    parser.add_argument("--dcp-prebuilt", action="store_true", help="DCP arms: the state dict built once")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from elastic_pretrain.checkpoint import optim_state, parallel_io
    from elastic_pretrain.checkpoint.manager import save_tensors
    from elastic_pretrain.checkpoint.writer import WriterQueue
    from elastic_pretrain.parallel.mesh import teardown

    h = args.hidden
    _, net, _, optimizer, _ = bench_checkpoint.widened_tiny(h)

    def sharded() -> dict[str, Any]:
        model_sd = net.sharded_state_dict()
        return {"model": model_sd, "optimizer": optim_state.sharded_optimizer_state(optimizer, model_sd)[0]}

    tensors = bench_checkpoint.leaf_tensors(sharded(), {})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_public_"))
    count = 0

    def fresh() -> Path:
        nonlocal count
        count += 1
        d = root / f"c{count}"
        d.mkdir()
        return d

    def clock(fn: Callable[[], Any]) -> float:
        os.sync()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    arms = args.arms.split(",")
    ours_saves = parallel_io.trainer_saves()
    ours_queue = WriterQueue("persistent", background=True)
    mcore_queue = AsyncCallsQueue(persistent=False)
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False
        )
    )
    stager_shm = DefaultStager(
        StagingOptions(
            use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False
        )
    )
    pending: list[Any] = []

    def ours_sync() -> None:
        save_tensors(net, optimizer, fresh(), ours_saves)

    def ours_async() -> None:
        request, _ = save_tensors(net, optimizer, fresh(), ours_saves, use_async=True)
        ours_queue.schedule_async_request(request)
        ours_queue.staged()  # the staging copy done: training may write the tensors

    def ours_done() -> None:
        ours_queue.maybe_finalize_async_calls(blocking=True)

    def mcore_sync() -> None:
        dist_checkpointing.save(sharded(), str(fresh()))

    def mcore_async() -> None:
        mcore_queue.schedule_async_request(dist_checkpointing.save(sharded(), str(fresh()), async_sharded_save=True))

    def mcore_done() -> None:
        mcore_queue.maybe_finalize_async_calls(blocking=True)

    def flat() -> dict[str, torch.Tensor]:
        """The DCP arms' state dict: the same tensors, from a fresh sharded state dict unless --dcp-prebuilt."""
        return dict(tensors) if args.dcp_prebuilt else bench_checkpoint.leaf_tensors(sharded(), {})

    def dcp_sync() -> None:
        dcp.save(flat(), checkpoint_id=str(fresh()))

    def dcp_async(kind: Any, stage: Any) -> Callable[[], None]:
        def run() -> None:
            response = dcp.async_save(
                flat(), checkpoint_id=str(fresh()), async_checkpointer_type=kind, async_stager=stage
            )
            if hasattr(response, "staging_completion"):
                response.staging_completion.result()
                pending.append(response.upload_completion)
            else:
                pending.append(response)

        return run

    def dcp_done() -> None:
        while pending:
            pending.pop().result()

    # (sync save, async save, wait for the async save's write) per arm
    table: dict[str, tuple[Callable[[], None], Callable[[], None], Callable[[], None]]] = {
        "ours": (ours_sync, ours_async, ours_done),
        "mcore": (mcore_sync, mcore_async, mcore_done),
        "dcp-thread": (dcp_sync, dcp_async(AsyncCheckpointerType.THREAD, stager), dcp_done),
        "dcp-process": (dcp_sync, dcp_async(AsyncCheckpointerType.PROCESS, stager_shm), dcp_done),
    }
    rounds: list[dict[str, float]] = []
    for r in range(args.repeats + 1):  # round 0: warm-up (plans cached, writer processes started)
        row = {"raw": clock(lambda: torch.save(tensors, fresh() / "all.pt"))}
        for arm in arms:
            sync, start, done = table[arm]
            row[f"{arm}:sync"] = clock(sync)
            row[f"{arm}:stall"] = clock(start)
            row[f"{arm}:written"] = row[f"{arm}:stall"] + clock(done)
        if r:
            rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
    ours_queue.close()
    mcore_queue.close()
    stager.close()
    stager_shm.close()
    shutil.rmtree(root, ignore_errors=True)
    teardown()
    if args.json:
        args.json.write_text(json.dumps({"nbytes": nbytes, "load": os.getloadavg(), "rounds": rounds}, indent=1))
    spread = bench_checkpoint.spread
    print(
        f"model + Adam state: {nbytes / 2**20:.1f} MiB in {len(tensors)} tensors (hidden {h}); min / median / "
        f"max of {len(rounds)} interleaved rounds; load average now {os.getloadavg()[0]:.1f}"
    )
    print(f"  raw torch.save                {spread([row['raw'] for row in rounds])} s")
    for arm in arms:
        col = {k: [row[f"{arm}:{k}"] for row in rounds] for k in ("sync", "stall", "written")}
        tput = [row["raw"] / row[f"{arm}:sync"] for row in rounds]
        stall = [row[f"{arm}:stall"] / row[f"{arm}:sync"] for row in rounds]
        met = statistics.median(tput) >= 0.5 and statistics.median(stall) <= 0.10
        print(
            f"  {arm:12s} sync {spread(col['sync'])} s, async stall {spread(col['stall'])} s, written "
            f"{spread(col['written'])} s"
        )
        print(
            f"  {'':12s} sync throughput / torch.save {spread(tput, '{:.2f}')}x (target >= 0.5); "
            f"async stall / sync {spread(stall)}x (target <= 0.10); "
            f"both met at the median: {met}"
        )


if __name__ == "__main__":
    main()
