"""The memory estimate (parallel/memory.py) against the built model: parameter counts exact, bytes
saved for backward (local spec, counted with saved_tensors_hooks) within 15% at shapes it was not
fitted on, recompute modes ordered as they must be; torch-free; the ``estimate`` command."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from elastic_pretrain.config import ConfigError, parse_bytes
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.model.config import DeciderConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.memory import (
    NCCL_BUFFSIZE,
    NCCL_CHANNELS,
    estimate_memory,
    largest_micro_batch,
)
from tests.conftest import REPO, VENV_BIN

JOB = REPO / "jobs" / "tiny-cpu.yaml"


def job_1rank(*overrides: str):
    return load_job(JOB, ["parallel=single", *overrides])


def test_estimate_imports_no_torch():
    code = (
        "import sys; from elastic_pretrain.job_loader import load_job; "
        "from elastic_pretrain.parallel.memory import estimate_memory; "
        "estimate_memory(load_job('jobs/tiny-cpu.yaml', []), 2).lines(); "
        "heavy = [m for m in ('torch', 'megatron') if m in sys.modules]; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.normalization=LayerNorm", "model.attention=tied"),
        ("model.edge_mlp=moe", "model.loop_conditioning=false", "model.tie_embeddings=true", "model.vocab_size=300"),
        ("model.dtype=bf16", "model.flatten=1", "model.prelude_layers=0"),
        ("decider",),
    ],
    ids=["tiny-cpu", "layernorm-tied", "moe-edges-tied-embeddings", "bf16-unflattened", "decider"],
)
def test_parameter_counts_and_bytes_are_exact(mesh1, overrides):
    job = job_1rank(*[o for o in overrides if o != "decider"])
    if "decider" in overrides:
        job = dataclasses.replace(job, decider=DeciderConfig(hidden_size=24))
    net = build_model(job.model, job.parallel, decider=job.decider)
    stage = estimate_memory(job, 1, spec="local").stages[0]
    assert stage.params == sum(p.numel() for p in net.parameters())
    assert stage.param_bytes == sum(p.numel() * p.element_size() for p in net.parameters())
    assert stage.grad_bytes == 4 * stage.params  # megatron DDP: fp32 gradient buffer
    assert stage.optimizer_bytes == (12 if job.model.dtype == "bf16" else 8) * stage.params  # one DP rank


def test_expert_parallel_splits_experts_and_data_parallel_shards_optimizer_state():
    one = estimate_memory(load_job(JOB, ["parallel=single"]), 1).stages[0]
    two = estimate_memory(load_job(JOB, []), 2).stages[0]  # cpu-ep2: 2 ranks, DP 2, EP 2
    job = load_job(JOB, [])
    experts = (
        job.model.core_layers_built
        * job.model.experts_built
        * 3
        * job.model.hidden_size
        * job.model.moe_ffn_hidden_size
    )
    assert one.params - two.params == experts // 2
    dense = two.params - experts // 2
    assert two.optimizer_bytes == 8 * (-(-dense // 2) + experts // 2)  # dense over DP 2; experts over EDP 1


def saved_bytes(job, loops: int, recompute: str) -> int:
    torch.manual_seed(0)
    net = build_model(job.model, job.parallel, recompute=recompute).train()
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    b, s = job.train.micro_batch_size, job.data.seq_len
    tokens = torch.randint(0, job.model.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(1))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(tokens[:, :-1], labels=tokens[:, 1:], loops=loops)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_estimate_matches_saved_bytes_within_15_percent(mesh1, dtype):
    """The tiny-cpu shape (not among the fitted ones) at seq 40, micro-batch 3."""
    job = job_1rank(f"model.dtype={dtype}", "data.seq_len=40", "train.micro_batch_size=3", "train.global_batch_size=3")
    est = estimate_memory(job, 1, spec="local").stages[0].activation_bytes
    none = {ell: saved_bytes(job, ell, "none") for ell in (1, 2, 4)}
    one_pass = none[2] - none[1]  # the pass being recomputed is live again during its backward
    for ell in (1, 2, 4):
        assert est["none"][ell] == pytest.approx(none[ell], rel=0.15)
        assert est["pass"][ell] == pytest.approx(saved_bytes(job, ell, "pass") + one_pass, rel=0.15)
    assert est["selective"][4] < est["none"][4]


def test_recompute_modes_order_and_largest_micro_batch_fits():
    job = load_job(JOB, ["model.hidden_size=1024", "model.num_heads=16", "data.seq_len=2048", "model.dtype=bf16"])
    est = estimate_memory(job, 2)
    acts = est.stages[0].activation_bytes
    assert acts["pass"][4] < acts["selective"][4] < acts["none"][4]
    assert acts["none"][4] - acts["none"][3] > 10 * (acts["pass"][4] - acts["pass"][3])  # ~flat in ℓ
    gpu = parse_bytes("8GiB")
    for mode in ("none", "pass"):
        n = largest_micro_batch(job, 2, gpu, recompute=mode)
        assert n >= 1
        assert estimate_memory(job, 2, micro_batch_size=n).peak(mode) <= 0.9 * gpu
        assert estimate_memory(job, 2, micro_batch_size=n + 1).peak(mode) > 0.9 * gpu
    assert largest_micro_batch(job, 2, gpu, recompute="pass") > largest_micro_batch(job, 2, gpu, recompute="none")


GPU16 = REPO / "jobs" / "gpu-16node.yaml"  # DP 128, EP 8 (expert-DP 16), TP 1, PP 1, bf16, nccl


def test_routing_imbalance_scales_the_expert_activations_of_the_most_loaded_rank():
    """The hand count at 16 nodes: N = 2 x 4096 tokens, k 4, D 2048, F 1408, 8 core layers, bf16. At MaxVio v
    the most loaded EP rank keeps v x (N·k·D + 3·N·k·F) more bytes per (core layer, pass): the fc1 input, the fc1
    output (2F) and the SwiGLU output (F) of its experts' tokens."""
    job = load_job(GPU16)
    per_layer_pass = 2 * 8192 * 4 * (2048 + 3 * 1408)
    for v in (0.5, 1.0):
        st = estimate_memory(job, 128, maxvio=v).stages[0]
        assert st.imbalance_bytes["none"] == {ell: v * ell * 8 * per_layer_pass for ell in (1, 2, 3, 4)}
        assert st.imbalance_bytes["pass"] == {ell: v * 8 * per_layer_pass for ell in (1, 2, 3, 4)}  # one pass live
        assert st.total(4, "none") == (
            st.static_bytes
            + st.activation_bytes["none"][4]
            + st.imbalance_bytes["none"][4]
            + st.dispatch_bytes
            + st.nccl_bytes
        )
    # zero where it must be: a balanced router, or EP 1 (one rank holds every token whatever the routing)
    balanced = estimate_memory(job, 128, maxvio=0).stages[0]
    assert all(b == 0 for acts in balanced.imbalance_bytes.values() for b in acts.values())
    assert balanced.activation_bytes == estimate_memory(job, 128).stages[0].activation_bytes
    ep1 = estimate_memory(load_job(GPU16, ["parallel.expert=1"]), 128, maxvio=3.0).stages[0]
    assert all(b == 0 for acts in ep1.imbalance_bytes.values() for b in acts.values())
    # a rank receives at most every rank's tokens: the load factor stops at EP
    assert estimate_memory(job, 128, maxvio=20).stages[0].imbalance_bytes["none"][1] == 7 * 8 * per_layer_pass
    with pytest.raises(ConfigError, match="maxvio: must be >= 0"):
        estimate_memory(job, 128, maxvio=-0.1)


def test_communication_buffers_all_to_all_and_nccl():
    job = load_job(GPU16)
    st = estimate_memory(job, 128, maxvio=0.5).stages[0]
    # the dispatcher's send buffer (N·k·D) and receive buffer (1.5 x N·k·D on the most loaded rank), bf16
    assert st.dispatch_bytes == 2 * 8192 * 4 * 2048 * (1 + 1.5) == 320 * 2**20
    # 4 MiB x 16 channels x peers: rings over world 128, DP 128, expert-DP 16 (2 peers each) + all-to-all over EP 8
    assert st.nccl_bytes == NCCL_BUFFSIZE * NCCL_CHANNELS * (2 + 2 + 2 + 7) == 832 * 2**20
    assert estimate_memory(job, 128, maxvio=0).stages[0].dispatch_bytes == 2 * 8192 * 4 * 2048 * 2
    ep1 = estimate_memory(load_job(GPU16, ["parallel.expert=1"]), 128).stages[0]
    assert ep1.dispatch_bytes == 0 and ep1.nccl_bytes == NCCL_BUFFSIZE * NCCL_CHANNELS * (2 + 2 + 2)
    gloo = estimate_memory(load_job(JOB, []), 2, spec="local").stages[0]  # tiny-cpu: EP 2 over gloo
    assert gloo.nccl_bytes == 0 and gloo.dispatch_bytes > 0


def test_pipeline_stages_are_estimated_separately():
    est = estimate_memory(load_job(JOB, ["parallel=cpu-pp2", "model.flatten=1"]), 2)
    assert [st.stage for st in est.stages] == [0, 1]
    assert est.stages[0].params != est.stages[1].params  # embedding vs output layer + final norm


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30 == parse_bytes("80G")
    assert parse_bytes("141GB") == 141 * 10**9
    assert parse_bytes("1.5TiB") == int(1.5 * 2**40)
    with pytest.raises(ConfigError, match="80GiB"):
        parse_bytes("lots")


def test_estimate_command():
    cli = str(VENV_BIN / "elastic-pretrain")
    proc = subprocess.run(
        [cli, "estimate", "jobs/tiny-cpu.yaml", "--world-size", "2", "--gpu-memory", "16GiB", "train.recompute=pass"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "stage 0:" in proc.stdout and "largest micro-batch that fits 16GiB" in proc.stdout
    assert "train.recompute=pass" in proc.stdout
    assert "imbalance " in proc.stdout and "MaxVio 0.5" in proc.stdout and "all-to-all " in proc.stdout
    neg = subprocess.run(
        [cli, "estimate", "jobs/tiny-cpu.yaml", "--maxvio", "-1"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert neg.returncode == 2 and neg.stderr.strip().endswith("got -1.0") and "--maxvio" in neg.stderr
    bad = subprocess.run(
        [cli, "estimate", "jobs/tiny-cpu.yaml", "--world-size", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "parallel.expert" in bad.stderr
