"""Host syncs per training step at ℓ = 1, 2, 4, with and without route replay (issue 31 item 2).

    .venv/bin/python bench/bench_syncs.py [--core-layers 2] [--micro-batches 4] [--sites]

One process, the real step (megatron schedule, DDP, optimizer) of a tiny looped MoE model. Counts are
of host reads of tensors by call site (elastic_pretrain/train/host_syncs.py), which on CUDA are the syncs
``torch.cuda.set_sync_debug_mode`` reports; host-tensor reads (``HOST_SITES``) are left out. Prints,
per (replay, ℓ): megatron's dispatcher syncs (one per MoE call it routes), the other syncs, the total.
No asserts (tests/train/test_host_syncs.py asserts the shape of these numbers).
"""

from __future__ import annotations

import argparse
import warnings
from types import SimpleNamespace

import torch

warnings.filterwarnings("ignore")


def build_step(core_layers: int, replay: bool, loops: int) -> tuple:
    from elastic_pretrain.model.config import ModelConfig
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.parallel.mesh import ParallelConfig
    from elastic_pretrain.train.config import TrainConfig
    from elastic_pretrain.train.session import build_optimizer, wrap_ddp
    from elastic_pretrain.train.step import TrainStep

    cfg = ModelConfig(
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        prelude_layers=1,
        coda_layers=1,
        core_layers=core_layers,
        num_experts=4,
        loops=loops,
        flatten=1,
        moe_top_k=2,
        moe_ffn_hidden_size=32,
        route_replay=replay,
    )
    net = build_model(cfg, ParallelConfig(), recompute="none")
    job = SimpleNamespace(
        model=cfg,
        train=TrainConfig(steps=9, warmup_steps=0, lr=1e-3, distributed_optimizer=False),
        schedule=SimpleNamespace(balance="off"),
        parallel=SimpleNamespace(grad_reduce="after_backward"),
    )
    model = wrap_ddp(job, net)
    optimizer, scheduler = build_optimizer(job, model)  # type: ignore[arg-type]
    return cfg, TrainStep(model, optimizer, scheduler, seq_len=16, micro_batch_size=2, max_loops=cfg.max_loops)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--core-layers", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--sites", action="store_true", help="print the syncs by call site")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
    from elastic_pretrain.parallel.pipeline import MicroBatch
    from elastic_pretrain.schedule import DepthPlan
    from elastic_pretrain.train.host_syncs import DISPATCHER, count_host_syncs

    init_mesh(ParallelConfig(), seed=0)
    print(f"core layers {args.core_layers}, {args.micro_batches} micro-batches per step")
    print(f"{'replay':>7} {'ℓ':>2} {'dispatcher':>10} {'other':>6} {'total':>6}")
    for replay in (False, True):
        cfg, step = build_step(args.core_layers, replay, loops=4)
        for ell in (1, 1, 2, 4):  # the first step builds the optimizer state
            micro = [
                MicroBatch(torch.randint(0, cfg.vocab_size, (2, 17)), DepthPlan(ell, (ell,), group_loops=ell))
                for _ in range(args.micro_batches)
            ]
            with count_host_syncs() as counter:
                step(micro)
            syncs = counter.device_syncs()
            dispatcher = syncs.pop(DISPATCHER, 0)
            print(
                f"{'on' if replay else 'off':>7} {ell:>2} {dispatcher:>10} {sum(syncs.values()):>6} "
                f"{dispatcher + sum(syncs.values()):>6}"
            )
            if args.sites and ell == 4:
                for site, n in sorted(syncs.items()):
                    print(f"        {n:>3} {site}")
    teardown()


if __name__ == "__main__":
    main()
