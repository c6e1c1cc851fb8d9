"""``elastic-pretrain convert-checkpoint <step_N> --out <run dir>``: a checkpoint (weights and Adam state) to the
other engine."""

from __future__ import annotations

import argparse
from pathlib import Path


def _convert(args: argparse.Namespace) -> int:
    from elastic_pretrain.checkpoint.store import resolve_checkpoint
    from elastic_pretrain.engine.convert import convert
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown

    init_mesh(ParallelConfig(), seed=0)
    try:
        out = convert(
            resolve_checkpoint(Path(args.checkpoint)),
            Path(args.out),
            zero_stage=args.zero_stage,
            optimizer=not args.weights_only,
        )
    finally:
        teardown()
    what = "model weights; optimizer state starts fresh" if args.weights_only else "model weights and Adam state"
    print(f"converted -> {out} ({what})")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-checkpoint",
        help="write a checkpoint as the other engine's checkpoint (megatron <-> deepspeed), optimizer state included",
        description="Convert a committed checkpoint between engine=megatron and engine=deepspeed (docs/engines.md).",
    )
    p.add_argument("checkpoint", help="a step_<N> directory or a run directory (its newest committed step)")
    p.add_argument("--out", required=True, help="run directory to write <out>/checkpoints/step_<N> into")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=2, help="ZeRO stage of a deepspeed result")
    p.add_argument(
        "--weights-only",
        action="store_true",
        help="convert the model weights only (the result's Adam state starts fresh)",
    )
    p.set_defaults(handler=_convert)
