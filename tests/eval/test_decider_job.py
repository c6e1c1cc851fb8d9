"""The decider job end to end: post-train a decider on a base checkpoint (2 ranks, EP=2), stop, resume at
another layout (1 rank); the checkpoint's decider drives the adaptive sweep (`eval --adaptive`) and
`generate --loops auto` (in this process: the commands' own launches are in test_eval_commands.py).
Plus the job's loss against the one-process reference and its one-line config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastic_pretrain.config import ConfigError
from elastic_pretrain.job_loader import load_job
from tests.conftest import REPO
from tests.eval.conftest import cli

JOB = REPO / "jobs" / "tiny-decider.yaml"
COMMON = ["train.warmup_steps=1", "train.log_interval=1", "train.eval_sequences=4", "train.global_batch_size=8",
          "checkpoint.interval=0", "tracking.backend=none"]  # fmt: skip


def _decider_tensors(step: Path, out: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step / "model_optim", out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if "decider." in k}


@pytest.mark.slow
@pytest.mark.long  # decider jobs train in CI: tests/experiments/test_decider_analysis.py, the 2-rank test below
def test_decider_job_trains_resumes_and_drives_eval_and_generate(run_dir: Path, tmp_path: Path, mesh1) -> None:
    run = tmp_path / "decider"
    first = cli("train", str(JOB), "--nproc-per-node", "2", "--run-dir", str(run), f"decider.init_from={run_dir}",
                "train.steps=3", "checkpoint.stop_at=2", *COMMON)  # fmt: skip
    assert "decider job: base model from" in first.stdout and "(frozen)" in first.stdout
    assert "stopped (stop_at) at step 2" in first.stdout
    line = next(ln for ln in first.stdout.splitlines() if ln.startswith("step     2/3"))
    assert "decider bce" in line and "ℓ1=" in line and "ℓ4=" in line  # labels need the CE of every pass
    saved = _decider_tensors(run / "checkpoints" / "step_2", tmp_path / "s2.pt")
    assert {"decider.fc1.weight", "optimizer.exp_avg.decider.fc1.weight"} <= set(saved)
    adam = [k for k in _all_keys(run / "checkpoints" / "step_2") if k.startswith("optimizer.")]
    assert adam and all("decider." in k for k in adam)  # frozen backbone: Adam state only for the decider

    second = cli("train", str(JOB), "parallel=single", "--run-dir", str(run), f"decider.init_from={run_dir}",
                 "train.steps=3", *COMMON)  # fmt: skip
    assert "resumed from" in second.stdout and "(step 2," in second.stdout
    meta = json.loads((run / "checkpoints" / "step_3" / "trainer.json").read_text())
    assert meta["adam_step"] == 3 and meta["config"]["decider"]["init_from"].endswith("step_2")
    assert len(json.loads((run / "summary.json").read_text())["history"]) == 3

    # what eval --adaptive and generate --loops auto run, with the decider inside the checkpoint
    from elastic_pretrain.data.loader import load_validation
    from elastic_pretrain.engine.restore import load_model
    from elastic_pretrain.eval.adaptive import adaptive_sweep, plot_sweep
    from elastic_pretrain.eval.commands import pick_decider
    from elastic_pretrain.model.inference import generate

    job, model = load_model(run / "checkpoints" / "step_3")
    decider = pick_decider(model, run, None)
    for key, value in _decider_tensors(run / "checkpoints" / "step_3", tmp_path / "s3.pt").items():
        if not key.startswith("optimizer."):
            torch.testing.assert_close(decider.state_dict()[key.removeprefix("decider.")], value, rtol=0, atol=0)
    sweep = adaptive_sweep(model, decider, load_validation(job.data, num_sequences=1), [0.0, 0.5, 1.01])
    assert [r.mean_passes for r in sweep.adaptive][::2] == [4.0, 1.0] and len(sweep.fixed) == 4
    assert sweep.adaptive[0].loss == pytest.approx(sweep.fixed[-1].loss, abs=1e-5)
    assert "| 0.5 |" in sweep.markdown() and plot_sweep(sweep, tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    deep = generate(model, [1, 2, 3], loops="auto", stop=decider.stopper(0.0), max_new_tokens=4)
    assert torch.equal(deep.tokens_BT, generate(model, [1, 2, 3], loops=4, max_new_tokens=4).tokens_BT)
    some = generate(model, [1, 2, 3], loops="auto", stop=decider.stopper(), max_new_tokens=4)
    assert some.passes_BN.min() >= 1 and some.passes_BN.max() <= 4


@pytest.mark.slow
def test_per_token_decider_job_two_ranks_strict_devices(run_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """``decider.backbone=per_token`` end to end: 2 ranks (EP=2, so DP=2: labels pooled by an all-gather),
    strict device checks on, two steps; the backbone trains (Adam state beyond the decider)."""
    monkeypatch.setenv("ELASTIC_PRETRAIN_STRICT_DEVICES", "1")
    run = tmp_path / "per-token"
    out = cli("train", str(JOB), "--nproc-per-node", "2", "--run-dir", str(run), f"decider.init_from={run_dir}",
              "decider.backbone=per_token", "train.steps=2", *COMMON)  # fmt: skip
    assert "(per_token)" in out.stdout
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("step     2/2"))
    assert "decider bce" in line and "ℓ1=" in line and "ℓ4=" in line
    adam = [k for k in _all_keys(run / "checkpoints" / "step_2") if k.startswith("optimizer.")]
    assert any("decider." in k for k in adam) and any("decider." not in k for k in adam)


def _all_keys(step: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(step / "model_optim")).read_metadata().state_dict_metadata)


def test_decider_job_config_errors(tmp_path: Path) -> None:
    from elastic_pretrain.config import to_dict

    run_dir = tmp_path / "step_2"  # a stand-in base checkpoint: load_job reads only its trainer.json
    run_dir.mkdir()
    meta = {"config": to_dict(load_job(REPO / "jobs" / "tiny-cpu.yaml")), "controller": {"phase": "fixed"}}
    (run_dir / "trainer.json").write_text(json.dumps(meta))
    job = load_job(JOB, [f"decider.init_from={run_dir}"])
    assert job.model.hidden_size == 96 and job.schedule.switch_at == 1.0  # from the base (fixed phase)
    assert job.decider is not None and Path(job.decider.init_from or "").name == "step_2"
    for overrides, message in (
        ([f"decider.init_from={run_dir}/nope"], "decider.init_from: .*no committed checkpoint.*train the base job"),
        (["decider.init_from=null"], "decider.init_from: missing"),
        ([f"decider.init_from={run_dir}", "schedule.sampler=fixed"], "schedule: a decider job .*drop the schedule"),
        ([f"decider.init_from={run_dir}", "model.hidden_size=64"], "model.hidden_size: 96 -> 64"),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            load_job(JOB, overrides)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("backbone", "lm_loss"), [("frozen", "last"), ("joint", "last"), ("joint", "every_exit"), ("per_token", "last")]
)
def test_job_loss_equals_the_one_process_reference(mesh1, backbone: str, lm_loss: str) -> None:
    """The decider job's forward + loss (train/decider.py) against ``decider_loss``: the same objective
    and the same decider and backbone gradients; frozen, the backbone gets none."""
    from elastic_pretrain.model.decider import DeciderConfig, decider_loss
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.train.decider import _loss_func, freeze_backbone
    from tests.eval.conftest import PAR, tiny

    cfg = DeciderConfig(backbone=backbone, lm_loss=lm_loss, pos_weight=2.0, loss_weight=0.5, coverage=0.8)  # type: ignore[arg-type]
    torch.manual_seed(0)
    net = build_model(tiny(), PAR, decider=cfg)
    if backbone == "frozen":
        freeze_backbone(net)
    x = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(3))
    ids, labels = x[:, :-1], x[:, 1:]
    objective, n, report = _loss_func(cfg, net.forward_decider(ids, labels))
    (objective / n).backward()
    got = {k: p.grad.clone() for k, p in net.decider.named_parameters()}
    backbone_grads = {name: p.grad for name, p in net.named_parameters() if not name.startswith("decider.")}
    net.zero_grad(set_to_none=True)
    ref = decider_loss(net, net.decider, ids, labels)
    ref.total.backward()
    torch.testing.assert_close(objective / n, ref.total, rtol=1e-5, atol=1e-6)
    for k, p in net.decider.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-4, atol=1e-7)
    if backbone == "joint":  # the LM loss the backbone trains on is the reference's (every_exit: every depth)
        for name, p in net.named_parameters():
            if not name.startswith("decider.") and p.grad is not None:
                torch.testing.assert_close(backbone_grads[name], p.grad, rtol=1e-4, atol=1e-6)
    backbone_grads = list(backbone_grads.values())
    assert float(report["decider"][2]) / float(report["decider"][1]) == pytest.approx(ref.continue_fraction)
    assert all(g is None for g in backbone_grads) == (backbone == "frozen")
