"""``train`` on a run that already has a checkpoint (issue 33, item 2; ``train/resume.py``): finished at
``train.steps`` -> one line, exit 0, no rank started; past it -> one line, exit 2; a changed model shape ->
refused before any rank starts; a larger ``train.steps`` trains further on the run's own schedule (the
checkpoint's LR horizon, WSD window and switch point). The end-to-end extension (two launches) is in
tests/test_readme_commands.py, which runs the README's ``run-default.sh train.steps=400`` after the default run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from elastic_pretrain import cli
from elastic_pretrain.checkpoint.store import CheckpointStore
from elastic_pretrain.errors import UserError
from elastic_pretrain.job import to_dict
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.rundir import RunFiles
from elastic_pretrain.schedule import ScheduleConfig, ScheduleController
from elastic_pretrain.train.resume import check_before_launch, check_steps_left
from elastic_pretrain.train.session import SchedulerState, schedule_end_note, wsd_decay_steps
from tests.conftest import REPO


@pytest.fixture
def finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunFiles:
    """A repository-like working directory where jobs/tiny-cpu.yaml finished its 300 steps in runs/tiny-cpu
    (a committed step_300 whose trainer.json holds the job's config, and FINISHED), as after
    ``bash scripts/run-default.sh``."""
    monkeypatch.chdir(tmp_path)
    for folder in ("jobs", "parallel", "data"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    job = load_job("jobs/tiny-cpu.yaml")
    files = RunFiles(job.run_path)
    store = CheckpointStore(files.checkpoints)
    tmp = store.prepare(300)
    trainer = {"config": to_dict(job), "trainer": {"step": 300, "tokens": 300 * job.tokens_per_step, "elapsed_s": 1.0}}
    (tmp / "trainer.json").write_text(json.dumps(trainer))
    store.commit(300, {})
    files.finished.write_text(json.dumps({"step": 300, "tokens": 300 * job.tokens_per_step}) + "\n")
    return files


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_train_with_fewer_steps_than_trained_is_one_line(
    finished_run: RunFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's input: exited 0, trained nothing and reprinted 'trained 300 steps'."""
    code, out, err = run_cli(["train", "jobs/tiny-cpu.yaml", "--nproc-per-node", "2", "train.steps=100"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert "runs/tiny-cpu has trained 300 steps, more than train.steps=100" in err
    assert "raise train.steps above 300" in err and "name=NEW" in err and "--run-dir runs/NEW" in err


def test_train_on_a_finished_run_says_so_and_starts_nothing(
    finished_run: RunFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["train", "jobs/tiny-cpu.yaml", "--nproc-per-node", "2"], capsys)
    assert code == 0 and err == "" and len(out.strip().splitlines()) == 1, (out, err)
    assert out.startswith("runs/tiny-cpu has trained 300 steps = train.steps: finished, nothing to train.")
    assert "raise train.steps (e.g. train.steps=400)" in out and "name=NEW" in out
    assert not finished_run.config.exists(), "no rank started (a rank writes config.yaml first)"
    # one process (no launcher): the same line
    code, out, _ = run_cli(["train", "jobs/tiny-cpu.yaml", "parallel=single"], capsys)
    assert code == 0 and "finished, nothing to train" in out


def test_a_changed_model_shape_is_refused_before_any_rank_starts(
    finished_run: RunFiles, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's input: ``run-default.sh train.steps=50 model.loops=3`` (its train line) stopped with "model
    shape changed" after the ranks' start-up, naming no way forward."""
    code, _, err = run_cli(["train", "jobs/tiny-cpu.yaml", "--nproc-per-node", "2", "train.steps=50",
                            "model.loops=3"], capsys)  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the model shape changed (model.loops: 2 -> 3)" in err and "name=NEW" in err


def test_more_steps_go_on_to_the_ranks(finished_run: RunFiles) -> None:
    job = load_job("jobs/tiny-cpu.yaml", ["train.steps=400"])
    assert check_before_launch(job) is None
    # without FINISHED (a crash after the last save) the ranks validate and write it
    finished_run.finished.unlink()
    assert check_before_launch(load_job("jobs/tiny-cpu.yaml")) is None
    short = load_job("jobs/tiny-cpu.yaml", ["train.steps=100"])
    with pytest.raises(UserError, match=r"more than train\.steps=100"):  # the same refusal in every rank
        check_steps_left(finished_run.step_dir(300), {"trainer": {"step": 300}}, short)


def scheduler(steps: int, decay: str = "cosine") -> OptimizerParamScheduler:
    """megatron's scheduler with the arguments ``train/session.py:build_optimizer`` gives it."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    return OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2, lr_decay_steps=steps, lr_decay_style=decay,
        start_wd=0.1, end_wd=0.1, wd_incr_steps=steps, wd_incr_style="constant",
        wsd_decay_steps=wsd_decay_steps(steps) if decay == "WSD" else None,
        lr_wsd_decay_style="linear" if decay == "WSD" else None,
    )  # fmt: skip


def lr(s: OptimizerParamScheduler) -> float:
    return float(s.optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("decay", ["cosine", "WSD"])
def test_a_larger_train_steps_keeps_the_runs_lr_schedule(decay: str) -> None:
    """Resumed with train.steps=400, a 300-step run's learning rate follows its own schedule, and past step
    300 it stays at the schedule's end (min_lr). WSD's decay window too: from the new steps it would start
    at step 320 instead of 240."""
    ran = scheduler(300, decay)
    ran.step(increment=250)
    resumed = scheduler(400, decay)
    SchedulerState(resumed).load_state_dict(ran.state_dict())
    assert lr(resumed) == pytest.approx(lr(ran), rel=1e-12)
    for _ in range(100):
        ran.step(increment=1)
        resumed.step(increment=1)
        assert lr(resumed) == pytest.approx(lr(ran), rel=1e-12)
    assert lr(resumed) == pytest.approx(3e-4)
    note = schedule_end_note(
        resumed, ScheduleController(ScheduleConfig(), max_loops=4, total_tokens=1, seed=0), step=300, steps=400
    )
    assert note is not None and "steps 301..400 train at its end (learning rate 3.00e-04, fixed depth)" in note
    assert schedule_end_note(resumed, Any, step=300, steps=300) is None  # type: ignore[arg-type]


def test_a_larger_train_steps_keeps_the_runs_switch_point() -> None:
    """ELR's switch is at switch_at of the tokens of the run's first train.steps, not of a later larger one."""
    cfg = ScheduleConfig(sampler="independent_rank", switch_at=0.75, fixed_loops=1)
    ran = ScheduleController(cfg, max_loops=4, total_tokens=300, seed=3)
    ran.update(step=100, tokens_seen=100)
    resumed = ScheduleController(cfg, max_loops=4, total_tokens=400, seed=3)
    resumed.load_state_dict(ran.state_dict())
    assert resumed.total_tokens == 300
    assert resumed.update(step=225, tokens_seen=225) and resumed.switch_step == 225
    older = {k: v for k, v in ran.state_dict().items() if k != "total_tokens"}  # written before the count was saved
    fresh = ScheduleController(cfg, max_loops=4, total_tokens=400, seed=3)
    fresh.load_state_dict(older)
    assert fresh.total_tokens == 400
