"""``engine: megatron|deepspeed`` in the job: the mesh and sampler checks, and the generated DeepSpeed config."""

from __future__ import annotations

import importlib
import json
import subprocess

import pytest

from elastic_pretrain.config import ConfigError
from elastic_pretrain.engine.config import ds_config
from elastic_pretrain.job_loader import load_job
from tests.conftest import REPO, VENV_BIN

JOB = REPO / "jobs" / "tiny-cpu.yaml"


def test_megatron_stays_the_default() -> None:
    assert load_job(JOB).engine == "megatron"


@pytest.mark.parametrize("mesh", ["parallel=cpu-ep2", "parallel=cpu-tp2", "parallel=cpu-pp2"])
def test_deepspeed_refuses_a_model_parallel_mesh_in_one_line(mesh: str) -> None:
    with pytest.raises(ConfigError, match=r"engine=deepspeed is data parallel only.*use parallel=single") as err:
        load_job(JOB, [mesh, "engine=deepspeed"])
    assert "\n" not in str(err.value)


def test_the_cli_prints_the_refusal_as_one_line_with_exit_code_2() -> None:
    proc = subprocess.run([str(VENV_BIN / "elastic-pretrain"), "config", "jobs/tiny-cpu.yaml", "engine=deepspeed"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "parallel=single" in proc.stderr


def test_zero3_takes_ranks_that_draw_their_own_loop_counts() -> None:
    """ZeRO-3 runs mixed depth with full ghost passes (engine/deepspeed.py); only kv_training=last_loop's no-grad
    pre-run, which ghost passes do not join, and nvme optimizer offload (whose gradient copies the step cannot zero)
    are refused, in one line naming the fix."""
    job = load_job(JOB, ["parallel=single", "engine=deepspeed", "deepspeed.zero_stage=3"])  # independent_rank at 0.75
    assert job.deepspeed.zero_stage == 3 and job.schedule.sampler == "independent_rank"
    with pytest.raises(ConfigError, match=r"zero_stage=3 .* use model.kv_training=same_pass") as err:
        load_job(JOB, ["parallel=single", "engine=deepspeed", "deepspeed.zero_stage=3", "model.kv_training=last_loop"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"offload_optimizer=nvme .* use deepspeed.offload_optimizer=cpu"):
        load_job(
            JOB,
            [
                "parallel=single",
                "engine=deepspeed",
                "deepspeed.zero_stage=3",
                "deepspeed.nvme_path=/tmp",
                "deepspeed.offload_optimizer=nvme",
            ],
        )
    job = load_job(
        JOB,
        [
            "parallel=single",
            "engine=deepspeed",
            "deepspeed.zero_stage=3",
            "model.kv_training=last_loop",
            "schedule.switch_at=1.0",
            "schedule.sampler=fixed",
        ],
    )
    assert ds_config(job, dp_size=2)["zero_optimization"]["stage3_param_persistence_threshold"] == 100_000


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (
            ["schedule.balance=compute", "deepspeed.zero_stage=3"],
            "use deepspeed.zero_stage=2 .*or schedule.balance=off",
        ),
        (["schedule.exit_axis=layer"], "schedule.exit_axis=loop"),
    ],
)
def test_schedules_the_deepspeed_step_cannot_run_are_refused(overrides: list[str], fix: str) -> None:
    with pytest.raises(ConfigError, match=fix) as err:
        load_job(JOB, ["parallel=single", "engine=deepspeed", *overrides])
    assert "\n" not in str(err.value)


def test_compute_balanced_depth_runs_on_zero_1_and_2() -> None:
    """Unequal micro-batch counts per rank: the DeepSpeed step accumulates them locally (engine/deepspeed.py)."""
    for stage in (1, 2):
        job = load_job(
            JOB, ["parallel=single", "engine=deepspeed", "schedule.balance=compute", f"deepspeed.zero_stage={stage}"]
        )
        assert job.schedule.balance == "compute"


def test_offload_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="only ZeRO-3"):
        load_job(JOB, ["parallel=single", "engine=deepspeed", "deepspeed.offload_param=cpu"])
    with pytest.raises(ConfigError, match="nvme_path"):
        load_job(JOB, ["parallel=single", "engine=deepspeed", "deepspeed.offload_optimizer=nvme"])


def test_the_generated_config_takes_everything_from_the_job() -> None:
    job = load_job(
        JOB,
        [
            "parallel=single",
            "engine=deepspeed",
            "deepspeed.zero_stage=1",
            "deepspeed.offload_optimizer=cpu",
            "train.clip_grad=0.5",
            "train.weight_decay=0.01",
        ],
    )
    cfg = ds_config(job, dp_size=2)
    t = job.train
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"]) == (t.global_batch_size, t.micro_batch_size)
    assert cfg["gradient_accumulation_steps"] * t.micro_batch_size * 2 == t.global_batch_size
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"]["stage"] == 1
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    params = cfg["optimizer"]["params"]
    assert params["betas"] == [t.adam_beta1, t.adam_beta2] and params["weight_decay"] == 0.01
    assert params["lr"] == t.lr and params["torch_adam"] is True
    assert cfg["elastic_pretrain_lr_schedule"]["warmup_steps"] == t.warmup_steps
    assert cfg["bf16"]["enabled"] is False
    # buckets never exceed the model (ZeRO-3 allocates a whole one up front)
    assert ds_config(job, dp_size=2, n_params=1000)["zero_optimization"]["reduce_bucket_size"] == 1000
    json.dumps(cfg)  # written to the run directory as JSON


def test_the_deepspeed_pin_is_the_locked_and_installed_version() -> None:
    """pyproject's extra, requirements/lock-cpu.txt and the venv agree (scripts/setup.sh installs the lock)."""
    import importlib.metadata
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["deepspeed"]
    lock = [
        line
        for line in (REPO / "requirements" / "lock-cpu.txt").read_text().splitlines()
        if line.startswith("deepspeed==")
    ]
    assert extra == lock == [f"deepspeed=={importlib.metadata.version('deepspeed')}"]
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert 'DS_BUILD_OPS=0 "${PIP[@]}" --no-deps -r requirements/lock-cpu.txt' in setup


def test_deepspeed_on_cpu_starts_its_backend_without_building_the_shm_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's CPU backend would JIT-build ``deepspeed_shm_comm`` (70-100 s, a C++ compiler) at the first
    engine of every virtual environment, for an op only its inference all-reduce uses: import_deepspeed marks
    it incompatible, and the backend's build step returns None without loading (building) anything."""
    pytest.importorskip("deepspeed")
    import torch

    from elastic_pretrain.engine.weights import SHM_COMM_OP, import_deepspeed

    if torch.cuda.is_available():
        pytest.skip("CPU only: with CUDA, DeepSpeed's accelerator is CUDA's")
    deepspeed = import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    ds_comm = importlib.import_module("deepspeed.comm.torch")  # `from deepspeed.comm import torch` is torch

    builder = type(get_accelerator().create_op_builder("ShareMemCommBuilder"))
    assert builder.NAME == SHM_COMM_OP
    monkeypatch.setattr(builder, "load", lambda *a, **k: pytest.fail("DeepSpeed would build its shm op"))
    assert deepspeed.ops.__compatible_ops__[SHM_COMM_OP] is False
    assert ds_comm.build_shm_op() is None


def _deepspeed_choice(cfg: dict) -> tuple[bool, type]:
    """(``overlap_comm``, the optimizer class) DeepSpeed itself derives from ``cfg``: its own config parser and
    ``DeepSpeedEngine.get_optimizer_configuration`` (no engine, no device, no kernel built: the class only)."""
    import types

    from elastic_pretrain.engine.weights import import_deepspeed

    import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    parsed = DeepSpeedConfig(cfg)
    engine = types.SimpleNamespace(_config=parsed)
    engine.zero_use_cpu_optimizer = lambda: DeepSpeedEngine.zero_use_cpu_optimizer(engine)  # type: ignore[attr-defined]
    cls, _ = DeepSpeedEngine.get_optimizer_configuration(engine, dict(parsed.optimizer_params), True)  # type: ignore[arg-type]
    return bool(parsed.zero_config.overlap_comm), cls


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_on_cuda_deepspeed_overlaps_communication_and_builds_its_fused_adam(stage: int) -> None:
    """Issue 31 item 5: the config for a CUDA device turns on ``overlap_comm`` and leaves ``torch_adam`` off, so
    DeepSpeed builds ``deepspeed.ops.adam.FusedAdam``; the CPU config is the one before (gloo: no side streams,
    torch's AdamW); an offloaded optimizer keeps torch's AdamW on the host (CPU Adam is a compiled op)."""
    pytest.importorskip("deepspeed")
    import torch
    from deepspeed.ops.adam import FusedAdam

    job = load_job(JOB, ["parallel=single", "engine=deepspeed", f"deepspeed.zero_stage={stage}"])
    cuda, cpu = ds_config(job, dp_size=1, device_type="cuda"), ds_config(job, dp_size=1)
    assert cuda["zero_optimization"]["overlap_comm"] is True and cuda["optimizer"]["params"]["torch_adam"] is False
    assert _deepspeed_choice(cuda) == (True, FusedAdam)
    assert cpu["zero_optimization"]["overlap_comm"] is False and cpu["optimizer"]["params"]["torch_adam"] is True
    assert _deepspeed_choice(cpu) == (False, torch.optim.AdamW)
    assert ds_config(job, dp_size=1, device_type="cpu") == cpu  # the default is the CPU config
    # the two differ in exactly these two keys
    cuda["zero_optimization"]["overlap_comm"], cuda["optimizer"]["params"]["torch_adam"] = False, True
    assert cuda == cpu
    offload = load_job(
        JOB, ["parallel=single", "engine=deepspeed", f"deepspeed.zero_stage={stage}", "deepspeed.offload_optimizer=cpu"]
    )
    assert _deepspeed_choice(ds_config(offload, dp_size=1, device_type="cuda")) == (True, torch.optim.AdamW)
