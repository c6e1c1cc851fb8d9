"""The batch script a GPU cluster gets (no cluster needed): golden files of the 16-node job with and
without a container, the NCCL preset and derived environment, container checks, and the rendezvous
port (tested by running the script's own function in bash).

Regenerate the golden files after an intended change with ``UPDATE_GOLDEN=1 pytest tests/slurm/test_gpu_launch.py``
and review the diff: they are what a cluster admin reads.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from elastic_pretrain.cli import main
from elastic_pretrain.config import ConfigError
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.launch.commands import trainer_command
from elastic_pretrain.launch.config import SlurmConfig
from elastic_pretrain.launch.environment import NCCL_PRESET, job_environment, with_run_defaults
from elastic_pretrain.launch.render import LaunchSpec, render

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
# Where a site would keep things: fixed paths, so the golden files do not depend on this machine.
SITE = Path("/lustre/llm/elastic-pretrain")
CONTAINER = {
    "container_image": "/lustre/llm/images/elastic-pretrain-25.10.sqsh",  # a derived image (docs/install.md)
    "container_mounts": ["/lustre:/lustre"],
}


def render_job(name: str, **slurm: object) -> str:
    job = load_job(REPO / "jobs" / f"{name}.yaml")
    fields = {"python": "/lustre/llm/venv/bin/python", "partition": "gpu", "account": "llm", **slurm}
    cfg = dataclasses.replace(job.slurm, **fields)
    run_dir = SITE / "runs" / name
    spec = LaunchSpec(
        job_name=job.name,
        run_dir=run_dir,
        workdir=SITE,
        trainer=trainer_command(run_dir),
        env=job_environment(job.parallel, gpus=cfg.gpus_per_node > 0),
    )
    return render(cfg, spec)


@pytest.mark.parametrize(
    ("golden", "slurm"),
    [("gpu-16node.sbatch", {}), ("gpu-16node-container.sbatch", {**CONTAINER, "python": None})],
)
def test_golden_16_node_scripts(golden: str, slurm: dict[str, object], tmp_path: Path) -> None:
    script = render_job("gpu-16node", **slurm)
    path = GOLDEN / golden
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(script)
    assert script == path.read_text(), f"{golden} changed: review, then UPDATE_GOLDEN=1 to accept"
    (tmp_path / golden).write_text(script)
    check = subprocess.run(["bash", "-n", str(tmp_path / golden)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_what_a_gpu_cluster_needs_is_in_the_script() -> None:
    plain = render_job("gpu-16node")
    boxed = render_job("gpu-16node", **CONTAINER, python=None)
    for script in (plain, boxed):
        assert "#SBATCH --nodes=16" in script and "#SBATCH --gpus-per-node=8" in script
        assert "#SBATCH --cpus-per-task=96" in script
        assert 'SRUN+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")' in script  # srun does not inherit it
        assert "--gpus-per-node=8 --gpu-bind=none" in script
        assert "export CUDA_DEVICE_MAX_CONNECTIONS=32" in script  # TP 1, EP 8
        for key, value in NCCL_PRESET.items():
            assert f"export {key}={value}" in script
    assert "--container-image" not in plain and "PYTHON=/lustre/llm/venv/bin/python" in plain
    assert (
        "--container-image=/lustre/llm/images/elastic-pretrain-25.10.sqsh "
        "--container-workdir=/lustre/llm/elastic-pretrain --container-mounts=/lustre:/lustre"
    ) in boxed
    assert "PYTHON=python" in boxed  # the container's interpreter, not the login node's


@pytest.mark.parametrize(
    ("job", "overrides", "expected"),
    [
        ("gpu-2node", [], "1"),  # TP 2: megatron's TP/SP overlap needs in-order kernel launch
        ("gpu-16node", [], "32"),  # EP 8 only: all-to-all beside expert compute
        ("gpu-1node", ["parallel.expert=1"], None),  # neither
    ],
)
def test_cuda_device_max_connections_follows_the_layout(job: str, overrides: list[str], expected: str | None) -> None:
    cfg = load_job(REPO / "jobs" / f"{job}.yaml", overrides)
    env = job_environment(cfg.parallel, gpus=True)
    assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == expected
    assert job_environment(cfg.parallel, gpus=False) == {}  # CPU nodes: no CUDA


def test_slurm_env_overrides_the_preset_and_derived_values() -> None:
    script = render_job(
        "gpu-2node", env={"NCCL_DEBUG": "INFO", "CUDA_DEVICE_MAX_CONNECTIONS": "8", "NCCL_SOCKET_IFNAME": "ib0"}
    )
    exports = re.findall(r"^export (\w+)=(.*)$", script, flags=re.M)
    keys = [k for k, _ in exports]
    assert len(keys) == len(set(keys)), "a variable exported twice"
    values = dict(exports)
    assert values["NCCL_DEBUG"] == "INFO" and values["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert values["NCCL_SOCKET_IFNAME"] == "ib0" and values["NCCL_IB_TIMEOUT"] == "22"


def test_cpu_nodes_get_no_gpu_options_or_nccl_preset() -> None:
    script = render(
        SlurmConfig(nodes=2), LaunchSpec(job_name="t", run_dir=Path("/r"), workdir=Path("/w"), trainer=["-m", "x"])
    )
    assert "SRUN_EXTRA=()" in script and "TORCHRUN_EXTRA=()" in script
    assert "NCCL" not in "".join(ln for ln in script.splitlines() if ln.startswith("export"))


def test_numa_binding_reaches_torchrun() -> None:
    script = render_job("gpu-16node", numa_binding="node")
    assert "TORCHRUN_EXTRA=(--numa-binding=node)" in script and '"${TORCHRUN_EXTRA[@]}"' in script


@pytest.mark.parametrize(
    ("slurm", "message"),
    [
        ({"container_mounts": ["/data"]}, "slurm.container_mounts/container_workdir: set only with"),
        (
            {"container_image": "nvcr.io#nvidia/pytorch:25.10-py3", "container_mounts": ["data:/data"]},
            "slurm.container_mounts: 'data:/data' is not SRC:DST",
        ),
        ({"container_image": "my image"}, "slurm.container_image: 'my image' is not an image name"),
        ({"container_image": "img.sqsh", "container_workdir": "rel"}, "must be an absolute path"),
    ],
)
def test_bad_container_settings_are_one_line_errors(slurm: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        SlurmConfig(**slurm)


def test_the_run_directory_must_be_mounted_into_the_container() -> None:
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "the run directory /lustre/llm/elastic-pretrain/runs/gpu-16node is not mounted into the container: add "
            "a mount that holds it at the same path (e.g. /lustre:/lustre)"
        ),
    ):
        render_job("gpu-16node", container_image="img.sqsh", container_mounts=["/scratch:/scratch"])


def test_submit_dry_run_checks_the_allocation(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    main(["submit", "jobs/gpu-16node.yaml", "--dry-run"])  # refused here (no corpus: tests/slurm/test_preflight.py)
    out, err = capsys.readouterr()
    assert "#SBATCH --nodes=16" in out
    assert "# layout: world 128 = TP 1 x PP 1 x DP 128; EP 8" in err and "of 80.0 GiB per GPU" in err
    assert main(["submit", "jobs/gpu-16node.yaml", "--nodes", "15", "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "world size 120 = --nodes 15 x 8 process(es) per node" in err


# --- the rendezvous port (issue #21: two local clusters on one machine collided) ---------------------
def master_port_function() -> str:
    script = (REPO / "slurm" / "train.sbatch").read_text()
    m = re.search(r"^master_port\(\) \{.*?^\}$", script, flags=re.M | re.S)
    assert m, "slurm/train.sbatch lost its master_port function"
    return m.group(0)


def master_ports(cluster: str, job_ids: list[int], host: str = "127.0.0.1") -> list[int]:
    code = master_port_function() + '\nfor id in "$@"; do master_port "$CLUSTER" "$id" "$HOST"; done\n'
    proc = subprocess.run(
        ["bash", "-c", code, "ports", *map(str, job_ids)],
        capture_output=True,
        text=True,
        env={**os.environ, "CLUSTER": cluster, "HOST": host},
        check=True,
        timeout=120,
    )
    return [int(p) for p in proc.stdout.split()]


def test_master_port_is_stable_distinct_and_differs_between_clusters() -> None:
    ids = list(range(1, 41))
    a = master_ports("elastic-local-16900", ids)  # the developer's local cluster (slurm/local-cluster)
    b = master_ports("elastic-local-16940", ids)  # the test suite's, on the same machine and addresses
    assert all(20000 <= p < 40000 for p in a + b)
    assert len(set(a)) == len(ids), "two jobs of one cluster share a port"
    assert not set(a) & set(b), "the two local clusters' jobs 1..40 share ports"
    assert master_ports("elastic-local-16900", [7, 7]) == [a[6], a[6]]  # a requeued job keeps its port


def test_master_port_skips_a_port_in_use() -> None:
    (port,) = master_ports("elastic-local-16940", [3])
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", port))
        except OSError:
            pytest.skip(f"port {port} is taken on this machine already")
        busy.listen()
        assert master_ports("elastic-local-16940", [3]) == [port + 1 if port < 39999 else 20000]


def test_a_site_template_without_the_gpu_placeholders_is_refused(tmp_path: Path) -> None:
    old = (REPO / "slurm" / "train.sbatch").read_text().replace('"${SRUN_EXTRA[@]}"', "")
    old = old.replace("SRUN_EXTRA=({{SRUN_EXTRA}})", "")
    template = tmp_path / "site.sbatch"
    template.write_text(old)
    with pytest.raises(ConfigError, match=r"does not use \{\{SRUN_EXTRA\}\}, so the job's GPU/container"):
        render_job("gpu-16node", template=str(template))
    assert "SRUN_EXTRA" not in render_job("gpu-16node", template=str(template), gpus_per_node=0, nproc_per_node=8)


def _exports_in_bash(script: str, env: dict[str, str]) -> dict[str, str]:
    """Run the script's export lines in bash, with ``env`` as the submitting environment."""
    lines = [ln for ln in script.splitlines() if ln.startswith(("export ", "[ -n"))]
    keys = ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    code = "\n".join([*lines, *(f'printf "%s\\0" "${{{k}-}}"' for k in keys)])
    out = (
        subprocess.run(["bash", "-c", code], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    return dict(zip(keys, out))


def test_allocator_and_flight_recorder_defaults_reach_the_sbatch_script_and_yield_to_the_user() -> None:
    """Issue 31 item 4: expandable segments, and flight-recorder dumps in the run directory, not /tmp."""
    run_dir = SITE / "runs" / "gpu-16node"
    got = _exports_in_bash(render_job("gpu-16node"), {})
    assert got == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_FR_DUMP_TEMP_FILE": f"{run_dir}/nccl_trace_rank_",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{run_dir}/nccl_trace_rank_",
    }
    # set where sbatch ran (sbatch passes the environment on), or in slurm.env: the user's value wins
    assert (
        _exports_in_bash(render_job("gpu-16node"), {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})[
            "PYTORCH_CUDA_ALLOC_CONF"
        ]
        == "max_split_size_mb:512"
    )
    user = _exports_in_bash(render_job("gpu-16node", env={"TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"}), {})
    assert user["TORCH_FR_DUMP_TEMP_FILE"] == "/scratch/fr_"
    # a run directory with shell characters stays one literal path
    odd = Path("/r/a b$(touch x)'\"")
    script = render(
        SlurmConfig(nodes=1, gpus_per_node=8),
        LaunchSpec(job_name="t", run_dir=odd, workdir=Path("/w"), trainer=["-m", "x"]),
    )
    assert _exports_in_bash(script, {})["TORCH_FR_DUMP_TEMP_FILE"] == f"{odd}/nccl_trace_rank_"


def test_the_local_launcher_sets_the_same_defaults_unless_the_environment_has_them(tmp_path: Path) -> None:
    env = with_run_defaults({"PATH": "/bin"}, tmp_path)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/nccl_trace_rank_"
    assert with_run_defaults({"PYTORCH_CUDA_ALLOC_CONF": "x"}, tmp_path)["PYTORCH_CUDA_ALLOC_CONF"] == "x"
