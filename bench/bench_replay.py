"""Step time of route replay: off vs on (``route_replay_impl`` dispatch, the path that saves work) vs on
(``router``, megatron's RouterReplay: the full router still runs), as interleaved A/B ratios.

    .venv/bin/python bench/bench_replay.py [--repeats 15] [--loops 4] [--experts 8] [--tokens 512]

One process, CPU, 1 thread unless ``--threads``; CUDA when present. The three models share weights and
the batch; each repeat calls every (variant, ℓ) once in turn, and a ratio is the median over repeats of
(variant call / the replay-off call of the same repeat), so a change of load on the machine hits both
sides of a ratio alike. Forward + backward. Prints medians and ratios (no asserts).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--loops", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per micro-batch (4 rows)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--recompute", choices=["none", "pass"], default="none")
    parser.add_argument(
        "--moe-only",
        action="store_true",
        help="time one MoE call (fwd+bwd): fresh routing vs a dispatch replay vs a RouterReplay replay",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from elastic_pretrain.model.config import ModelConfig
    from elastic_pretrain.parallel.device import device
    from elastic_pretrain.parallel.megatron import build_model
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
        num_experts=args.experts,
        loops=args.loops,
        flatten=2,
        moe_top_k=2,
        moe_ffn_hidden_size=96,
    )
    variants = {
        "off": dict(route_replay=False),
        "dispatch": dict(route_replay=True, route_replay_impl="dispatch"),
        "router": dict(route_replay=True, route_replay_impl="router"),
    }
    nets = {}
    for name, kw in variants.items():
        torch.manual_seed(0)
        nets[name] = build_model(ModelConfig(**shape, **kw), par, recompute=args.recompute).train()
    rows = args.tokens // 128 or 1
    tokens = torch.randint(0, 257, (rows, args.tokens // rows + 1), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device())
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if args.moe_only:
        moe_only(nets["router"], inputs.numel(), args.repeats)
        teardown()
        return
    max_loops = nets["off"].cfg.max_loops
    ells = sorted({1, max_loops})

    def fwd_bwd(net, ell):
        def run() -> None:
            net.zero_grad(set_to_none=True)
            net(inputs, labels=labels, loops=ell)[ell].mean().backward()
            if torch.cuda.is_available():
                torch.cuda.synchronize()

        return run

    fns = {(ell, name): fwd_bwd(net, ell) for ell in ells for name, net in nets.items()}
    for fn in fns.values():  # warm-up
        fn()
    samples: dict[tuple[int, str], list[float]] = {k: [] for k in fns}
    for _ in range(args.repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - t0)
    print(
        f"route replay, fwd+bwd, {inputs.numel()} tokens, {args.experts} experts top-2, recompute "
        f"{args.recompute}, median of {args.repeats} interleaved repeats ({device()})"
    )
    print("| ℓ | off ms | dispatch ms | router ms | dispatch/off | router/off | dispatch/router |")
    print("|---|---|---|---|---|---|---|")
    for ell in ells:
        s = {name: samples[(ell, name)] for name in nets}
        med = {name: statistics.median(v) * 1e3 for name, v in s.items()}

        def paired(a: str, b: str, s=s) -> float:
            return statistics.median(x / y for x, y in zip(s[a], s[b], strict=True))

        print(
            f"| {ell} | {med['off']:.1f} | {med['dispatch']:.1f} | {med['router']:.1f} | "
            f"{paired('dispatch', 'off'):.3f} | {paired('router', 'off'):.3f} | {paired('dispatch', 'router'):.3f} |"
        )
    teardown()


def moe_only(net, tokens: int, repeats: int) -> None:
    """One core layer's MoE call on random hidden states, fwd+bwd: what a replayed pass saves per call."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from elastic_pretrain.model.replay_dispatch import moe_forward

    moe = net.core_layers()[0].shared_mlp
    x = torch.randn(tokens // 4, 4, net.config.hidden_size, requires_grad=True)
    _, rec = moe_forward(moe, x, None, exchange_counts=False)
    rr = moe.router.router_replay
    rr.target_topk_idx = rec.topk_NK

    def fresh() -> None:
        moe(x)[0].sum().backward()

    def dispatch() -> None:
        moe_forward(moe, x, rec, exchange_counts=False)[0].sum().backward()

    def router() -> None:
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            moe(x)[0].sum().backward()
        finally:
            rr.clear_router_replay_action()

    fns = {"fresh": fresh, "dispatch": dispatch, "router": router}
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))

    print(f"one MoE call, fwd+bwd, {tokens} tokens, median of {repeats} interleaved repeats")
    print("| fresh ms | dispatch replay ms | router replay ms | dispatch/fresh | router/fresh | dispatch/router |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {med['fresh']:.2f} | {med['dispatch']:.2f} | {med['router']:.2f} | {paired('dispatch', 'fresh'):.3f} | "
        f"{paired('router', 'fresh'):.3f} | {paired('dispatch', 'router'):.3f} |"
    )


if __name__ == "__main__":
    main()
