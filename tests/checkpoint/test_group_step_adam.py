"""Adam's step survives a resume wherever the optimizer keeps it (issue 30, item 1; docs/gpu.md).

On CUDA megatron builds Transformer Engine's ``FusedAdam``, which keeps the step in each param group
(``group["step"]``, a Python int, incremented before the update; groups without parameters never count)
and keeps no per-parameter ``step``. A checkpoint that saves only ``state[p]["step"]`` resumes it at 0: bias
correction restarts and the next updates are several times too large, with no error.

``GroupStepAdam`` reproduces that contract on CPU. It is put where megatron puts TE's class (its
``optimizer.Adam``, with ``USING_PYTORCH_OPTIMIZER`` false, as when TE imports), and the real trainer loop
saves (``checkpoint.stop_at``) and a fresh session resumes through the real checkpointer: the loss and the
parameters after the resume must equal the uninterrupted run's, bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_pretrain.checkpoint import optim_state
from elastic_pretrain.errors import UserError
from tests.conftest import REPO


class GroupStepAdam(torch.optim.Optimizer):
    """Adam(W) with TE FusedAdam's step contract (transformer_engine/pytorch/optimizers/fused_adam.py): the
    step in the param group, incremented before the update; only exp_avg and exp_avg_sq per parameter,
    made on the first step."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, bias_correction: bool = True,
                 adam_w_mode: bool = True, **_: Any) -> None:  # fmt: skip
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "bias_correction": bias_correction})  # fmt: skip
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            t, (b1, b2), lr = group["step"], group["betas"], group["lr"]
            c1, c2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                if p.grad is None:
                    continue
                g = p.grad if self.adam_w_mode else p.grad + group["weight_decay"] * p
                if self.adam_w_mode:
                    p.mul_(1 - lr * group["weight_decay"])
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                p.add_(-lr * (state["exp_avg"] / c1) / ((state["exp_avg_sq"] / c2).sqrt() + group["eps"]))


@pytest.fixture
def group_step_adam(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's optimizer module as it is when Transformer Engine imports, with the stand-in as TE's
    FusedAdam (megatron-core 0.16.1 ``optimizer/__init__.py`` and ``distrib_optimizer.py`` import it)."""
    from megatron.core import optimizer as mo
    from megatron.core.optimizer import distrib_optimizer as do

    monkeypatch.setattr(mo, "Adam", GroupStepAdam)
    monkeypatch.setattr(mo, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(mo, "is_te_min_version", lambda *a, **k: True)  # TE 2.x: store_param_remainders kwarg
    monkeypatch.setattr(do, "Adam", GroupStepAdam)
    monkeypatch.setattr(do, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(do, "USING_TE_OPTIMIZER", True)


def _fit(
    job: Any, mesh: Any, *, resume: Path | None = None, before: dict[str, torch.Tensor] | None = None
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    """The trainer's loop on a fresh session (resumed from ``resume``): (loss per step, parameters, session);
    ``before`` receives the parameters as built (tests/train/test_idle_parameters.py)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from elastic_pretrain.checkpoint.manager import Checkpointer
    from elastic_pretrain.checkpoint.preempt import StopRequest
    from elastic_pretrain.checkpoint.store import read_trainer_state
    from elastic_pretrain.job import public_dict
    from elastic_pretrain.parallel.mesh import seed_everything
    from elastic_pretrain.train.session import build_session
    from elastic_pretrain.train.trainer import Trainer, TrainState

    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # a class attribute: start as a fresh process does
    seed_everything(job.train.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(job.train.seed)
    session = build_session(job, mesh)
    if before is not None:
        before.update({k: p.detach().clone() for k, p in session.net.named_parameters()})
    state = TrainState()
    ckpt = Checkpointer(
        job.checkpoint,
        public_dict(job),
        mesh,
        job.run_path,
        session.tensors(),
        {"trainer": state, **session.checkpointed()},
    )
    if resume is not None:
        ckpt.restore(resume, read_trainer_state(resume))
    losses: list[float] = []

    class Record:
        def on_step(self, s: Any, result: Any, step_s: float) -> None:
            losses.append(result.loss)

        def on_eval(self, *a: Any) -> None: ...
        def on_end(self, *a: Any) -> None: ...
        def on_stop(self, *a: Any) -> None: ...
        def on_rollback(self, *a: Any) -> None: ...

    with StopRequest() as stop:
        Trainer(job, mesh, session, [Record()], ckpt, stop, state).fit()
    ckpt.close()
    return losses, {k: p.detach().clone() for k, p in session.net.named_parameters()}, session


def _job(run_dir: Path, *overrides: str) -> Any:
    from elastic_pretrain.job_loader import load_job

    return load_job(REPO / "jobs" / "tiny-cpu.yaml",
                    ["parallel=single", "tracking.backend=none", "train.steps=6", "train.warmup_steps=2",
                     "train.eval_interval=0", "train.eval_sequences=4", "checkpoint.interval=0", *overrides],
                    values={"run_dir": str(run_dir)})  # fmt: skip


@pytest.mark.parametrize("overrides", [(), ("train.distributed_optimizer=false", "model.dtype=bf16")],
                         ids=["distributed-fp32", "replicated-bf16"])  # fmt: skip
def test_resume_under_a_group_step_adam_equals_the_uninterrupted_run(
    mesh1, prepared, group_step_adam, tmp_path: Path, overrides: tuple[str, ...]
) -> None:
    full, final, session = _fit(_job(tmp_path / "full", *overrides), mesh1)
    inner = [o.optimizer for o in optim_state.optimizers(session.optimizer)]
    assert all(isinstance(o, GroupStepAdam) for o in inner)  # megatron built the stand-in, as it builds TE's
    assert all("step" not in s for o in inner for s in o.state.values())  # the contract: no per-parameter step
    assert {g["step"] for o in inner for g in o.param_groups if g["params"]} == {6}

    first, _, _ = _fit(_job(tmp_path / "split", "checkpoint.stop_at=3", *overrides), mesh1)  # saves, stops
    assert len(first) == 3
    job = _job(tmp_path / "split", *overrides)
    rest, resumed, session = _fit(job, mesh1, resume=job.run_path / "checkpoints" / "step_3")
    assert first + rest == full
    assert all(torch.equal(resumed[k], final[k]) for k in final)
    assert {g["step"] for o in optim_state.optimizers(session.optimizer) for g in o.optimizer.param_groups
            if g["params"]} == {6}  # fmt: skip


class StepElsewhere(torch.optim.Optimizer):
    """An optimizer that counts its steps in an attribute: no checkpoint can find the count."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        self.count = 0

    def step(self, closure: Any = None) -> None:
        self.count += 1
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["exp_avg"] = torch.zeros_like(p)


def test_an_optimizer_with_its_step_in_neither_place_is_refused_in_one_line() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = StepElsewhere([p])
    opt.step()
    with pytest.raises(UserError, match=r"^optimizer .*StepElsewhere keeps Adam's step neither in its param "
                                        r"groups nor in its per-parameter state") as err:  # fmt: skip
        optim_state.step_home(opt)
    assert "\n" not in str(err.value)


def test_the_step_goes_where_each_optimizer_keeps_it(group_step_adam) -> None:
    """A fresh optimizer (resume before any step) is told by its class; a stepped one by where the step is."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    fused = GroupStepAdam([{"params": [a]}, {"params": []}])
    torch_adam = torch.optim.Adam([b])
    assert optim_state.step_home(fused) == "group" and optim_state.step_home(torch_adam) == "state"
    for opt in (fused, torch_adam):
        wrapped = type("Wrapped", (), {"optimizer": opt})()
        optim_state.ensure_state(wrapped)
        optim_state.set_adam_step(wrapped, 5.0)
        assert optim_state.local_adam_step(wrapped) == 5.0
    assert fused.param_groups[0]["step"] == 5 and type(fused.param_groups[0]["step"]) is int
    assert "step" not in fused.param_groups[1] and "step" not in fused.state[a]  # empty groups never count
    assert torch_adam.state[b]["step"].item() == 5.0 and "step" not in torch_adam.param_groups[0]


def test_engine_conversion_reads_and_installs_a_group_step(mesh1, group_step_adam) -> None:
    """``convert-checkpoint`` (engine/full_state.py) carries the step through the same two functions."""
    from elastic_pretrain.engine.full_state import install_megatron, read_megatron
    from tests.dist.ckpt_reshard import build

    net, _, optimizer = build("single")
    optim_state.set_adam_step(optimizer, 4.0)
    state = read_megatron(net, optimizer)
    assert state.step == 4
    other_net, _, other = build("single")
    install_megatron(other_net, other, state)
    assert {g["step"] for o in optim_state.optimizers(other) for g in o.optimizer.param_groups if g["params"]} == {4}
