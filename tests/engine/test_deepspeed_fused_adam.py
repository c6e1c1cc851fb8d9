"""A DeepSpeed checkpoint written by torch's AdamW (CPU, offload, ``convert-checkpoint``) resumes under DeepSpeed's
FusedAdam (CUDA, issue 31 item 5), and the reverse, through the engine's own load (``DeepSpeedTensors.load``).

No GPU here: :class:`StandInFusedAdam` is ``deepspeed.ops.adam.FusedAdam`` of DeepSpeed 0.19.8 with its kernel
written in torch ops — the same constructor, param-group keys and per-parameter state (``state["step"]`` an
int started from ``group.get("step", 0)``, ``group["step"]`` set to 0 and never advanced, ``exp_avg``,
``exp_avg_sq``) and ``multi_tensor_adam``'s AdamW update. DeepSpeed builds it where it would build the real one
(``get_optimizer_configuration`` imports ``deepspeed.ops.adam.FusedAdam`` at call time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO

pytest.importorskip("deepspeed")


class StandInFusedAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            bias_correction = 1 if group["bias_correction"] else 0  # KeyError in a torch AdamW group
            beta1, beta2 = group["betas"]
            if "step" not in group:
                group["step"] = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = group.get("step", 0)
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                step = int(state["step"])  # the kernel's ``const int step`` (pybind converts a tensor too)
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                c1 = 1 - beta1**step if bias_correction else 1.0
                c2 = 1 - beta2**step if bias_correction else 1.0
                update = (m / c1) / ((v / c2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + group["weight_decay"] * p
                p.sub_(group["lr"] * update)


class _Wrapped(torch.nn.Module):
    """The net under ``module``, as ``LoopedForDeepSpeed`` holds it (what engine/full_state.py installs into)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _engine(device_type: str, stage: int, seed: int) -> Any:
    """A small model under ``deepspeed.initialize`` with the optimizer block ``ds_config`` writes for the job."""
    import os

    from elastic_pretrain.engine.config import ds_config
    from elastic_pretrain.engine.weights import import_deepspeed
    from elastic_pretrain.job_loader import load_job

    deepspeed = import_deepspeed()
    os.environ.setdefault("LOCAL_RANK", "0")
    job = load_job(
        REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", "engine=deepspeed", f"deepspeed.zero_stage={stage}"]
    )
    generated = ds_config(job, dp_size=1, device_type=device_type)
    config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": generated["optimizer"],
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        # gloo has no side streams: overlap is the CUDA config's only other difference (test_engine_config)
        "zero_optimization": {**generated["zero_optimization"], "overlap_comm": False},
    }
    torch.manual_seed(seed)
    model = _Wrapped(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine: Any, steps: range) -> None:
    for i in steps:
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def _params(engine: Any) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(("saved_on", "resumed_on"), [("cpu", "cuda"), ("cuda", "cpu")])
def test_a_checkpoint_of_one_adam_resumes_under_the_other(
    mesh1, monkeypatch, tmp_path: Path, stage: int, saved_on: str, resumed_on: str
) -> None:
    import deepspeed.ops.adam

    from elastic_pretrain.engine.deepspeed import DeepSpeedTensors

    monkeypatch.setattr(deepspeed.ops.adam, "FusedAdam", StandInFusedAdam)
    first = _engine(saved_on, stage, seed=0)
    _train(first, range(3))
    path = tmp_path / "step_3" / "model_optim"
    DeepSpeedTensors(first).save(path, strategy=None, use_async=False)

    resumed, same = _engine(resumed_on, stage, seed=1), _engine(saved_on, stage, seed=1)  # other weights
    assert isinstance(resumed.optimizer.optimizer, StandInFusedAdam if resumed_on == "cuda" else torch.optim.AdamW)
    for engine in (resumed, same):
        DeepSpeedTensors(engine).load(path, state={})
        _train(engine, range(3, 5))
    # the same update at steps 4 and 5 (a step count restarted at 1 would change the bias correction by
    # far more): two Adam implementations in fp32 on values of order 1, rounding apart only
    for got, want in zip(_params(resumed), _params(same)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if resumed_on == "cuda":
        steps = {int(s["step"]) for s in resumed.optimizer.optimizer.state.values()}
        assert steps == {5}, steps


def test_a_reshard_installs_the_step_where_fused_adam_keeps_it(mesh1, monkeypatch, tmp_path: Path) -> None:
    """ZeRO-2 under torch's AdamW resumed at ZeRO-3 under FusedAdam: the state is read whole and installed
    (engine/full_state.py ``install_deepspeed``); the update continues from Adam's step 3."""
    import deepspeed.ops.adam

    from elastic_pretrain.engine.deepspeed import DeepSpeedTensors

    monkeypatch.setattr(deepspeed.ops.adam, "FusedAdam", StandInFusedAdam)
    first = _engine("cpu", 2, seed=0)
    _train(first, range(3))
    path = tmp_path / "step_3" / "model_optim"
    DeepSpeedTensors(first).save(path, strategy=None, use_async=False)
    resumed, same = _engine("cuda", 3, seed=1), _engine("cpu", 2, seed=1)
    DeepSpeedTensors(resumed).load(path, state={"config": {"deepspeed": {"zero_stage": 2}}})
    DeepSpeedTensors(same).load(path, state={})
    for engine in (resumed, same):
        _train(engine, range(3, 5))
    for got, want in zip(_params(resumed), _params(same)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert {int(s["step"]) for s in resumed.optimizer.optimizer.state.values()} == {5}
