"""Step time with ``parallel.grad_reduce: overlap`` against ``after_backward`` at mixed depth, interleaved.

    .venv/bin/torchrun --nproc-per-node 2 bench/bench_overlap.py [--steps 10] [--micro 4] [--layout ep2|dp2]

Two copies of the same model (same seed) in one launch, one wrapped each way, 2 gloo CPU processes
with 1 thread each; ℓ drawn per micro-batch and replica (uniform over 1..L_max, fixed seed). Steps
alternate A, B, A, B... (forward + backward + gradient reduction, no optimizer), so load from other
work on the machine hits both alike; median per side after 2 warm-up pairs. Prints the step-time
ratio overlap / after_backward. On CPU gloo the "overlap" is a gloo worker thread sharing the cores
with the backward: the ratio is indicative only; a GPU with NCCL on its own stream is the real case.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

SHAPE = dict(
    hidden_size=128,
    num_heads=4,
    ffn_hidden_size=256,
    prelude_layers=1,
    coda_layers=1,
    core_layers=2,
    num_experts=4,
    loops=2,
    flatten=2,
    moe_top_k=2,
    moe_ffn_hidden_size=128,
    moe_aux_loss_coeff=0.0,
)
ROWS, SEQ = 4, 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--layout", choices=["ep2", "dp2"], default="ep2")
    parser.add_argument("--bucket", type=int, default=100_000, help="parameters per bucket (overlap side)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "bench_overlap")
    args = parser.parse_args()

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from elastic_pretrain.model.config import ModelConfig
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
    from elastic_pretrain.parallel.overlap import overlapped_step
    from elastic_pretrain.parallel.pipeline import MicroBatch
    from elastic_pretrain.schedule import DepthPlan
    from elastic_pretrain.train.step import _forward_step
    from tests.dist.equivalence import wrap_ddp_for_test

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = args.out / str(os.getppid())
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    par = ParallelConfig(expert=2 if args.layout == "ep2" else 1)
    mesh = init_mesh(par, seed=0)
    torch.set_num_threads(1)
    cfg = ModelConfig(**SHAPE)  # type: ignore[arg-type]
    models: dict[str, Any] = {}
    for kind in ("after_backward", "overlap"):
        torch.manual_seed(0)
        net = build_model(cfg, par)
        models[kind] = wrap_ddp_for_test(net, grad_reduce=kind, bucket_size=args.bucket)
    draw = torch.Generator().manual_seed(1)
    n_steps = args.steps + 2
    ells = torch.randint(1, cfg.max_loops + 1, (n_steps, world, args.micro), generator=draw)
    tokens = torch.randint(
        0, cfg.vocab_size, (n_steps, args.micro, ROWS, SEQ + 1), generator=torch.Generator().manual_seed(rank)
    )
    times: dict[str, list[float]] = {k: [] for k in models}
    for s in range(n_steps):
        group = ells[s].max(dim=0).values if args.layout == "ep2" else ells[s, mesh.dp_rank]
        micro = [
            MicroBatch(
                tokens[s, i],
                DepthPlan(int(ells[s, mesh.dp_rank, i]), (int(ells[s, mesh.dp_rank, i]),), group_loops=int(group[i])),
            )
            for i in range(args.micro)
        ]
        order = list(models) if s % 2 == 0 else list(reversed(models))
        for kind in order:
            model = models[kind]
            model.zero_grad_buffer()
            dist.barrier()
            t0 = time.perf_counter()
            with overlapped_step(model, _forward_step, len(micro)) as forward_step:
                get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=iter(micro),
                    model=[model],
                    num_microbatches=len(micro),
                    seq_length=SEQ,
                    micro_batch_size=ROWS,
                    forward_only=False,
                )
            if s >= 2:
                times[kind].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    buckets = sum(len(lane) for lane in models["overlap"].ledger.lanes)
    if rank == 0:
        print(
            f"{args.layout}, 2 gloo CPU processes x 1 thread; hidden {SHAPE['hidden_size']}, {cfg.max_loops} passes, "
            f"{args.micro} micro-batches of {ROWS} x {SEQ}, ℓ uniform 1..{cfg.max_loops}; {buckets} buckets; "
            f"median of {args.steps} interleaved steps"
        )
        for k, v in med.items():
            print(f"  {k:<15} {v * 1e3:8.1f} ms")
        print(f"  overlap / after_backward = {med['overlap'] / med['after_backward']:.3f} (CPU: indicative only)")
    del models
    teardown()


if __name__ == "__main__":
    main()
