"""Step time of the looped model: route replay on/off at ℓ = 1, 2, 4, and the looped model against a
megatron-core GPTModel MoE with the same unrolled layers, experts and tokens.

    .venv/bin/python bench/bench_depth.py [--repeats 15]

One process, CPU, 1 thread. Prints medians and ratios against the baseline measured in the same run
(no asserts); the two sides of every ratio are timed alternately (A, B, A, B, ...), so a change in
the machine's load hits both. The GPTModel baseline has exactly the MoE layers the looped model
executes at L_max (prelude + L_max x core + coda; printed, and checked before timing).
The model is the default job's shape (hidden 96, 8 experts top-2, 1 core layer x 4
passes after flattening, prelude 1 + coda 1), micro-batch 4 x 128 tokens, forward + backward.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def timed_pair(fa, fb, repeats: int) -> tuple[float, float]:
    """Medians of ``fa`` and ``fb`` timed alternately (interleaved), after warm-up of both."""
    for _ in range(3):
        fa()
        fb()
    a, b = [], []
    for _ in range(repeats):
        for fn, out in ((fa, a), (fb, b)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from megatron.core.models.gpt import GPTModel

    from elastic_pretrain.model.config import ModelConfig
    from elastic_pretrain.model.vocab import padded_vocab_size
    from elastic_pretrain.parallel.megatron import build_model, layer_specs, transformer_config
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown

    par = ParallelConfig()
    init_mesh(par, seed=0)
    shape = dict(
        hidden_size=96,
        num_heads=4,
        ffn_hidden_size=256,
        prelude_layers=1,
        coda_layers=1,
        core_layers=2,
        num_experts=4,
        loops=2,
        flatten=2,
        moe_top_k=2,
        moe_ffn_hidden_size=96,
    )
    tokens = torch.randint(0, 257, (4, 129))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step(model, **kw):
        def run():
            model.zero_grad(set_to_none=True)
            out = model(inputs, labels=labels, **kw)
            loss = out[max(out)] if isinstance(out, dict) else out
            loss.mean().backward()

        return run

    print("route replay (fwd+bwd, median s)")
    print(f"  {'loops':>5} {'plain':>9} {'replay':>9} {'replay/plain':>13}")
    plain = build_model(ModelConfig(**shape), par)
    replay = build_model(ModelConfig(**shape, route_replay=True), par)
    replay.load_state_dict(plain.state_dict())
    for ell in (1, 2, 4):
        a, b = timed_pair(step(plain, loops=ell), step(replay, loops=ell), args.repeats)
        print(f"  {ell:>5} {a:9.4f} {b:9.4f} {b / a:13.3f}")

    # all six unrolled layers MoE in both models (prelude and coda MoE here), same experts, same tokens
    cfg = ModelConfig(**shape, loop_conditioning=False, edge_mlp="moe")
    looped = build_model(cfg, par)
    unrolled = cfg.prelude_layers + cfg.core_layers_built * cfg.max_loops + cfg.coda_layers
    # the GPTModel's layers = its prelude + core + coda: core = the unrolled passes only (an earlier
    # version set core_layers = unrolled and so timed 8 MoE layers against the looped model's 6)
    gcfg = ModelConfig(
        **{
            **shape,
            "flatten": 1,
            "core_layers": unrolled - cfg.prelude_layers - cfg.coda_layers,
            "num_experts": cfg.experts_built,
        }
    )
    tconf = transformer_config(gcfg, par)
    if tconf.num_layers != unrolled:
        raise SystemExit(f"baseline has {tconf.num_layers} layers, the looped model executes {unrolled}")
    gpt = GPTModel(
        config=tconf,
        transformer_layer_spec=layer_specs(gcfg).moe,
        vocab_size=padded_vocab_size(257, 1),
        max_sequence_length=128,
        position_embedding_type="rope",
    )
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    def gpt_step() -> None:
        get_moe_layer_wise_logging_tracker().clear()  # sized by the layer count of whichever model ran last
        gpt.zero_grad(set_to_none=True)
        gpt(inputs, None, None, labels=labels).mean().backward()

    def loop_step() -> None:
        get_moe_layer_wise_logging_tracker().clear()
        step(looped, loops=cfg.max_loops)()

    t_loop, t_gpt = timed_pair(loop_step, gpt_step, args.repeats)
    n_loop = sum(p.numel() for p in looped.parameters())
    n_gpt = sum(p.numel() for p in gpt.parameters())
    print(
        f"\nlooped (L_max={cfg.max_loops}, {unrolled} MoE layers executed, {n_loop / 1e6:.2f}M params) vs GPTModel"
        f" MoE with {tconf.num_layers} layers ({n_gpt / 1e6:.2f}M params), fwd+bwd median s, interleaved"
    )
    print(f"  looped {t_loop:.4f}  gpt {t_gpt:.4f}  looped/gpt {t_loop / t_gpt:.3f}")
    teardown()


if __name__ == "__main__":
    main()
