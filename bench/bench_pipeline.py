"""Pipeline parallelism of the loop: step time and bubble at PP=2 against the same work at PP=1, at fixed
and mixed depth, and what the identity chunks of short micro-batches cost.

    .venv/bin/torchrun --nproc-per-node 2 bench/bench_pipeline.py [--steps 8] [--micro 8]

One launch, CPU, 1 thread per rank. Phase 1: rank 0 alone, PP=1 (no pipeline). Phase 2: both ranks,
PP=2 (megatron's interleaved schedule, one virtual chunk per pass). Same model, same micro-batches,
forward + backward of one optimizer step's micro-batches (no optimizer step). Medians over ``--steps``.

- bubble: per rank, 1 - (time inside forward/backward compute) / (step time), measured with
  megatron's own ``forward-compute`` / ``backward-compute`` timer hooks; the rest is waiting for the
  other stage and p2p. The interleaved schedule's ideal is (P-1) / (v·M + P-1) for v chunks, M micro-batches.
- mixed depth: ℓ drawn per micro-batch (uniform over 1..L_max, fixed seed). Its ideal step-time
  ratio to fixed depth is (mean ℓ) / L_max for the core; identity chunks (pass j >= ℓ) still take a
  slot in the schedule and move the activation, which the ratio at PP=2 shows against PP=1.
Prints ratios against the PP=1 run measured in the same launch; asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
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
    loops=4,
    flatten=1,
    moe_top_k=2,
    moe_ffn_hidden_size=128,
    moe_aux_loss_coeff=0.0,
)
SEQ, ROWS = 128, 4


class ComputeTimers:
    """megatron's ``config.timers`` hook: accumulates seconds in forward-compute and backward-compute."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._t0: dict[str, float] = {}

    def __call__(self, name: str, log_level: int = 0) -> ComputeTimers._Timer:
        return ComputeTimers._Timer(self, name)

    class _Timer:
        def __init__(self, owner: ComputeTimers, name: str) -> None:
            self.owner, self.name = owner, name

        def start(self, barrier: bool = False) -> None:
            self.owner._t0[self.name] = time.perf_counter()

        def stop(self, barrier: bool = False) -> None:
            self.owner.total[self.name] += time.perf_counter() - self.owner._t0.pop(self.name)

    def compute(self) -> float:
        return self.total["forward-compute"] + self.total["backward-compute"]


def plans(kind: str, micro: int, max_loops: int) -> list[Any]:
    from elastic_pretrain.schedule import DepthPlan

    if kind == "fixed":
        return [DepthPlan(max_loops, (max_loops,))] * micro
    rng = torch.Generator().manual_seed(3)
    ells = torch.randint(1, max_loops + 1, (micro,), generator=rng).tolist()
    return [DepthPlan(ell, (ell,)) for ell in ells]


def run_phase(out: Path, name: str, pipeline: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from elastic_pretrain.model.config import ModelConfig
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
    from elastic_pretrain.parallel.pipeline import MicroBatch, Pipeline, run_pipeline
    from elastic_pretrain.train.session import wrap_ddp
    from elastic_pretrain.train.step import _forward_step

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{out}/store_{name}", rank=rank, world_size=pipeline)
    par = ParallelConfig(pipeline=pipeline)
    init_mesh(par, seed=0)
    torch.set_num_threads(1)
    cfg = ModelConfig(**SHAPE)
    net = build_model(cfg, par)
    model = wrap_ddp(
        SimpleNamespace(
            train=SimpleNamespace(distributed_optimizer=False),
            schedule=SimpleNamespace(balance="off"),
            parallel=SimpleNamespace(grad_reduce="after_backward"),
        ),
        net,
    )
    pipe = Pipeline(model, net, pipeline) if pipeline > 1 else None
    config = pipe.config if pipe else net.config
    tokens = torch.randint(0, cfg.vocab_size, (args.micro, ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    results: dict[str, dict[str, float]] = {}
    for kind in ("fixed", "mixed"):
        micro = [MicroBatch(tokens[i], p) for i, p in enumerate(plans(kind, args.micro, cfg.max_loops))]
        steps, bubbles = [], []
        for i in range(args.steps + 2):  # 2 warm-up steps
            timers = ComputeTimers()
            config.timers = timers
            model.zero_grad_buffer()
            dist.barrier()
            t0 = time.perf_counter()
            if pipe is not None:
                run_pipeline(pipe, micro, seq_len=SEQ, training=True)
            else:
                get_forward_backward_func()(
                    forward_step_func=_forward_step,
                    data_iterator=iter(micro),
                    model=[model],
                    num_microbatches=len(micro),
                    seq_length=SEQ,
                    micro_batch_size=ROWS,
                    forward_only=False,
                )
            step = time.perf_counter() - t0
            config.timers = None
            if i >= 2:
                steps.append(step)
                bubbles.append(1.0 - timers.compute() / step)
        mean_loops = sum(mb.plan.loops for mb in micro) / len(micro)
        results[kind] = {"step": statistics.median(steps), "bubble": statistics.median(bubbles), "loops": mean_loops}
    del pipe, model, net
    gc.collect()
    teardown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "bench_pipeline")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    out = args.out / str(os.getppid())  # one store directory per launch
    out.mkdir(parents=True, exist_ok=True)
    base = run_phase(out, "pp1", 1, args) if rank == 0 else None
    pp2 = run_phase(out, "pp2", 2, args)
    gathered: list[Any] = [None, None]
    dist.init_process_group("gloo", init_method=f"file://{out}/store_report", rank=rank, world_size=2)
    dist.all_gather_object(gathered, pp2)
    dist.destroy_process_group()
    if rank != 0:
        return
    max_loops = SHAPE["loops"] * SHAPE["flatten"]
    p, v, m = 2, max_loops, args.micro
    print(
        f"model: hidden {SHAPE['hidden_size']}, core 2 layers x {max_loops} passes, {SHAPE['num_experts']} experts; "
        f"{m} micro-batches of {ROWS} x {SEQ} tokens; forward+backward, median of {args.steps} steps"
    )
    print(f"ideal interleaved bubble (P-1)/(v*M+P-1) = {(p - 1) / (v * m + p - 1):.3f} (P={p}, v={v}, M={m})")
    print(f"{'run':<14} {'mean ℓ':>6} {'step s':>8} {'vs PP=1':>8} {'bubble r0':>10} {'bubble r1':>10}")
    for kind in ("fixed", "mixed"):
        b = base[kind]
        print(f"{'PP=1 ' + kind:<14} {b['loops']:6.2f} {b['step']:8.3f} {1.0:8.2f} {b['bubble']:10.3f} {'':>10}")
        s0, s1 = gathered[0][kind], gathered[1][kind]
        step = max(s0["step"], s1["step"])
        print(
            f"{'PP=2 ' + kind:<14} {s0['loops']:6.2f} {step:8.3f} {step / b['step']:8.2f} "
            f"{s0['bubble']:10.3f} {s1['bubble']:10.3f}"
        )
    ideal = base["mixed"]["loops"] / max_loops
    pp1_ratio = base["mixed"]["step"] / base["fixed"]["step"]
    pp2_ratio = max(gathered[r]["mixed"]["step"] for r in (0, 1)) / max(gathered[r]["fixed"]["step"] for r in (0, 1))
    print(
        f"mixed / fixed step time: PP=1 {pp1_ratio:.2f}, PP=2 {pp2_ratio:.2f} "
        f"(core-only ideal mean ℓ / L_max = {ideal:.2f}); identity chunks cost PP=2 "
        f"{(pp2_ratio - pp1_ratio) * 100:+.0f} points of the fixed-depth step"
    )


if __name__ == "__main__":
    main()
