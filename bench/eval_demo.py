"""Measure the evaluation tools on a tiny model trained for a minute on CPU (numbers in docs/evaluation.md).

    .venv/bin/python bench/eval_demo.py [--steps 250] [--out runs/eval-demo]

A stand-alone loop, not the trainer: trains a tiny looped model at mixed depth (ℓ uniform in 1..L_max
per step, plain Adam, one process)
on the byte-level CPython standard library, trains the TaH2 decider on top (frozen backbone), then
prints: loss per loop count and AUC, KV bytes per token and the teacher-forced loss of both KV-cache
policies, and a decider threshold sweep against fixed depth (plots into ``--out``). The same tools on
a run of the real trainer: ``elastic-pretrain train jobs/tiny-cpu.yaml``, then ``jobs/tiny-decider.yaml``,
then ``elastic-pretrain eval <run> --data stdlib-code --adaptive --kv-gap`` (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np
import torch

from elastic_pretrain.eval.adaptive import threshold_sweep
from elastic_pretrain.eval.loss import quality_curve
from elastic_pretrain.eval.report import comparison_table, markdown_table, plot_comparison
from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.model.decider import DeciderConfig, IterationDecider, decider_loss
from elastic_pretrain.model.inference import KV_POLICIES, teacher_forced_loss
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown

SEQ, BATCH = 64, 8


def stdlib_bytes() -> tuple[np.ndarray, np.ndarray]:
    """Train / held-out byte streams: the stdlib's top-level modules, the last 10% of files held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    cut = int(len(files) * 0.9)
    train = b"".join(f.read_bytes() for f in files[:cut])
    held = b"".join(f.read_bytes() for f in files[cut:])
    return np.frombuffer(train, np.uint8).astype(np.int64), np.frombuffer(held, np.uint8).astype(np.int64)


def windows(stream: np.ndarray, n: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - SEQ - 1, size=n)
    return torch.from_numpy(np.stack([stream[s : s + SEQ + 1] for s in starts]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--decider-steps", type=int, default=80)
    ap.add_argument("--out", type=Path, default=Path("runs/eval-demo"))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    init_mesh(ParallelConfig(), seed=0)
    try:
        run(args)
    finally:
        teardown()


def run(args: argparse.Namespace) -> None:
    cfg = ModelConfig(hidden_size=64, num_heads=4, ffn_hidden_size=128, prelude_layers=1, coda_layers=1,
                      core_layers=2, flatten=2, loops=2, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=64,
                      moe_z_loss_coeff=0.0, loop_conditioning=False)  # fmt: skip
    model = build_model(cfg, ParallelConfig())
    train, held = stdlib_bytes()
    rng = np.random.default_rng(0)
    held_out = windows(held, 16, np.random.default_rng(1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        ell = int(rng.integers(1, cfg.max_loops + 1))
        batch = windows(train, BATCH, rng)
        loss = model(batch[:, :-1], labels=batch[:, 1:], loops=ell)[ell].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"step {step} ℓ={ell} loss {loss.item():.3f}", flush=True)
    model.eval()
    fixed = quality_curve(model, held_out, name="fixed depth")
    print("\n" + markdown_table(fixed))

    print("| ℓ | policy | KV bytes/token | teacher-forced loss |\n|---|---|---|---|")
    for ell in range(1, cfg.max_loops + 1):
        for policy in KV_POLICIES:
            tf = teacher_forced_loss(model, held_out, loops=ell, kv_cache=policy)
            print(f"| {ell} | {policy} | {tf.kv_bytes_per_token:.0f} | {tf.loss:.4f} |")

    decider = IterationDecider(DeciderConfig(coverage=0.9), hidden_size=cfg.hidden_size, max_loops=cfg.max_loops)
    dopt = torch.optim.Adam(decider.parameters(), lr=3e-3)
    for step in range(args.decider_steps):
        batch = windows(train, BATCH, rng)
        out = decider_loss(model, decider, batch[:, :-1], batch[:, 1:])
        dopt.zero_grad()
        out.bce.backward()  # frozen backbone: only the decider learns
        dopt.step()
        if step % 20 == 0 or step == args.decider_steps - 1:
            print(f"decider step {step} bce {out.bce.item():.3f} acc {out.accuracy:.3f} "
                  f"continue {out.continue_fraction:.3f}", flush=True)  # fmt: skip
    decider.eval()
    thresholds = [0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 1.01]
    curves = [fixed]
    for policy in KV_POLICIES:
        curve, results = threshold_sweep(model, decider, held_out, thresholds, kv_cache=policy,
                                         name=f"decider ({policy})")  # fmt: skip
        print(f"\n| threshold | mean passes | relative compute | loss ({policy}) |\n|---|---|---|---|")
        for r in results:
            print(f"| {r.threshold:g} | {r.mean_passes:.2f} | {r.relative_compute:.3f} | {r.loss:.4f} |")
        curves.append(curve)
    args.out.mkdir(parents=True, exist_ok=True)
    print("\n" + comparison_table(plot_comparison(curves, args.out / "quality.png")))
    print(f"plot: {args.out / 'quality.png'}")


if __name__ == "__main__":
    main()
