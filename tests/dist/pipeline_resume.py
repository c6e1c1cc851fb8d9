"""Run by tests/parallel/test_pipeline.py (via pipeline_checks.py); alone: ``torchrun --nproc-per-node 2 … OUT``.

The trainer at PP=2 (parallel preset cpu-pp2) against PP=1, through checkpoints in both directions, in
one launch (each phase opens its own process group from a file store, as in ckpt_reshard.py):

  A (1 rank, PP=1)   4 steps uninterrupted, checkpoint at steps 2 and 4
  B (2 ranks, PP=2)  the same, at PP=2
  C (1 rank, PP=1)   resume from B's step 2 (saved at PP=2), steps 3-4: must continue as B did
  D (2 ranks, PP=2)  resume from A's step 2 (saved at PP=1), steps 3-4: must continue as A did

(A and B differ from the first step: each stage initialises only the layers it holds, so the initial
weights depend on the pipeline layout. What must not depend on it is everything after a checkpoint.)

The job: the tiny CPU job with 2 core layers x 3 passes, route replay and the loop-conditioning head,
independent-rank mixed depth from step 2 (ℓ per micro-batch), routing health probed at steps 2 and 4,
an evaluation at every loop count at the end. Each phase leaves its run directory under OUT_DIR/<phase>
(summary.json, checkpoints).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.moe_ffn_hidden_size=32",
    "model.flatten=1",
    "model.loops=3",
    "model.route_replay=true",
    "train.steps=4",
    "train.warmup_steps=1",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.routing_interval=2",
    "train.eval_sequences=8",
    "train.threads_per_rank=1",
    "schedule.switch_at=0.25",
    "checkpoint.interval=2",
    "tracking.backend=none",
]


def phase(out: Path, name: str, world: int, parallel: str, *overrides: str) -> None:
    import torch.distributed as dist

    from elastic_pretrain.engine import build_session
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.train.trainer import train

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{out}/store_{name}", rank=rank, world_size=world)
    job = load_job(
        REPO / "jobs" / "tiny-cpu.yaml", [*COMMON, f"parallel={parallel}", f"run_dir={out / name}", *overrides]
    )
    train(job, build_session)  # tears the process group down at the end
    gc.collect()


def main(out: Path) -> None:
    # imports inside the functions: megatron's checkpoint writer spawns a Manager process, and a spawned
    # interpreter re-runs this file's top level — kept to the standard library, it starts in a blink
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    rank = int(os.environ["RANK"])
    if rank == 0:
        phase(out, "A", 1, "single")
    else:  # start megatron's checkpoint-writer Manager process (slow: a spawned interpreter) while A runs
        filesystem_async._get_write_results_queue()
    phase(out, "B", 2, "cpu-pp2")  # rank 1 waits here until rank 0 has finished A
    if rank == 0:
        phase(out, "C", 1, "single", f"checkpoint.resume_from={out / 'B' / 'checkpoints' / 'step_2'}")
    phase(out, "D", 2, "cpu-pp2", f"checkpoint.resume_from={out / 'A' / 'checkpoints' / 'step_2'}")


if __name__ == "__main__":
    os.chdir(REPO)  # the data recipe's paths are relative to the repository root
    main(Path(sys.argv[1]).resolve())
