"""The checkpointer saves a mapping of named stateful objects (docs/checkpoints.md, "What a checkpoint
holds"): each ``state_dict()`` under its name in ``trainer.json``, loaded back by name; an object the
checkpoint has no state for starts fresh; the MLflow run id is the ``tracker`` object's state; a
checkpoint written before the mapping (``extras``, a top-level ``mlflow_run_id``) still reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_pretrain.checkpoint import optim_state
from elastic_pretrain.checkpoint.manager import Checkpointer
from elastic_pretrain.checkpoint.store import RESUME_KEYS, read_trainer_state, saved_run_id
from elastic_pretrain.checkpoint.tensors import ModelTensors
from elastic_pretrain.errors import UserError
from elastic_pretrain.job import public_dict
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.rundir import CheckpointFiles, RunFiles
from elastic_pretrain.train.session import build_optimizer, wrap_ddp
from tests.conftest import REPO


class Counter:
    """A stateful object of the test's own: a count and a label."""

    def __init__(self, n: int = 0, label: str = "fresh") -> None:
        self.n, self.label = n, label

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "label": self.label}

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        self.n, self.label = int(state["n"]), str(state["label"])


@pytest.fixture
def parts(mesh1, tmp_path: Path):
    """A real one-process model, optimizer and LR scheduler of the tiny job, with its run directory."""
    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", "tracking.backend=none"],
                   values={"run_dir": str(tmp_path / "run")})  # fmt: skip
    net = build_model(job.model, job.parallel)
    model = wrap_ddp(job, net)
    optimizer, scheduler = build_optimizer(job, model)
    optim_state.ensure_state(optimizer)  # Adam's moments exist from the first step on: as in a trained run
    return job, mesh1, job.run_path, ModelTensors(net, optimizer), scheduler


def _param(tensors: ModelTensors) -> torch.Tensor:
    return next(p for p in tensors.net.parameters() if p.requires_grad)


def test_every_named_object_round_trips_and_a_new_one_starts_fresh(parts) -> None:
    job, mesh, run_dir, tensors, scheduler = parts
    scheduler.step(increment=7)
    saved = {"scheduler": scheduler, "counter": Counter(5, "saved")}
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, tensors, saved)
    ckpt.save(3, blocking=True)
    ckpt.close()
    meta = json.loads(RunFiles(run_dir).step_dir(3).joinpath("trainer.json").read_text())
    assert meta["counter"] == {"n": 5, "label": "saved"} and meta["scheduler"]["num_steps"] == 7
    assert {"adam_step", "layout", "config"} <= set(meta)

    before = _param(tensors).detach().clone()
    with torch.no_grad():
        _param(tensors).add_(1.0)
    scheduler.num_steps = 0  # megatron's scheduler steps on from its current count when it loads
    counter, added = Counter(), Counter(9, "added after the save")
    again = Checkpointer(
        job.checkpoint,
        public_dict(job),
        mesh,
        run_dir,
        tensors,
        {"scheduler": scheduler, "counter": counter, "added": added},
    )
    again.restore(RunFiles(run_dir).step_dir(3), read_trainer_state(RunFiles(run_dir).step_dir(3)))
    assert (counter.n, counter.label) == (5, "saved")
    assert (added.n, added.label) == (9, "added after the save")  # no state in the checkpoint: kept fresh
    assert scheduler.num_steps == 7 and again.last_saved == 3
    assert torch.equal(_param(tensors), before)
    again.close()


def test_a_name_of_the_checkpointer_is_refused(parts) -> None:
    job, mesh, run_dir, tensors, _ = parts
    ckpt = Checkpointer(job.checkpoint, public_dict(job), mesh, run_dir, tensors, {"config": Counter()})
    with pytest.raises(ValueError, match="may not be named config"):
        ckpt.save(1, blocking=True)
    ckpt.close()


def test_a_checkpoint_of_the_earlier_format_reads_as_the_current_one(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_4"
    ckpt.mkdir()
    counters = {"step": 4, "tokens": 64, "elapsed_s": 1.0}
    old = {"trainer": counters, "adam_step": 4, "scheduler": {}, "controller": {}, "data": {}, "layout": {},
           "config": {}, "mlflow_run_id": "abc123", "extras": {"faults": {"counts": {"spike": 2}}}}  # fmt: skip
    CheckpointFiles(ckpt).trainer.write_text(json.dumps(old))
    meta = read_trainer_state(ckpt, require=RESUME_KEYS)
    assert meta["faults"] == {"counts": {"spike": 2}} and "extras" not in meta
    assert meta["tracker"] == {"run_id": "abc123"} and saved_run_id(meta) == "abc123"


def test_a_malformed_run_id_is_one_line(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    CheckpointFiles(ckpt).trainer.write_text(json.dumps({"config": {}, "tracker": {"run_id": 7}}))
    with pytest.raises(UserError, match=r"malformed \(tracker\.run_id is int, not str or null\)"):
        read_trainer_state(ckpt)


def test_the_mlflow_run_id_is_the_tracker_state(mesh1, tmp_path: Path) -> None:
    """The checkpoint's run id is the one a resumed run opens; a rollback keeps the open run; without an id
    in the checkpoint a resume from this run directory takes ``mlflow_run_id`` (MLflow answered late)."""
    from elastic_pretrain.train.trainer import TrackingCallback

    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", "tracking.backend=none"],
                   values={"run_dir": str(tmp_path / "run")})  # fmt: skip
    resumed = TrackingCallback(job, mesh1, job.run_path)
    resumed.load_state_dict({"run_id": "from-the-checkpoint"})
    resumed.start(run_id_file=True)
    resumed.load_state_dict({"run_id": "an-older-checkpoint"})  # a fault rollback restores every object
    assert resumed.state_dict() == {"run_id": "from-the-checkpoint"}

    RunFiles(job.run_path).mlflow_run_id.parent.mkdir(parents=True)
    RunFiles(job.run_path).mlflow_run_id.write_text("from-the-file\n")
    for own_run_dir, want in ((True, "from-the-file"), (False, None)):
        late = TrackingCallback(job, mesh1, job.run_path)
        late.load_state_dict({"run_id": None})
        late.start(run_id_file=own_run_dir)
        assert late.state_dict() == {"run_id": want}
