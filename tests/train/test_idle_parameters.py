"""Parameters the current phase never runs stay out of the optimizer step (train/idle.py).

Before ELR's switch the loop-conditioning heads are off and untied passes 1.. never run: their gradients are
zero. Two twins — the same late-switch job with and without heads — must then train alike to the last bit, and
the idle parameters must meet the switch as they were initialised. Before the fix megatron's gradient norm
counted the heads' zero gradients (regrouping its vectorised sum, so the clip factor differed in the last bit)
and AdamW decayed every idle parameter towards zero. ``train.clip_grad`` is set small so every step clips: the
norm's bits reach every parameter. Run through the real trainer loop under each optimizer megatron builds here
(distributed fp32, replicated fp32, replicated bf16 with fp32 main copies) and under the stand-in for
Transformer Engine's FusedAdam (its step in the param group, tests/checkpoint/test_group_step_adam.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint.conftest import prepared  # noqa: F401  (the default job's shards)
from tests.checkpoint.test_group_step_adam import GroupStepAdam, group_step_adam  # noqa: F401
from tests.checkpoint.test_group_step_adam import _fit as fit
from tests.conftest import REPO

STEPS, SWITCH = 8, 6  # switch_at 0.75 of 8 steps: the mixed phase (heads on) starts at step 7


def _job(run_dir: Path, *overrides: str) -> Any:
    from elastic_pretrain.job_loader import load_job

    return load_job(REPO / "jobs" / "tiny-cpu.yaml",
                    ["parallel=single", "tracking.backend=none", f"train.steps={STEPS}", "train.warmup_steps=2",
                     "train.clip_grad=0.001", "train.eval_interval=0", "train.eval_sequences=4",
                     "checkpoint.interval=0", *overrides],
                    values={"run_dir": str(run_dir)})  # fmt: skip


def _fit(job: Any, mesh: Any) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """The trainer's loop on a fresh session: (loss per step, parameters before, parameters after, session)."""
    before: dict[str, torch.Tensor] = {}
    losses, after, session = fit(job, mesh, before=before)
    return losses, before, after, session


OPTIMIZERS = {
    "distributed-fp32": (),
    "replicated-fp32": ("train.distributed_optimizer=false",),
    "replicated-bf16": ("train.distributed_optimizer=false", "model.dtype=bf16"),
    "te-fused-adam": (),
}


@pytest.mark.usefixtures("prepared")
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_twins_with_and_without_heads_step_alike_until_the_switch(
    mesh1: Any, tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "te-fused-adam":
        request.getfixturevalue("group_step_adam")
    over = OPTIMIZERS[kind]
    heads, init, final, session = _fit(_job(tmp_path / "heads", *over), mesh1)
    twin, twin_init, twin_final, _ = _fit(_job(tmp_path / "twin", "model.loop_conditioning=false", *over),
                                                     mesh1)  # fmt: skip
    if kind == "te-fused-adam":
        assert isinstance(session.optimizer.chained_optimizers[0].optimizer, GroupStepAdam)
    assert session.controller.switch_step == SWITCH
    assert all(torch.equal(init[k], v) for k, v in twin_init.items())  # paired initialisation
    # identical until the switch, bitwise (the switch step's loss too: the heads' output layer starts at zero)
    assert heads[: SWITCH + 1] == twin[: SWITCH + 1]
    heads_names = [k for k in final if "loop_conditioning" in k]
    assert len(heads_names) == 3 and set(final) - set(twin_final) == set(heads_names)
    # after the switch the heads learn: their output layer leaves zero, and the pair parts
    out = next(k for k in heads_names if k.endswith("out.weight"))
    assert not torch.equal(init[out], final[out]) and torch.count_nonzero(init[out]) == 0
    assert heads[SWITCH + 1 :] != twin[SWITCH + 1 :]


@pytest.mark.usefixtures("prepared")
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_idle_parameters_meet_the_switch_as_initialised_and_outside_the_norm(
    mesh1: Any, tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    """Stopped before the switch: the heads and passes 1.. are bitwise their initialisation (AdamW's decay would
    have shrunk them), their Adam moments zero, and the norm megatron computes leaves their gradients out."""
    from elastic_pretrain.checkpoint import optim_state
    from elastic_pretrain.train.idle import main_copies

    if kind == "te-fused-adam":
        request.getfixturevalue("group_step_adam")
    over = OPTIMIZERS[kind]
    _, init, final, session = _fit(_job(tmp_path / "run", "schedule.switch_at=0.99", *over), mesh1)
    assert not session.controller.mixed and session.controller.fixed_loops == 1
    idle = session.net.idle_parameters(passes_run=1)
    names = {id(p): k for k, p in session.net.named_parameters()}
    idle_names = {names[id(p)] for p in idle}
    assert {k for k in idle_names if "loop_conditioning" in k} == {k for k in final if "loop_conditioning" in k}
    assert any(".passes.1." in k for k in idle_names) and not any(".passes.0." in k for k in idle_names)
    assert session.step.idle.params() == idle  # the session's phase: one pass
    for k in idle_names:
        assert torch.equal(final[k], init[k]), k
    for p in idle:  # the optimizer's own copies too (fp32 main copies of a bf16 model)
        for opt in optim_state.optimizers(session.optimizer):
            for m in main_copies(opt, [p]):
                assert torch.equal(m.detach().view(-1), init[names[id(p)]].view(-1).to(m.dtype)), names[id(p)]
    running = [k for k in final if k not in idle_names and final[k].dtype.is_floating_point]
    assert sum(not torch.equal(final[k], init[k]) for k in running) > len(running) // 2  # the rest trained
    for opt in optim_state.optimizers(session.optimizer):
        mains = main_copies(opt, idle)
        assert mains  # one process holds every parameter
        for m in mains:
            state = opt.optimizer.state.get(m, {})
            for name in ("exp_avg", "exp_avg_sq"):
                assert name not in state or torch.count_nonzero(state[name]) == 0
        # the last step's gradients are still in place: the norm's list holds none of the idle ones
        assert any(m.grad is not None for m in mains)
        listed = {id(g) for g in opt.get_main_grads_for_grad_norm()}
        assert not listed & {id(m.grad) for m in mains if m.grad is not None}
        assert len(listed) == len(opt.get_main_grads_for_grad_norm())
