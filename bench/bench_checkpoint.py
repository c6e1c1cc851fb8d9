"""Checkpoint cost: a synchronous save and a load against a raw ``torch.save``/``torch.load`` of the same
tensors (seconds per GiB), and the time training is blocked by an async save against a sync one.

    .venv/bin/python bench/bench_checkpoint.py [--repeats 5] [--hidden 384]

One process, CPU, 1 thread; the default job's shape widened by ``--hidden`` (model + Adam moments).
The sync save is what the trainer does (model + Adam state in model space through megatron-core
dist_checkpointing, torch_dist format). The async save blocks training only while it builds the
state dict and forks the writer; the writer then competes with training for the CPU (on a 2-core
machine, noticeably). Prints medians and ratios against the baselines measured in the same run (no
asserts).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore")


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=384)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from elastic_pretrain.checkpoint import optim_state, parallel_io
    from elastic_pretrain.checkpoint.manager import load_tensors, save_tensors
    from elastic_pretrain.job import load_job
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.parallel.mesh import init_mesh, teardown
    from elastic_pretrain.train.session import build_optimizer, wrap_ddp

    h = args.hidden
    job = load_job(
        "jobs/tiny-cpu.yaml",
        [
            "parallel=single",
            f"model.hidden_size={h}",
            f"model.ffn_hidden_size={h * 8 // 3}",
            f"model.moe_ffn_hidden_size={h}",
        ],
    )
    init_mesh(job.parallel, seed=0)
    net = build_model(job.model, job.parallel)
    optimizer, _ = build_optimizer(job, wrap_ddp(job, net))
    optim_state.ensure_state(optimizer)
    strategy = parallel_io.save_strategy()  # the trainer's (checkpoint/parallel_io.py)
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    n = 0

    def fresh() -> Path:
        nonlocal n
        n += 1
        d = root / f"c{n}"
        d.mkdir()
        return d

    last: dict[str, Path] = {}

    def sync_save() -> None:
        last["sync"] = fresh()
        save_tensors(net, optimizer, last["sync"], strategy)

    def sync_load() -> None:
        load_tensors(net, optimizer, last["sync"], adam_step=1.0)

    model_sd = net.sharded_state_dict()
    tensors = leaf_tensors(
        {"model": model_sd, "optim": optim_state.sharded_optimizer_state(optimizer, model_sd)[0]}, {}
    )
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    def raw_save() -> None:
        last["raw"] = fresh() / "all.pt"
        torch.save(tensors, last["raw"])

    def raw_load() -> None:
        torch.load(last["raw"], weights_only=True)

    queue = AsyncCallsQueue()
    stalls, totals = [], []

    def async_save() -> None:
        t0 = time.perf_counter()
        request, _ = save_tensors(net, optimizer, fresh(), strategy, use_async=True)
        queue.schedule_async_request(request)
        stalls.append(time.perf_counter() - t0)  # what a training step waits for
        queue.maybe_finalize_async_calls(blocking=True)
        totals.append(time.perf_counter() - t0)

    def timed(fn) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    raw = timed(raw_save)
    raw_in = timed(raw_load)
    sync = timed(sync_save)
    sync_in = timed(sync_load)
    timed(async_save)
    stall, total = statistics.median(stalls[1:]), statistics.median(totals[1:])
    print(
        f"model + Adam state: {nbytes / 2**20:.1f} MiB in {len(tensors)} tensors (hidden {h}), median of {args.repeats}"
    )
    gib = nbytes / 2**30
    print(f"  raw torch.save                      {raw:8.3f} s  {raw / gib:7.2f} s/GiB  1.00x")
    print(f"  sync save (dist_checkpointing)      {sync:8.3f} s  {sync / gib:7.2f} s/GiB  {sync / raw:.2f}x raw")
    print(f"  raw torch.load                      {raw_in:8.3f} s  {raw_in / gib:7.2f} s/GiB  1.00x")
    print(f"  load (load_tensors)                 {sync_in:8.3f} s  {sync_in / gib:7.2f} s/GiB {sync_in / raw_in:.2f}x")
    print("training blocked by one save")
    print(f"  sync save                           {sync:8.3f} s  1.00x")
    print(f"  async save (state dict + fork)      {stall:8.3f} s  {stall / sync:.2f}x sync")
    print(f"  async save until written            {total:8.3f} s  {total / sync:.2f}x sync (in the background)")
    queue.close()
    shutil.rmtree(root, ignore_errors=True)
    teardown()


if __name__ == "__main__":
    main()
