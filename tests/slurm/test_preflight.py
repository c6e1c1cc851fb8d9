"""``submit`` as the cluster will see it, without a cluster (issue 33, item 10; launch/preflight.py): the
dry run lists what the real submit refuses — a GPU job on the submit host's CPU-only interpreter, missing
shards or tokenizer, a finished run directory — and says when partition/account are unset; the job is
snapshotted into the run at submit (a requeue trains what was submitted); ``slurm.setup`` site lines run
in the batch script; one log per Slurm job id."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_helpers import tiny_data

from elastic_pretrain import cli
from elastic_pretrain.checkpoint.store import CheckpointStore
from elastic_pretrain.config import ConfigError
from elastic_pretrain.job import to_dict
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.launch.config import SlurmConfig
from elastic_pretrain.launch.render import LaunchSpec, render
from elastic_pretrain.rundir import RunFiles

REPO = Path(__file__).resolve().parents[2]
CPU_TORCH = "+cpu" in importlib.metadata.version("torch")
TINY = (REPO / "jobs" / "tiny-cpu.yaml").read_text().replace("data: stdlib-code", "data: tiny")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A submit directory like the repository's (jobs/, parallel/, data/), with nothing prepared in cache/."""
    monkeypatch.chdir(tmp_path)
    for folder in ("jobs", "parallel", "data"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    return tmp_path


@pytest.fixture
def tiny(site: Path) -> Path:
    """jobs/tiny.yaml: the tiny job on a small corpus prepared into cache/tiny (data/tiny.yaml)."""
    tiny_data(site)
    job = site / "jobs" / "tiny.yaml"
    job.write_text(TINY.replace("name: tiny-cpu", "name: tiny"))
    return job


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_16_node_dry_run_lists_what_the_real_submit_refuses(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's input, on a submit host with the CPU venv and no corpus prepared."""
    code, out, err = run_cli(["submit", "jobs/gpu-16node.yaml", "--dry-run"], capsys)
    assert code == 2 and out.startswith("#!/bin/bash"), err  # the script is still shown for review
    refused = [ln for ln in err.splitlines() if ln.startswith("# refused: ")]
    if CPU_TORCH:
        assert f"slurm.python: the job asks for 8 GPUs per node, but its nodes would run this interpreter " \
               f"({sys.executable}, torch" in refused[0] and "no CUDA" in refused[0]  # fmt: skip
    assert any("data.tokenizer.path:" in r and "cache/tokenizer/tokenizer.json: no such file" in r for r in refused)
    assert any("cache/corpus-tok/manifest.json: no manifest; run `elastic-pretrain prepare-data" in r for r in refused)
    assert "# slurm.partition is not set (--partition): the job goes to the cluster's default partition" in err
    assert "# slurm.account is not set (--account): the job goes to your default account" in err
    assert "the real submit would refuse this job" in err and not (site / "runs").exists()
    # the real submit: the first refusal in one line, nothing written
    code, out, err = run_cli(["submit", "jobs/gpu-16node.yaml", "--partition", "gpu", "--account", "llm"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "submit --dry-run lists them" in err and not (site / "runs").exists()


def test_a_gpu_job_runs_the_python_it_is_given(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["submit", "jobs/gpu-16node.yaml", "slurm.python=/lustre/venv/bin/python",
                              "--partition", "gpu", "--account", "llm", "--dry-run"], capsys)  # fmt: skip
    assert code == 2 and "PYTHON=/lustre/venv/bin/python" in out
    assert "slurm.python" not in err and "slurm.partition" not in err and "slurm.account" not in err


def test_shards_and_tokenizer_are_checked(tiny: Path, site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["submit", str(tiny), "--nodes", "2", "--partition", "cpu", "--account", "a",
                            "--dry-run"], capsys)  # fmt: skip
    assert code == 0 and "refused" not in err, err
    shard = sorted((site / "cache" / "tiny" / "train").glob("shard.*"))[0]
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated: another size than the manifest's
    code, _, err = run_cli(["submit", str(tiny), "--nodes", "2", "--dry-run"], capsys)
    assert code == 2 and f"shards missing or of another size than the manifest says (first: {shard.name})" in err
    code, _, err = run_cli(["submit", str(tiny), "--nodes", "2", "data.tokenizer.kind=hf",
                            "data.tokenizer.path=tok/tokenizer.json", "--dry-run"], capsys)  # fmt: skip
    assert code == 2 and f"data.tokenizer.path: {site / 'tok' / 'tokenizer.json'}: no such file" in err


def finish(run_dir: Path, job_file: Path, steps: int) -> None:
    """The run directory as a finished training leaves it: step_<steps> committed, FINISHED."""
    files = RunFiles(run_dir)
    store = CheckpointStore(files.checkpoints)
    tmp = store.prepare(steps)
    meta = {"config": to_dict(load_job(job_file)), "trainer": {"step": steps, "tokens": 1, "elapsed_s": 1.0}}
    (tmp / "trainer.json").write_text(json.dumps(meta))
    store.commit(steps, {})
    files.finished.write_text(json.dumps({"step": steps, "tokens": 1}))


def test_a_finished_run_directory_is_refused_unless_trained_further(
    tiny: Path, site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finish(site / "runs" / "tiny", tiny, 300)
    code, _, err = run_cli(["submit", str(tiny), "--nodes", "2", "--dry-run"], capsys)
    assert code == 2 and f"# refused: {site / 'runs' / 'tiny'} has finished training at step 300" in err
    assert "to train it further raise train.steps above 300" in err and "pick another --run-dir" in err
    code, _, err = run_cli(["submit", str(tiny), "train.steps=400", "--nodes", "2", "--dry-run"], capsys)
    assert code == 0 and "refused" not in err, err
    code, _, err = run_cli(["submit", str(tiny), "train.steps=400", "model.loops=3", "--nodes", "2", "--dry-run"],
                           capsys)  # fmt: skip
    assert code == 2 and "the model shape changed (model.loops: 2 -> 3)" in err


def fake_sbatch(site: Path, monkeypatch: pytest.MonkeyPatch, job_id: str = "4242") -> None:
    """An sbatch that accepts the script and prints a job id (what ``sbatch --parsable`` prints)."""
    bin_dir = site / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho {job_id}\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_the_job_is_snapshotted_into_the_run_at_submit(
    tiny: Path, site: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every (re)start trains the job as submitted: the trainer reads <run_dir>/slurm/job.yaml (presets and
    overrides resolved), not the job YAML, which may be edited while the job waits or runs."""
    fake_sbatch(site, monkeypatch)
    overrides = ["train.steps=70", "model.hidden_size=64"]
    code, out, err = run_cli(["submit", str(tiny), *overrides, "--nodes", "2"], capsys)
    assert code == 0, err
    files = RunFiles(site / "runs" / "tiny")
    assert f"log:    {files.slurm_dir / 'train-4242.log'}" in out
    assert files.job_snapshot.stat().st_mode & 0o777 == 0o600  # secrets (slurm.env, tracking.uri) included
    script = files.script.read_text()
    assert f"TRAINER=(-m elastic_pretrain.cli train {files.job_snapshot} --run-dir {files.run_dir})" in script
    expected = to_dict(load_job(tiny, overrides))
    tiny.write_text(TINY.replace("hidden_size: 96", "hidden_size: 128"))  # edited after submit
    (site / "parallel" / "cpu-ep2.yaml").write_text("expert: 1\n")
    assert to_dict(load_job(files.job_snapshot)) == expected


def test_training_further_takes_the_old_finished_marker_away(
    tiny: Path, site: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch script ends a job whose run has FINISHED as finished: a finished run submitted again to train
    further must not keep the old marker (the trainer would remove it only once it starts)."""
    fake_sbatch(site, monkeypatch)
    finish(site / "runs" / "tiny", tiny, 300)
    assert run_cli(["submit", str(tiny), "train.steps=400", "--nodes", "2"], capsys)[0] == 0
    assert not RunFiles(site / "runs" / "tiny").finished.exists()


def test_a_refused_sbatch_leaves_the_run_finished_and_a_planted_marker_link_is_not_followed(
    tiny: Path, site: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing submitted: FINISHED is back byte for byte. A FINISHED that is a link (a run directory from
    someone else) is refused in one line before sbatch, and neither read nor written through (issue 35)."""
    bin_dir = site / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: x' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    finish(site / "runs" / "tiny", tiny, 300)
    files = RunFiles(site / "runs" / "tiny")
    before = files.finished.read_bytes()
    code, _, err = run_cli(["submit", str(tiny), "train.steps=400", "--nodes", "2"], capsys)
    assert code == 2 and "invalid partition" in err and files.finished.read_bytes() == before, err
    outside = site / "outside.json"
    outside.write_bytes(before)
    files.finished.unlink()
    files.finished.symlink_to(outside)
    code, _, err = run_cli(["submit", str(tiny), "train.steps=400", "--nodes", "2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "symbolic link" in err, err
    assert files.finished.is_symlink() and outside.read_bytes() == before


# --- slurm.setup: site lines -----------------------------------------------------------------------------
def setup_block(script: str) -> str:
    m = re.search(r"^SETUP=\(.*?\)$", script, flags=re.M)
    loop = re.search(r'^set \+u\nfor line in "\$\{SETUP\[@\]\}"; do\n.*?^done\nset -u$', script, flags=re.M | re.S)
    assert m and loop, "slurm/train.sbatch lost its slurm.setup block"
    return m.group(0) + "\n" + loop.group(0)


def run_setup(lines: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = render(
        SlurmConfig(nodes=2, setup=lines),
        LaunchSpec(job_name="t", run_dir=Path("/r"), workdir=Path("/w"), trainer=["-m", "x"]),
    )
    code = 'log() { echo "[log] $*"; }\n' + setup_block(script) + '\necho "SITE=$SITE PATH=$PATH"\n'
    return subprocess.run(["bash", "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)


def test_setup_lines_run_in_the_batch_shell_before_the_nodes_start(tmp_path: Path) -> None:
    (tmp_path / "activate").write_text('export PATH="/opt/site/bin:$PATH"\n[ -n "$UNSET_IN_ACTIVATE" ] || true\n')
    lines = ["export SITE='a b'  # a comment", f"source {tmp_path / 'activate'}", "true && echo done"]
    proc = run_setup(lines, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "SITE=a b PATH=/opt/site/bin:" in proc.stdout and "[log] slurm.setup: true && echo done" in proc.stdout


def test_a_failing_setup_line_ends_the_job(tmp_path: Path) -> None:
    proc = run_setup(["export A=1", "module load cuda/12.4", "export B=2"], tmp_path)
    assert proc.returncode == 1
    assert "[log] error: slurm.setup line failed (exit 127): module load cuda/12.4" in proc.stdout
    assert "slurm.setup: export B=2" not in proc.stdout  # nothing after it runs


def test_setup_without_lines_renders_an_empty_block_and_bad_lines_are_refused() -> None:
    script = render(SlurmConfig(nodes=2), LaunchSpec(job_name="t", run_dir=Path("/r"), workdir=Path("/w"),
                                                     trainer=["-m", "x"]))  # fmt: skip
    assert "SETUP=()" in script
    with pytest.raises(ConfigError, match=re.escape("slurm.setup: 'a\\nb' is not one shell command")):
        SlurmConfig(setup=["a\nb"])


def test_a_site_template_without_the_setup_placeholder_is_refused(tmp_path: Path) -> None:
    template = tmp_path / "site.sbatch"
    template.write_text((REPO / "slurm" / "train.sbatch").read_text().replace("SETUP=({{SETUP}})", ""))
    spec = LaunchSpec(job_name="t", run_dir=Path("/r"), workdir=Path("/w"), trainer=["-m", "x"])
    with pytest.raises(ConfigError, match=r"does not use \{\{SETUP\}\}, so the job's slurm.setup lines"):
        render(SlurmConfig(template=str(template), setup=["module load x"]), spec)
    render(SlurmConfig(template=str(template)), spec)  # no setup lines: nothing to drop


def test_one_log_per_slurm_job_id() -> None:
    script = render(SlurmConfig(nodes=2), LaunchSpec(job_name="t", run_dir=Path("/r/100%"), workdir=Path("/w"),
                                                     trainer=["-m", "x"]))  # fmt: skip
    # %j: the job id (sbatch's pattern); the run directory's own % doubled; quoted for sbatch's directive parser
    assert '#SBATCH --output="/r/100%%/slurm/train-%j.log"' in script
    assert RunFiles(Path("/r")).job_log("77") == Path("/r/slurm/train-77.log")
