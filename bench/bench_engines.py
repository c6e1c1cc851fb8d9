"""Step time and memory per rank of the two engines on the same job (docs/engines.md).

    torchrun --nproc-per-node 2 bench/bench_engines.py [--steps 6] [--zero-stage 2] [job overrides ...]

Both sessions are built in the same processes (DP = world size, TP = PP = EP = 1) from jobs/tiny-cpu.yaml plus
the overrides, then their steps are *interleaved* — megatron, deepspeed, megatron, ... on the same batches and
depth plans — so machine load drifts hit both alike; the first step of each is a warm-up. Prints, from rank 0,
the median step time of each and the ratio deepspeed / megatron, and per rank the bytes of model state each
engine holds (parameters, gradients, optimizer state and master copies: every tensor storage reachable from
its model and optimizer, counted once) and, on CUDA, each engine's peak allocated memory. No asserts.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def state_bytes(*roots: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` through containers and object dicts."""
    seen_obj: set[int] = set()
    storages: dict[tuple[Any, int], int] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                s = obj.untyped_storage()
                storages[(obj.device, s.data_ptr())] = s.nbytes()
            for attr in ("grad", "main_grad", "ds_tensor", "main_param"):
                extra = getattr(obj, attr, None) if attr != "grad" or obj.requires_grad else None
                if isinstance(extra, torch.Tensor):
                    stack.append(extra)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif (
            hasattr(obj, "__dict__")
            and not isinstance(obj, type)
            and type(obj).__module__.split(".")[0]
            in ("torch", "megatron", "deepspeed", "elastic_pretrain", "collections")
        ):
            stack.extend(vars(obj).values())
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from elastic_pretrain.engine import build_session
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.parallel.mesh import expert_layout, init_mesh, teardown
    from elastic_pretrain.parallel.pipeline import MicroBatch

    repo = Path(__file__).resolve().parent.parent
    base = [
        "parallel=single",
        "tracking.backend=none",
        f"train.steps={args.steps}",
        "train.warmup_steps=1",
        f"run_dir=/tmp/bench_engines-{os.getpid()}",
        f"deepspeed.zero_stage={args.zero_stage}",
        *args.overrides,
    ]
    if args.zero_stage == 3:
        base += ["schedule.sampler=fixed", "schedule.switch_at=1.0"]
    jobs = {e: load_job(repo / "jobs" / "tiny-cpu.yaml", [*base, f"engine={e}"]) for e in ("megatron", "deepspeed")}
    torch.set_num_threads(jobs["megatron"].train.threads_per_rank)
    mesh = init_mesh(jobs["megatron"].parallel, seed=jobs["megatron"].train.seed)
    cuda = torch.cuda.is_available()
    try:
        sessions, peak = {}, {}
        for engine, job in jobs.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sessions[engine] = build_session(job, mesh)
        layout = expert_layout()
        times: dict[str, list[float]] = {e: [] for e in sessions}
        for step in range(args.steps):
            tokens = sessions["megatron"].batches.next_step()
            for engine, s in sessions.items():
                if s.controller.update(step=step, tokens_seen=step * jobs[engine].tokens_per_step):
                    s.on_switch_to_mixed(step)
                plans = s.controller.step_plans(
                    step=step, micro_batches=len(tokens), replica=mesh.replica, layout=layout
                )
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                s.step([MicroBatch(tokens[i], p) for i, p in plans])
                if cuda:
                    torch.cuda.synchronize()
                    peak[engine] = max(peak.get(engine, 0), torch.cuda.max_memory_allocated())
                times[engine].append(time.perf_counter() - t0)
        gc.collect()
        held = {e: state_bytes(s.model, s.optimizer, s.net) for e, s in sessions.items()}
        med = {e: statistics.median(t[1:] or t) for e, t in times.items()}
        if mesh.rank == 0:
            print(
                f"engines on {jobs['megatron'].name}: world size {mesh.world_size}, ZeRO-{args.zero_stage}, "
                f"{args.steps} interleaved steps (first is warm-up)"
            )
            for e in sessions:
                print(f"  {e:>9}: median step {med[e]:.3f}s")
            print(f"  ratio deepspeed / megatron step time: {med['deepspeed'] / med['megatron']:.2f}")
        torch.distributed.barrier()
        for e in sessions:
            gpu = f", peak allocated {peak[e] / 2**20:.1f} MiB" if cuda else ""
            print(f"  rank {mesh.rank} {e:>9}: model state held {held[e] / 2**20:.2f} MiB{gpu}", flush=True)
    finally:
        teardown()


if __name__ == "__main__":
    main()
