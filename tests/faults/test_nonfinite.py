"""Non-finite losses and spikes (train/faults.py): each policy's exact effect on the saved state.

Faults are injected through ``ELASTIC_PRETRAIN_INJECT`` (test-only): ``nonfinite:<step>`` makes that
step's loss and gradient norm NaN, ``spike:<step>`` reports its loss 3x higher. Every run is the tiny
job in one process; the checkpoints saved around the injected step are compared bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_pretrain.config import ConfigError
from elastic_pretrain.errors import UserError
from elastic_pretrain.train.config import SpikeConfig
from elastic_pretrain.train.faults import Injection, SpikeDetector
from tests.checkpoint.runs import differing, tensors, train

SPIKE = ["train.spike.window=2", "train.spike.sigmas=3", "train.spike.min_rise=0.2"]


def _meta(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step_{step}" / "trainer.json").read_text())


def test_spike_detector_flags_rises_over_the_window_and_resumes_from_its_state():
    d = SpikeDetector(window=3, sigmas=3.0, min_rise=0.1)
    assert not d.is_spike(100.0)  # the window is not full yet
    for loss in (5.0, 4.9, 5.1):
        d.accept(loss)
    assert d.is_spike(6.0) and not d.is_spike(5.3) and not d.is_spike(1.0)  # rises only, over the noise floor
    again = SpikeDetector(window=3, sigmas=3.0, min_rise=0.1)
    again.load_state_dict(json.loads(json.dumps(d.state_dict())))
    assert list(again.losses) == [5.0, 4.9, 5.1] and again.is_spike(6.0)
    d.accept(5.0)  # the window trails: the oldest loss leaves
    assert list(d.losses) == [4.9, 5.1, 5.0]


def test_injection_spec_and_config_errors_are_one_line():
    assert Injection.parse("nonfinite:3, hang:4:1 ,slow:1:0:0.5") == [
        Injection("nonfinite", 3, None, 0.0), Injection("hang", 4, 1, 0.0), Injection("slow", 1, 0, 0.5)]  # fmt: skip
    with pytest.raises(UserError, match="<kind>:<step>"):
        Injection.parse("nan:3")
    with pytest.raises(ConfigError, match="window"):
        SpikeConfig(window=1)


@pytest.mark.slow
def test_skip_leaves_parameters_adam_state_and_schedule_untouched(tmp_path, prepared):
    run = tmp_path / "skip"
    proc = train(run, 1, "train.steps=6", "checkpoint.interval=1", "checkpoint.keep_last=10",
                 "train.spike.policy=skip", *SPIKE, env={"ELASTIC_PRETRAIN_INJECT": "nonfinite:3,spike:5"})  # fmt: skip
    assert "fault at step 3: non-finite loss nan" in proc.stdout
    assert "fault at step 5: loss spike" in proc.stdout
    t = {s: tensors(run / "checkpoints" / f"step_{s}", tmp_path / f"{s}.pt") for s in (2, 3, 4, 5)}
    assert differing(t[2], t[3]) == [] and differing(t[4], t[5]) == []  # skipped: model and Adam bitwise equal
    assert differing(t[3], t[4])  # a step that was not skipped changes them
    m = {s: _meta(run, s) for s in (2, 3, 4, 5)}
    assert m[3]["adam_step"] == m[2]["adam_step"] and m[3]["scheduler"] == m[2]["scheduler"]
    assert m[5]["adam_step"] == m[4]["adam_step"] and m[5]["scheduler"] == m[4]["scheduler"]
    assert m[3]["data"]["position"] == m[2]["data"]["position"] + 16  # the skipped batch is consumed
    assert m[5]["faults"]["counts"] == {"nonfinite": 1, "spike": 1, "rollback": 0}
    assert len(m[5]["faults"]["spike"]["losses"]) == 2  # the window resumes with the checkpoint


@pytest.mark.slow
def test_rollback_reloads_the_checkpoint_and_skips_the_data_window(tmp_path, prepared):
    run = tmp_path / "rollback"
    proc = train(run, 1, "train.steps=6", "checkpoint.interval=2", "checkpoint.keep_last=10",
                 "train.on_nonfinite=rollback", env={"ELASTIC_PRETRAIN_INJECT": "nonfinite:5"})  # fmt: skip
    assert "rolled back to step 4 (step_4); skipping the data of steps 5..5" in proc.stdout
    m4, m6 = _meta(run, 4), _meta(run, 6)
    # steps 5 and 6 were trained again on the batches after the one that failed: 3 batches past step 4
    assert m6["data"]["position"] == m4["data"]["position"] + 3 * 16
    assert m6["trainer"]["step"] == 6 and m6["faults"]["counts"]["rollback"] == 1
    assert m6["scheduler"]["num_steps"] == m4["scheduler"]["num_steps"] + 2
    history = [json.loads(line)["step"] for line in (run / "history.jsonl").read_text().splitlines()]
    assert history == [1, 2, 3, 4, 5, 6]  # the rolled-back step's line is gone


@pytest.mark.slow
def test_stop_policy_and_consecutive_events_stop_with_a_one_line_reason(tmp_path, prepared):
    proc = train(tmp_path / "stop", 1, "train.steps=4", "train.on_nonfinite=stop",
                 env={"ELASTIC_PRETRAIN_INJECT": "nonfinite:2"}, expect=2)  # fmt: skip
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("elastic-pretrain train: error: stopped at step 2 by train.on_nonfinite=stop: non-finite")
    assert not (tmp_path / "stop" / "FINISHED").exists()
    proc = train(tmp_path / "many", 1, "train.steps=5", "train.max_consecutive_faults=2",
                 env={"ELASTIC_PRETRAIN_INJECT": "nonfinite:2,nonfinite:3"}, expect=2)  # fmt: skip
    assert "stopped at step 3: 2 non-finite/spike events in a row (train.max_consecutive_faults=2)" in proc.stderr


def test_guarded_step_updates_exactly_as_megatrons_optimizer_step(mesh1, prepared):
    """The veto path (prepare_grads, norm, veto, clip, step_with_ready_grads) is bitwise megatron's step()."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.parallel.mesh import seed_everything
    from elastic_pretrain.parallel.pipeline import MicroBatch
    from elastic_pretrain.train.session import build_session
    from tests.conftest import REPO

    # megatron keeps the aux-loss scale in a class attribute; an earlier test in this process may have left
    # one of another shape (copy_ then fails): start from none, as a fresh training process does
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    overrides = ["parallel=single", "train.eval_sequences=4", "train.clip_grad=0.5"]
    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", overrides)
    sessions = []
    for _ in range(2):
        seed_everything(7)
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        sessions.append(build_session(job, mesh1))
    plain, guarded = sessions
    vetoes: list[tuple[bool, float, float]] = []
    guarded.step.veto = lambda found_inf, norm, loss: vetoes.append((found_inf, norm, loss)) is not None
    before = {k: p.detach().clone() for k, p in plain.net.named_parameters()}
    plan = plain.controller.plan(step=0, micro=0, replica=0)
    for _ in range(2):  # the first step runs at lr 0 (warmup starts there)
        tokens = plain.batches.next_step()
        results = [s.step([MicroBatch(t, plan) for t in tokens]) for s in (plain, guarded)]
    assert len(vetoes) == 2 and vetoes[1][1] == results[0].grad_norm > 0.5  # clipping was active
    assert results[0].loss == results[1].loss and results[1].skipped is False
    a, b = (dict(s.net.named_parameters()) for s in sessions)
    assert all(torch.equal(a[k], b[k]) for k in a) and any(not torch.equal(a[k], before[k]) for k in a)
