"""Checkpoint conversion between the engines, with the optimizer state (Adam's moments and step count) or weights
only.

- With the optimizer state, a converted checkpoint *resumes* on the other engine as its source continues: the
  DeepSpeed run's step 2 converted to megatron (and the megatron run's step 2 to DeepSpeed ZeRO-3) trains steps
  3-4 to the per-step losses of the unconverted run within 1e-5 (the parity tolerance of
  tests/engine/test_engine_parity.py: the engines differ only in summation order; measured worst in the
  docs), and the converted state is bitwise the source's (fp32 weights, both moments, step).
- Weights only: DeepSpeed ZeRO-2 -> megatron -> DeepSpeed ZeRO-1 evaluates to the same validation loss at every
  ℓ (bitwise: the same fp32 weights through the same model code).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint.runs import history, train

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the module fixture's two runs count in the first test

# 4 steps, switching to mixed depth at step 3 (the loop-conditioning heads on), a checkpoint after every step
RUN = ["train.steps=4", "train.global_batch_size=8", "checkpoint.interval=1", "checkpoint.keep_last=4"]
TOLERANCE = 1e-5


def losses_per_loop(step: Path) -> dict[int, float]:
    from elastic_pretrain.data.loader import load_validation
    from elastic_pretrain.engine.restore import load_model
    from elastic_pretrain.eval.loss import loss_by_loops

    job, net = load_model(step)
    tokens = load_validation(job.data, num_sequences=4)
    return loss_by_loops(net, tokens, batch_size=2)


def megatron_state(step: Path) -> Any:
    """The full state (engine/full_state.py) of a megatron-engine checkpoint, read through megatron's optimizer."""
    from elastic_pretrain.checkpoint.store import read_trainer_state
    from elastic_pretrain.engine.convert import _read_state
    from elastic_pretrain.engine.restore import load_model

    job, net = load_model(step)
    return _read_state(step, "megatron", job, net, float(read_trainer_state(step)["adam_step"]))


def assert_same_state(a: Any, b: Any) -> None:
    assert a.step == b.step == 2
    for what in ("exp_avg", "exp_avg_sq"):
        x, y = getattr(a, what), getattr(b, what)
        assert x.keys() == y.keys() and len(x) > 0
        assert [k for k in x if not torch.equal(x[k], y[k])] == [], what
        assert any(v.abs().sum() > 0 for v in x.values())  # two steps of Adam: not the fresh state
    assert [k for k in a.exp_avg if not torch.equal(a.weights[k], b.weights[k])] == []


def resumed_losses(run: Path, straight: Path) -> list[tuple[float, float]]:
    """(resumed, unconverted) loss of each step the resumed run trained."""
    want = {h["step"]: h["loss"] for h in history(straight)}
    got = [(h["loss"], want[h["step"]]) for h in history(run) if h["step"] > 2]
    assert len(got) == 2, history(run)
    return got


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4-step run on each engine (one process), shared by the tests of this file."""
    base = tmp_path_factory.mktemp("runs")
    train(base / "ds", 1, "engine=deepspeed", *RUN)
    train(base / "mega", 1, "engine=megatron", *RUN)
    return base


def test_a_converted_checkpoint_resumes_on_the_other_engine(runs: Path, tmp_path: Path, mesh1: Any) -> None:
    from elastic_pretrain.checkpoint.store import is_deepspeed
    from elastic_pretrain.engine.convert import convert
    from elastic_pretrain.engine.full_state import read_deepspeed

    ds2, mega2 = (runs / run / "checkpoints" / "step_2" for run in ("ds", "mega"))

    as_mega = convert(ds2, tmp_path / "ds-as-mega")
    assert not is_deepspeed(as_mega)
    assert_same_state(read_deepspeed(ds2), megatron_state(as_mega))
    as_ds = convert(mega2, tmp_path / "mega-as-ds", zero_stage=3)
    assert is_deepspeed(as_ds)
    assert_same_state(megatron_state(mega2), read_deepspeed(as_ds))

    train(tmp_path / "ds-as-mega", 1, "engine=megatron", *RUN)
    train(tmp_path / "mega-as-ds", 1, "engine=deepspeed", "deepspeed.zero_stage=3", *RUN)
    pairs = resumed_losses(tmp_path / "ds-as-mega", runs / "ds")
    pairs += resumed_losses(tmp_path / "mega-as-ds", runs / "mega")
    print("resumed after conversion, per-step |Δloss|:", [f"{abs(a - b):.1e}" for a, b in pairs])
    for got, want in pairs:
        assert got == pytest.approx(want, abs=TOLERANCE)


def test_a_weights_only_conversion_evaluates_to_the_same_loss_per_loop(runs: Path, tmp_path: Path, mesh1: Any) -> None:
    from elastic_pretrain.checkpoint.store import CheckpointStore, is_deepspeed
    from elastic_pretrain.engine.convert import convert

    step = CheckpointStore(runs / "ds" / "checkpoints").newest().path
    assert is_deepspeed(step)
    want = losses_per_loop(step)
    assert len(want) == 4 and len(set(want.values())) > 1

    mega = convert(step, tmp_path / "as-megatron", optimizer=False)
    assert not is_deepspeed(mega) and (mega / "COMMITTED").is_file()
    assert losses_per_loop(mega) == want

    # a checkpoint resumes only on the engine that wrote it: one line naming both fixes
    from elastic_pretrain.errors import UserError
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.train.resume import resumable
    from tests.conftest import REPO

    ds_job = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", "engine=deepspeed"])
    with pytest.raises(UserError, match=r"written by engine=megatron.*set engine=megatron, or convert it"):
        resumable(mega, ds_job)

    back = convert(mega, tmp_path / "back", zero_stage=1, optimizer=False)
    assert is_deepspeed(back) and (back.parent / "latest").is_file()
    assert losses_per_loop(back) == want


def test_convert_copies_only_the_listed_rng_files(runs: Path, tmp_path: Path, mesh1: Any) -> None:
    """Issue 35 item 6, the report's input: ``rng/rank_00009.pt -> ~/secret`` beside the listed RNG file of a
    shared checkpoint. It came out of the conversion as a regular file holding the secret; now only the
    files COMMITTED lists are copied, each a regular file (engine/convert.py:copy_rng)."""
    import shutil

    from elastic_pretrain.engine.convert import convert

    secret = tmp_path / "home" / "secret"
    secret.parent.mkdir()
    secret.write_text("the user's own file\n")
    step = tmp_path / "shared" / "checkpoints" / "step_2"
    shutil.copytree(runs / "ds" / "checkpoints" / "step_2", step)
    (step / "rng" / "rank_00009.pt").symlink_to(secret)
    out = convert(step, tmp_path / "converted", optimizer=False)
    assert sorted(p.name for p in (out / "rng").iterdir()) == ["rank_00000.pt"]
    assert (out / "rng" / "rank_00000.pt").read_bytes() == (step / "rng" / "rank_00000.pt").read_bytes()
    assert not any(b"the user's own file" in p.read_bytes() for p in out.rglob("*") if p.is_file())
