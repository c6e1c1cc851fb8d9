"""Every member of an expert-parallel group issues the same sequence of MoE all-to-alls (issue 30, item 4).

Under expert parallelism each MoE call (core layers, and prelude/coda layers with ``model.edge_mlp: moe``)
is a dispatch all-to-all and a combine all-to-all over the group, matched by position only: the members'
k-th calls pair up whatever layer each one is in. Members that drew different loop counts (mixed depth:
the shallower joins the deeper one's passes as ghost calls) or different telescopic exits must therefore
make their calls in the same order of layers. This records, in one process, which layer each dispatch and
combine belongs to — forward, and the order their backward runs in — for two plans that members of one
group may hold, and compares the two sequences. The heads used to run before the ghost passes (a coda
all-to-all paired with a core one); the 2-process check of the same, loss and gradients against one
process: tests/train/test_edge_moe_ep.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig

PAR = ParallelConfig()


def edge_moe(**kw: Any) -> ModelConfig:
    base = dict(
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        prelude_layers=1,
        coda_layers=1,
        core_layers=2,
        num_experts=4,
        loops=3,
        flatten=1,
        moe_top_k=2,
        moe_ffn_hidden_size=32,
        edge_mlp="moe",
    )
    return ModelConfig(**{**base, **kw})


def moe_layers(net: Any) -> dict[str, Any]:
    """Every MoE layer of the model by name (the all-to-alls of a call go through its token dispatcher)."""
    layers = {f"prelude{i}": layer.mlp for i, layer in enumerate(net.prelude)}
    layers |= {f"core{i}": core.shared_mlp for i, core in enumerate(net.core_layers())}
    layers |= {f"coda{i}": layer.mlp for i, layer in enumerate(net.coda)}
    assert all(hasattr(m, "token_dispatcher") for m in layers.values()), "edge layers must be MoE here"
    return layers


def record_all_to_alls(net: Any) -> tuple[list[str], Callable[[], None]]:
    """Wrap each MoE layer's ``token_dispatch``/``token_combine`` (where megatron's alltoall dispatcher issues
    its all-to-alls): one timeline of the forward calls (``train.recompute: pass`` re-runs included, in the
    backward) and, through a gradient hook on each output, of the backward all-to-alls."""
    events: list[str] = []
    undo = []
    for name, moe in moe_layers(net).items():
        disp = moe.token_dispatcher
        for method in ("token_dispatch", "token_combine"):
            original = getattr(disp, method)

            def wrapped(*args: Any, _orig: Any = original, _tag: str = f"{name}.{method[6:]}", **kw: Any) -> Any:
                out = _orig(*args, **kw)
                events.append(_tag)
                first = out[0] if isinstance(out, tuple) else out
                if first.requires_grad:  # the backward all-to-all runs when this output's gradient arrives
                    first.register_hook(lambda g, t=_tag: events.append(f"{t} backward"))
                return out

            setattr(disp, method, wrapped)
            undo.append((disp, method))

    def restore() -> None:
        for disp, method in undo:
            delattr(disp, method)

    return events, restore


def timeline(net: Any, *, loops: int, exits: tuple[int, ...], sync_loops: int) -> list[str]:
    """The all-to-alls of one forward + backward of the plan (``loops`` passes, ``exits``, ``sync_loops``)."""
    tokens = torch.randint(0, net.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    events, restore = record_all_to_alls(net)
    try:
        losses = net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops, exits=exits, sync_loops=sync_loops)
        torch.stack([losses[e].mean() for e in losses]).sum().backward()
    finally:
        restore()
    return events


# (plan of one member, plan of its partner): (loops, exits, sync_loops)
PLANS = {
    "mixed-depth": ((1, (1,), 3), (3, (3,), 3)),
    "mixed-depth-2": ((2, (2,), 3), (3, (3,), 3)),
    "telescopic-exits": ((3, (1, 3), 3), (3, (2, 3), 3)),
}


@pytest.mark.parametrize(
    ("recompute", "replay"), [("none", False), ("pass", True)], ids=["plain", "recompute-pass-route-replay"]
)
@pytest.mark.parametrize("plans", list(PLANS.values()), ids=list(PLANS))
def test_members_with_different_plans_issue_the_same_all_to_alls(mesh1, plans, recompute, replay):
    torch.manual_seed(0)
    net = build_model(edge_moe(route_replay=replay), PAR, recompute=recompute).train()
    a, b = (timeline(net, loops=n, exits=e, sync_loops=s) for n, e, s in plans)
    assert a == b
    # dispatch + combine, forward and backward (4 events) of the prelude, every core layer on each of the
    # sync_loops passes and the coda once per exit; recompute: pass adds a no-grad forward of each core call (2)
    core_calls = len(net.core_layers()) * plans[0][2]
    assert len(a) == 4 * (1 + len(plans[0][1])) + (6 if recompute == "pass" else 4) * core_calls, a
    assert [t for t in a if t.startswith("coda")], a


def test_pipeline_with_moe_edge_layers_refuses_telescopic_exits_under_expert_parallelism():
    """The pipeline computes an extra exit's coda in the chunk of its pass, which members of an expert-parallel
    group with different telescopic exits reach at different points: refused in one line, naming the fixes."""
    from elastic_pretrain.config import ConfigError
    from elastic_pretrain.job_loader import load_job
    from tests.conftest import REPO

    job = REPO / "jobs" / "tiny-cpu.yaml"
    pp_ep = [
        "parallel=cpu-pp2",
        "parallel.expert=2",
        "model.edge_mlp=moe",
        "schedule.sampler=telescopic",
        "model.loop_conditioning=false",
        "model.flatten=1",
    ]
    with pytest.raises(
        ConfigError,
        match=r"model.edge_mlp=moe with parallel.pipeline > 1 and parallel.expert > 1.*"
        r"use model.edge_mlp=dense, parallel.pipeline=1, or a sampler",
    ):
        load_job(job, pp_ep)
    for fix in ("model.edge_mlp=dense", "parallel.expert=1", "schedule.sampler=independent_rank"):
        load_job(job, [*pp_ep, fix])  # each fix is accepted
