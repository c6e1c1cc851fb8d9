"""``init_unused_passes: copy_pass0`` with a bf16 model: the copy reaches the optimizer's fp32 main
parameters of exactly the copied parameters (whole, or this rank's shard under the distributed
optimizer), and every other main parameter keeps its fp32 bits."""

from __future__ import annotations

import pytest
import torch

from elastic_pretrain.job_loader import load_job
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.train.idle import copy_to_main_params
from elastic_pretrain.train.session import build_optimizer, wrap_ddp
from tests.conftest import REPO


def _main(p: torch.nn.Parameter) -> torch.Tensor:
    return p.main_param.detach().view(-1).clone()


@pytest.mark.parametrize("distributed", [False, True])
def test_copy_pass0_reaches_the_bf16_main_params_of_the_copied_passes_only(mesh1, distributed):
    job = load_job(
        REPO / "jobs" / "tiny-cpu.yaml",
        ["parallel=single", "model.dtype=bf16", f"train.distributed_optimizer={str(distributed).lower()}"],
    )
    net = build_model(job.model, job.parallel)
    optimizer, _ = build_optimizer(job, wrap_ddp(job, net))
    core = net.core_layers()[0]
    # fp32 parameters (norms) are their own main parameters; bf16 ones have an fp32 copy
    params0 = dict(core.full_layer.named_parameters())
    for p in params0.values():  # fp32 bits below bf16's resolution, as training leaves them
        if hasattr(p, "main_param"):
            p.main_param.data.add_(1e-6)
    pass0 = {n: _main(p) for n, p in params0.items() if hasattr(p, "main_param")}
    later = [p for j in range(1, job.model.max_loops) for p in core.passes[j].parameters()]
    assert any(p.dtype == torch.bfloat16 and p.main_param.dtype == torch.float32 for p in later)
    written = net.init_unused_passes(range(1, job.model.max_loops))
    bf16 = [p for p in written if hasattr(p, "main_param")]
    assert any(not torch.equal(_main(p), p.detach().float().view(-1)) for p in bf16)  # stale before the sync
    copy_to_main_params(optimizer, written)
    for p in bf16:
        assert torch.equal(_main(p), p.detach().float().view(-1))
    # pass 0's own main parameters keep their fp32 values (a blanket reload from bf16 would round them)
    assert all(torch.equal(_main(params0[n]), v) for n, v in pass0.items())
    assert any(not torch.equal(v, params0[n].detach().float().view(-1)) for n, v in pass0.items())
