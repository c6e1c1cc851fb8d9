"""Honest MFU (train/mfu.py): named peaks per GPU model, the override, exits, ghost passes, recompute,
and the global (not rank-0) depth of a step."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic_pretrain.config import ConfigError
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.model.flops import flops_per_token, moe_mlp_flops
from elastic_pretrain.train.config import TrainConfig
from elastic_pretrain.train.mfu import DepthCounts, device_peak, step_flops, utilisation
from tests.conftest import REPO, torchrun

CFG = ModelConfig(
    hidden_size=64,
    num_heads=4,
    ffn_hidden_size=128,
    prelude_layers=1,
    coda_layers=1,
    core_layers=2,
    num_experts=4,
    loops=2,
    flatten=2,
    moe_top_k=2,
    moe_ffn_hidden_size=32,
)
SEQ = 128


@pytest.mark.parametrize(
    ("name", "precision", "tflops", "label"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989, "H100 SXM bf16"),
        ("NVIDIA H100 80GB HBM3", "fp8", 1979, "H100 SXM fp8"),
        ("NVIDIA H100 PCIe", "bf16", 756, "H100 PCIe bf16"),
        ("NVIDIA H100 NVL", "bf16", 835, "H100 NVL bf16"),
        ("NVIDIA H100 NVL", "fp8", 1671, "H100 NVL fp8"),
        ("NVIDIA H200", "bf16", 989, "H200 SXM bf16"),
        ("NVIDIA H200 NVL", "bf16", 835, "H200 NVL bf16"),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312, "A100 bf16"),
        ("NVIDIA A100-SXM4-80GB", "fp8", 312, "A100 bf16"),  # no FP8 tensor cores: the bf16 peak
        ("NVIDIA B200", "bf16", 2250, "B200 bf16"),
        ("NVIDIA B200", "fp8", 4500, "B200 fp8"),
    ],
)
def test_peak_table_tells_gpu_models_apart(name, precision, tflops, label):
    peak, text = device_peak(None, precision=precision, device_name=name)
    assert peak == tflops * 1e12
    assert label in text and "dense" in text


def test_unknown_device_has_no_peak_and_the_override_wins():
    assert device_peak(None, device_name="NVIDIA GeForce RTX 4090") is None
    peak, text = device_peak(400.0, device_name="NVIDIA H100 80GB HBM3")
    assert peak == 400e12 and "train.peak_tflops" in text


def test_peak_tflops_config():
    assert TrainConfig(steps=100, peak_tflops=989).peak_tflops == 989
    with pytest.raises(ConfigError, match="peak_tflops"):
        TrainConfig(steps=100, peak_tflops=0)
    with pytest.raises(ConfigError, match="keep peak_tflops only"):
        TrainConfig(steps=100, peak_tflops=989, peak_flops_per_s=1e12)


def test_one_exit_matches_the_forward_formula_times_three():
    for ell in (1, 3, 4):
        flops = step_flops(CFG, DepthCounts(loops=ell, exits=1, ghost_passes=0), seq_len=SEQ, micro_batch_tokens=512)
        assert flops.model == pytest.approx(3 * flops_per_token(CFG, ell, seq_len=SEQ), rel=1e-12)
        assert flops.hardware == flops.model and flops.ghost_pass_fraction == 0


def test_every_supervised_exit_counts_its_coda_and_output_layer():
    one = step_flops(CFG, DepthCounts(loops=4, exits=1, ghost_passes=0), seq_len=SEQ, micro_batch_tokens=512)
    two = step_flops(CFG, DepthCounts(loops=4, exits=2, ghost_passes=0), seq_len=SEQ, micro_batch_tokens=512)
    no_coda = dataclasses.replace(CFG, coda_layers=0)
    head = flops_per_token(CFG, 0, seq_len=SEQ) - flops_per_token(no_coda, 0, seq_len=SEQ)  # one coda layer
    head += 2 * CFG.hidden_size * 384  # output layer at the padded vocabulary (257 -> 384)
    assert two.model - one.model == pytest.approx(3 * head, rel=1e-12)


def test_ghost_passes_are_hardware_flops_and_reported_apart():
    plain = step_flops(CFG, DepthCounts(loops=2, exits=1, ghost_passes=0), seq_len=SEQ, micro_batch_tokens=512)
    ghost = step_flops(CFG, DepthCounts(loops=2, exits=1, ghost_passes=2), seq_len=SEQ, micro_batch_tokens=512)
    assert ghost.model == plain.model  # the model needed nothing more
    # one token through each core layer's MoE per ghost pass, forward + backward, spread over 512 tokens
    assert ghost.hardware - ghost.model == pytest.approx(3 * 2 * CFG.core_layers_built * moe_mlp_flops(CFG) / 512)
    assert ghost.ghost_pass_fraction == 0.5
    u = utilisation(ghost, tokens_per_s=1000.0, devices=2, peak_flops_per_s=1e9)
    assert u["mfu"] == pytest.approx(500 * ghost.model / 1e9) and u["hfu"] > u["mfu"]
    assert u["ghost_pass_fraction"] == 0.5


def test_recompute_counts_as_hardware_not_model_flops():
    depth = DepthCounts(loops=3, exits=1, ghost_passes=0)
    none = step_flops(CFG, depth, seq_len=SEQ, micro_batch_tokens=512, recompute="none")
    per_pass = step_flops(CFG, depth, seq_len=SEQ, micro_batch_tokens=512, recompute="pass")
    selective = step_flops(CFG, depth, seq_len=SEQ, micro_batch_tokens=512, recompute="selective")
    assert per_pass.model == selective.model == none.model
    one_pass = flops_per_token(CFG, 1, seq_len=SEQ) - flops_per_token(CFG, 0, seq_len=SEQ)
    assert per_pass.hardware - none.hardware == pytest.approx(3 * one_pass)  # each core pass once more
    attentions = CFG.prelude_layers + 3 * CFG.core_layers_built + CFG.coda_layers
    assert selective.hardware - none.hardware == pytest.approx(attentions * 4 * (SEQ + 1) / 2 * CFG.hidden_size)


def test_depth_is_the_global_mean_over_replicas():
    """2 ranks (EP=2, DP=2) with different ℓ per replica: every rank reports the global means."""
    proc = torchrun(REPO / "tests" / "dist" / "depth_counts.py", nproc=2, timeout=300)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DEPTH "))
    per_rank = json.loads(line[len("DEPTH ") :])
    # replica 0: ℓ = 1, 3 (exits 1 + 2); replica 1: ℓ = 4, 2 (exits 1 + 2). EP max per micro-batch: 4, 3
    # → ghost passes 3 + 0 on rank 0, 0 + 1 on rank 1
    assert per_rank == [[2.5, 1.5, 1.0], [2.5, 1.5, 1.0]]


def test_depth_efficiency_and_ghost_time_share():
    from elastic_pretrain.train.mfu import ghost_time_share

    none = DepthCounts(loops=2.5, exits=1, ghost_passes=0)
    some = DepthCounts(loops=2.5, exits=1, ghost_passes=1.5)
    assert none.efficiency == 1.0 and some.efficiency == pytest.approx(2.5 / 4)
    assert DepthCounts(loops=0, exits=0, ghost_passes=0).efficiency == 1.0
    assert ghost_time_share(CFG, none, seq_len=SEQ) == 0.0
    share = ghost_time_share(CFG, some, seq_len=SEQ)
    # a ghost pass costs one real pass's time: the share of 1.5 passes in the step's executed work
    one_pass = flops_per_token(CFG, 1, seq_len=SEQ) - flops_per_token(CFG, 0, seq_len=SEQ)
    all_real = DepthCounts(loops=4, exits=1, ghost_passes=0)  # 2.5 + 1.5 passes, one exit
    executed = step_flops(CFG, all_real, seq_len=SEQ, micro_batch_tokens=1).model / 3
    assert share == pytest.approx(1.5 * one_pass / executed)
    assert 0 < share < 1 - some.efficiency  # prelude, coda and output layer are not idle


def test_training_flops_relative_to_the_non_looped_baseline():
    """The baseline is the same model at ℓ = 1 with one exit, on the same tokens (ELR's compute ratio)."""
    from elastic_pretrain.train.mfu import baseline_flops_per_token
    from elastic_pretrain.train.trainer import TrainState

    job = load_job(REPO / "jobs" / "tiny-cpu.yaml")
    cfg, seq = job.model, job.data.seq_len
    base = baseline_flops_per_token(cfg, seq_len=seq)
    per_token = {
        ell: step_flops(cfg, DepthCounts(loops=ell, exits=1, ghost_passes=0), seq_len=seq, micro_batch_tokens=seq).model
        for ell in (1, 4)
    }
    assert per_token[1] == base and 1.0 < per_token[4] / base < 4.0  # prelude, coda and head are paid once
    # ELR's late switch from one loop: 3/4 of the tokens at ℓ = 1, then (here) ℓ = 4
    state = TrainState(tokens=400, train_flops=300 * per_token[1] + 100 * per_token[4])
    assert state.flops_vs_baseline(job) == pytest.approx(0.75 + 0.25 * per_token[4] / base)
    # resumed from a checkpoint written before the count existed: no ratio rather than a wrong one
    old = TrainState()
    old.load_state_dict({"step": 3, "tokens": 300, "elapsed_s": 1.0})
    assert old.train_flops is None and old.flops_vs_baseline(job) is None
    assert TrainState().flops_vs_baseline(job) is None
