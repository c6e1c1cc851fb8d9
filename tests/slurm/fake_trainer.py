"""Stand-in for ``elastic-pretrain train`` under torchrun: the run-directory and signal contract of
the real trainer (elastic_pretrain/launch/layout.py), with a cheap all-reduce as the "step".

* ``torch.distributed`` over gloo (NCCL if CUDA is there) across every node of the job;
* SIGTERM / SIGUSR1 / SIGUSR2 only set a flag (the real trainer's ``StopRequest``,
  checkpoint/preempt.py); at each step boundary the flag is all-reduced, so every rank saves the same
  step and exits 0 together. The node launcher (launch/local.py) starts the ranks with those signals
  blocked, so a signal before the handler waits: unblocked once it is in; after it, they are ignored
  (a second copy — the launcher passes its own on — must not kill a rank on its way out);
* rank 0 commits ``checkpoints/step_<N>/`` (written under a temporary name with its ``COMMITTED``
  marker, then renamed) and then replaces ``checkpoints/latest``; a restart resumes from it;
* ``FINISHED`` (JSON with the final state) once all steps are done; ``STOPPED`` (JSON with the step)
  when a stop signal ended it after saving, removed at the next start.

The state update is order-sensitive (``v = v / 2 + sum_r (r+1) * s``), so resuming from the
wrong step or state changes the final value.

``--fail-after-stop`` makes rank 1 of the first start exit 1 after a stop's save (a crash on the way
out: the run is saved and STOPPED written, so the batch script must still requeue it).

``--hold-at N`` makes the first start wait at step N (still answering signals) until signalled, so
a test can preempt or kill it mid-run without racing the clock. Diagnostics for the tests:
``holding`` (written when it waits), ``starts.jsonl`` (one line per start: restart count, start step, hosts
of all ranks) and ``pids/rank<R>`` (the worker's pid, for killing one).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_pretrain.checkpoint.preempt import StopRequest
from elastic_pretrain.checkpoint.store import COMMIT_FILE, FORMAT_VERSION, crc32_file


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _resume(ckpts: Path) -> tuple[int, float]:
    latest = ckpts / "latest"
    if not latest.is_file():
        return 0, 0.0
    state = json.loads((ckpts / latest.read_text().strip() / "state.json").read_text())
    return int(state["step"]), float(state["value"])


def _save(ckpts: Path, step: int, value: float) -> None:
    tmp = ckpts / f".tmp-step_{step}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "state.json").write_text(json.dumps({"step": step, "value": value}))
    # the commit marker the real trainer writes (checkpoint/store.py): `status` counts committed steps only
    files = {"state.json": [(tmp / "state.json").stat().st_size, crc32_file(tmp / "state.json")]}
    marker = {"version": FORMAT_VERSION, "step": step, "files": files}
    (tmp / COMMIT_FILE).write_text(json.dumps(marker))
    os.replace(tmp, ckpts / f"step_{step}")
    _write_atomic(ckpts / "latest", f"step_{step}\n")


def _agree(flag: bool) -> bool:
    """True on every rank if any rank got the signal (the trainer's step-boundary all-reduce)."""
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--step-time", type=float, default=0.4)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument(
        "--hold-at", type=int, default=0, help="first start only: stop advancing after this step until signalled"
    )
    p.add_argument("--forget-finished", action="store_true", help="break the contract: no FINISHED at the end")
    p.add_argument("--fail-after-stop", action="store_true", help="rank 1 exits 1 after a stop's save")
    args = p.parse_args()
    with StopRequest() as stop:  # a signal that came before the handler arrives now
        code = _run(args, stop)
    if code == STOPPED_FAILING:
        os._exit(1)
    return code


STOPPED_FAILING = -1  # --fail-after-stop: this rank saved, stopped, and now "crashes"


def _run(args: argparse.Namespace, stop: StopRequest) -> int:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir: Path = args.run_dir
    ckpts = run_dir / "checkpoints"
    (run_dir / "pids").mkdir(parents=True, exist_ok=True)
    (run_dir / "pids" / f"rank{rank}").write_text(f"{os.getpid()}\n")
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    start, value = _resume(ckpts)
    if rank == 0:
        (run_dir / "STOPPED").unlink(missing_ok=True)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if rank == 0:
        entry = {"restart": restart, "start_step": start, "hosts": hosts}
        with (run_dir / "starts.jsonl").open("a") as f:
            f.write(json.dumps(entry) + "\n")
    print(f"rank {rank}/{world} on {socket.gethostname()}: starting at step {start}", flush=True)

    for step in range(start + 1, args.steps + 1):
        time.sleep(args.step_time)
        contrib = torch.tensor([(rank + 1) * step], dtype=torch.float64)
        dist.all_reduce(contrib)
        value = value / 2 + contrib.item()
        stopping = _agree(stop.requested)
        if step == args.hold_at and restart == 0 and start == 0:
            # a long run in miniature: keep "training" at this step boundary until signalled
            if rank == 0:
                (run_dir / "holding").write_text(f"{step}\n")
            while not stopping:
                time.sleep(0.2)
                stopping = _agree(stop.requested)
        if stopping or step % args.save_every == 0:
            if rank == 0:
                _save(ckpts, step, value)
            dist.barrier()
        if stopping:
            if rank == 0:
                _write_atomic(run_dir / "STOPPED", json.dumps({"step": step, "reason": "stop signal"}))
            dist.barrier()  # STOPPED is written before any rank can fail on its way out (--fail-after-stop)
            print(f"rank {rank}: stop requested, saved step {step}, exiting", flush=True)
            dist.destroy_process_group()
            return STOPPED_FAILING if args.fail_after_stop and rank == 1 and restart == 0 else 0
    if rank == 0 and not args.forget_finished:
        _write_atomic(run_dir / "FINISHED", json.dumps({"step": args.steps, "value": value, "world": world}))
    print(f"rank {rank}: finished at step {args.steps}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
