"""Hostile run directories, checkpoints and exports (issue 35, items 5, 6 and the file-type part of 7): the
exact inputs of the report, each through the real code path that writes or reads the file.

- **Writes** (item 5): a symlink planted at a file the package writes (``eval/eval.md -> ~/victim``) is
  *replaced* by the new file (rename over the link: the victim is untouched, the run goes on); a symlink
  planted at a *directory* it writes into (``eval -> ~/.ssh``), or at a file it appends to
  (``history.jsonl``), is *refused* with one line and the victim is untouched (elastic_pretrain/files.py).
- **convert-checkpoint** (item 6) copies only the ``rng/`` files ``COMMITTED`` lists, each a regular file.
- **Reads** (item 7): a FIFO or a link to ``/dev/zero`` as ``latest``, ``slurm/job_id``, ``trainer.json``,
  ``run.json`` or ``COMMITTED`` is one line, not a hang or a memory bomb. Each such test runs the command
  in a subprocess with a timeout, or the reader in a forked child with a timeout and a memory cap, so a
  regression fails instead of hanging the suite.

The structural half (no module writes around files.py) is tests/security/test_no_unsafe_writes.py.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import signal
import stat
import subprocess
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastic_pretrain.checkpoint.store import CheckpointStore
from elastic_pretrain.errors import UserError
from elastic_pretrain.rundir import RunFiles
from tests.conftest import REPO, VENV_BIN
from tests.slurm.slurm_helpers import tiny_data

CLI = str(VENV_BIN / "elastic-pretrain")
SECRET = "the user's own file: never overwritten, never copied\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the user's outside every run directory (``~/.bashrc``, ``~/secret``)."""
    path = tmp_path / "home" / "secret"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def untouched(victim: Path) -> None:
    assert victim.read_text() == SECRET, "the planted link was written through"
    assert sorted(p.name for p in victim.parent.iterdir()) == [victim.name], "a file was created beside the victim"


def replaced(path: Path) -> str:
    """``path`` is now a regular file of ours (the link planted there was replaced); its text."""
    assert not path.is_symlink() and path.is_file(), path
    return path.read_bytes().decode("utf-8", "replace")


def one_line(err: pytest.ExceptionInfo[UserError], *needles: str) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text
    return text


def committed_run(run: Path, step: int = 2, *, trainer: bool = True) -> Path:
    """``run/checkpoints/step_<step>``, committed by the real store (one tensor file, a trainer.json)."""
    store = CheckpointStore(RunFiles(run).checkpoints)
    tmp = store.prepare(step)
    (tmp / "model_optim" / "__0_0.distcp").write_bytes(b"x" * 100)
    if trainer:
        state = {"trainer": {"step": step, "tokens": 64 * step, "elapsed_s": 1.0}}
        (tmp / "trainer.json").write_text(json.dumps(state))
    return store.commit(step, {"model_optim/__0_0.distcp": [100, zlib.crc32(b"x" * 100)]})


# ====================================================================================== item 5: writes
def quality_curve() -> Any:
    from elastic_pretrain.eval.curves import CurvePoint, QualityCurve

    return QualityCurve(name="tiny", points=(CurvePoint(1, 0.5, 3.0), CurvePoint(2, 1.0, 2.5)))


def test_eval_report_replaces_links_planted_at_eval_md_and_quality_png(tmp_path: Path, victim: Path) -> None:
    """``eval`` writes ``eval.md`` and ``quality.png`` into ``<run>/eval/step_N/`` (the run may be someone
    else's): each planted link is replaced by the report, the victim keeps its bytes."""
    from elastic_pretrain.eval.commands import write_report

    run = tmp_path / "run"
    out = RunFiles(run).eval_dir("step_2")
    plant(out / "eval.md", victim)
    plant(out / "quality.png", victim)
    written = write_report(out, run, "| loops | loss |\n", quality_curve(), None)
    assert written == [out / "eval.md", out / "quality.png"]
    untouched(victim)
    assert replaced(out / "eval.md") == "| loops | loss |\n"
    assert replaced(out / "quality.png").startswith("\ufffdPNG")
    assert sorted(p.name for p in out.iterdir()) == ["eval.md", "quality.png"]  # no temp files left


def test_a_planted_eval_directory_is_refused(tmp_path: Path, victim: Path) -> None:
    """``<run>/eval -> ~/.ssh``: writing the report there would create or replace files in that folder."""
    from elastic_pretrain.eval.commands import write_report

    run = tmp_path / "run"
    run.mkdir()
    plant(run / "eval", victim.parent)
    with pytest.raises(UserError) as err:
        write_report(RunFiles(run).eval_dir("step_2"), run, "report\n", quality_curve(), None)
    one_line(err, f"{run / 'eval'}: is a symbolic link, not a directory", "delete it")
    untouched(victim)


def test_private_files_are_owner_only_atomic_and_never_written_through_a_link(
    tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``files.write_private``, the one writer of files that may hold a secret (``config.yaml``,
    ``mlflow/run.json``, ``slurm/job.yaml``, the batch script): created 0600 under any umask and over a wider
    file; the old file whole when the write fails; a planted link replaced, a linked directory refused."""
    from elastic_pretrain.files import write_private

    run = tmp_path / "run"
    umask = os.umask(0)
    try:
        job = write_private(run / "slurm" / "job.yaml", "token: x\n", root=run)  # makes run/ and slurm/
    finally:
        os.umask(umask)
    assert stat.S_IMODE(job.stat().st_mode) == 0o600 and job.read_text() == "token: x\n"
    wide = run / "config.yaml"
    wide.write_text("old\n")
    wide.chmod(0o644)
    write_private(wide, b"new\n", root=run)
    assert stat.S_IMODE(wide.stat().st_mode) == 0o600 and wide.read_text() == "new\n"

    def no_disk(fd: int) -> None:
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", no_disk)
        with pytest.raises(OSError, match="disk full"):
            write_private(wide, "half\n", root=run)
    assert wide.read_text() == "new\n" and sorted(p.name for p in run.iterdir()) == ["config.yaml", "slurm"]

    plant(run / "mlflow" / "run.json", victim)
    write_private(run / "mlflow" / "run.json", "{}\n", root=run)
    untouched(victim)
    assert replaced(run / "mlflow" / "run.json") == "{}\n"
    assert sorted(p.name for p in (run / "mlflow").iterdir()) == ["run.json"]  # no temp file left
    plant(run / "eval", victim.parent)
    with pytest.raises(UserError) as err:
        write_private(run / "eval" / "secret", "token\n", root=run)
    one_line(err, f"{run / 'eval'}: is a symbolic link, not a directory")
    untouched(victim)


def test_history_and_summary_replace_planted_links(mesh1: Any, tmp_path: Path, victim: Path) -> None:
    """The trainer's ``history.jsonl`` (rewritten at every start) and ``summary.json``."""
    from elastic_pretrain.train.step import StepResult
    from elastic_pretrain.train.trainer import SummaryWriter, TrainState

    files = RunFiles(tmp_path / "run")
    plant(files.history, victim)
    plant(files.summary, victim)
    writer = SummaryWriter(files.run_dir, mesh1)
    state = TrainState(step=1, tokens=64)
    result = StepResult(loss=3.0, loss_by_loops={1: 3.0}, grad_norm=1.0, lr=1e-3, skipped=False, aux={})
    writer.on_step(state, result, 0.1)
    writer.on_end(state, {1: 3.0})
    untouched(victim)
    assert [json.loads(line)["step"] for line in replaced(files.history).splitlines()] == [1]
    assert json.loads(replaced(files.summary))["steps"] == 1


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_appending_to_a_planted_history_is_refused(mesh1: Any, tmp_path: Path, victim: Path, planted: str) -> None:
    """``history.jsonl`` swapped for a link (or a FIFO) while the run goes: the append (``O_APPEND |
    O_NOFOLLOW | O_NONBLOCK``, then ``fstat``) refuses it in one line instead of writing there (or blocking)."""
    from elastic_pretrain.train.step import StepResult
    from elastic_pretrain.train.trainer import SummaryWriter, TrainState

    files = RunFiles(tmp_path / "run")
    files.run_dir.mkdir()
    writer = SummaryWriter(files.run_dir, mesh1)
    files.history.unlink()
    if planted == "link":
        plant(files.history, victim)
    else:
        os.mkfifo(files.history)
    result = StepResult(loss=3.0, loss_by_loops={1: 3.0}, grad_norm=1.0, lr=1e-3, skipped=False, aux={})
    answer = in_child(writer.on_step, TrainState(step=1, tokens=64), result, 0.1)  # opening a FIFO blocked
    what = "symbolic link" if planted == "link" else "FIFO"
    assert answer.startswith(f"UserError: {files.history}: is a {what}") and "\n" not in answer, answer
    untouched(victim)


def test_checkpoint_index_replaces_a_planted_link(tmp_path: Path, victim: Path) -> None:
    from elastic_pretrain.checkpoint.index import write_index

    files = RunFiles(tmp_path / "run")
    committed_run(files.run_dir)
    plant(files.checkpoint_index, victim)
    assert write_index(files.run_dir) == files.checkpoint_index
    untouched(victim)
    assert [row["step"] for row in json.loads(replaced(files.checkpoint_index))] == [2]


def test_a_planted_checkpoints_directory_is_refused(tmp_path: Path, victim: Path) -> None:
    """``checkpoints -> elsewhere``: a save (and index.json, latest) would be written into that folder."""
    from elastic_pretrain.checkpoint.index import write_index

    files = RunFiles(tmp_path / "run")
    plant(files.checkpoints, victim.parent)
    with pytest.raises(UserError) as err:
        CheckpointStore(files.checkpoints).prepare(2)
    one_line(err, f"{files.checkpoints}: is a symbolic link, not a directory")
    with pytest.raises(UserError):
        write_index(files.run_dir)
    untouched(victim)


def test_quality_budget_never_writes_through_links(tmp_path: Path, victim: Path) -> None:
    """The tracker's quality-budget table and plot; ``quality_budget.tmp`` was the old fixed temporary name."""
    from elastic_pretrain.tracking import quality

    run = tmp_path / "run"
    folder = run / "mlflow" / "quality_budget"
    for name in ("quality_budget.tmp", "quality_budget.tmp.png", quality.CSV_NAME, quality.PNG_NAME):
        plant(folder / name, victim)
    history = {10: {1: 3.0, 2: 2.5}}
    quality.write_table(folder / quality.CSV_NAME, history, root=run)
    quality.write_plot(folder / quality.PNG_NAME, history, root=run)
    untouched(victim)
    assert replaced(folder / quality.CSV_NAME).splitlines()[0] == "step,loops,val_loss,val_ppl"
    assert quality.read_table(folder / quality.CSV_NAME) == history
    assert replaced(folder / quality.PNG_NAME).startswith("\ufffdPNG")
    shutil.rmtree(folder)
    plant(folder, victim.parent)  # the folder itself
    with pytest.raises(UserError):
        quality.write_table(folder / quality.CSV_NAME, history, root=run)
    untouched(victim)


def test_lm_eval_report_never_writes_through_links(tmp_path: Path, victim: Path) -> None:
    from elastic_pretrain.export.lm_eval_run import LmEvalResult

    export = tmp_path / "export"
    plant(export / "lm_eval" / "lm_eval.md", victim)
    plant(export / "lm_eval" / "lm_eval.json", victim)
    result = LmEvalResult(loops=[1], flops_per_token={1: 1e6}, scores={("t", "acc"): {1: 0.5}}, samples={})
    result.write(export / "lm_eval", root=export)
    untouched(victim)
    assert replaced(export / "lm_eval" / "lm_eval.md") == result.markdown()
    shutil.rmtree(export / "lm_eval")
    plant(export / "lm_eval", victim.parent)
    with pytest.raises(UserError) as err:
        result.write(export / "lm_eval", root=export)
    one_line(err, "lm_eval: is a symbolic link, not a directory")
    untouched(victim)


# ------------------------------------------------------------------------ Slurm files (submit / cancel)
@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny job in a scratch copy of the repository's presets, and a fake Slurm on PATH: sbatch prints
    job id 4242, scancel succeeds, squeue/sacct know no job."""
    monkeypatch.chdir(tmp_path)
    for preset in ("parallel", "data"):
        shutil.copytree(REPO / preset, tmp_path / preset)
    path = tmp_path / "jobs" / "tiny.yaml"
    path.parent.mkdir()
    base = (REPO / "jobs" / "tiny-cpu.yaml").read_text().replace("data: stdlib-code", f"data: {tiny_data(tmp_path)}")
    kept = "".join(ln for ln in base.splitlines(True) if not ln.startswith("name:"))
    path.write_text(kept + "name: tiny\nslurm:\n  nodes: 2\n")
    bin_dir = tmp_path / "fake-slurm"
    bin_dir.mkdir()
    for name, body in (("sbatch", "echo 4242"), ("scancel", "exit 0"), ("squeue", "exit 1"), ("sacct", "exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return path


def test_submit_and_cancel_never_write_through_links(
    job: Path, tmp_path: Path, victim: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``slurm/job_id.tmp`` (the old fixed temporary name), ``slurm/train.sbatch`` and ``slurm/CANCELLED``
    planted as links to the user's file are replaced; ``slurm/job_id`` as a link is not read (submit reads it
    first, to refuse a second live job): one line."""
    from elastic_pretrain import cli

    files = RunFiles(tmp_path / "shared-run")
    plant(files.job_id, victim)
    assert cli.main(["submit", str(job), "--run-dir", str(files.run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{files.job_id}: is a symbolic link" in err, err
    files.job_id.unlink()
    for path in (files.job_id.with_suffix(".tmp"), files.script, files.cancelled):
        plant(path, victim)
    assert cli.main(["submit", str(job), "--run-dir", str(files.run_dir)]) == 0, capsys.readouterr().err
    untouched(victim)
    assert replaced(files.job_id) == "4242\n"
    assert replaced(files.script).startswith("#!")
    plant(files.cancelled, victim)  # submit removed the earlier marker
    assert cli.main(["cancel", str(files.run_dir)]) == 0, capsys.readouterr().err
    untouched(victim)
    assert replaced(files.cancelled) == "4242\n"


def test_a_planted_slurm_directory_is_refused(
    job: Path, tmp_path: Path, victim: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastic_pretrain import cli

    files = RunFiles(tmp_path / "shared-run")
    plant(files.slurm_dir, victim.parent)
    assert cli.main(["submit", str(job), "--run-dir", str(files.run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{files.slurm_dir}: is a symbolic link, not a directory" in err, err
    untouched(victim)


# =============================================================================== item 7: reads that hang
def in_child(fn: Callable[..., Any], *args: Any, timeout: float = 30.0, memory: int = 256 << 20) -> str:
    """Run ``fn(*args)`` in a forked child with ``memory`` bytes of address space more than it starts with,
    killed after ``timeout`` s: ``"returned"``, ``"UserError: <message>"``, another exception's type and
    message, or ``"hung"`` — so that a read which blocks or never ends fails the test instead of the suite."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_fd)
        try:
            status = Path("/proc/self/status").read_text().splitlines()
            vm = next(int(ln.split()[1]) * 1024 for ln in status if ln.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (vm + memory, vm + memory))
            fn(*args)
            out = "returned"
        except BaseException as err:  # whatever it raised is the answer
            out = f"{type(err).__name__}: {err}"
        os.write(write_fd, out.encode()[:8000])
        os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_fd)
            return "hung"
        time.sleep(0.05)
    with os.fdopen(read_fd, "rb") as f:
        return f.read().decode()


def test_the_child_runner_reports_a_hang_and_a_memory_bomb(tmp_path: Path) -> None:
    """The harness itself: the old reads (``read_text`` of a FIFO, of /dev/zero) come back as a hang and a
    MemoryError, not as a stuck test run."""
    os.mkfifo(tmp_path / "fifo")
    assert in_child(lambda: (tmp_path / "fifo").read_text(), timeout=2) == "hung"
    assert in_child(lambda: Path("/dev/zero").read_bytes()).startswith("MemoryError")


HOSTILE = {
    "fifo": lambda path: os.mkfifo(path),
    "/dev/zero": lambda path: path.symlink_to("/dev/zero"),
}


def _make(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() or path.is_symlink():
        path.unlink()
    HOSTILE[kind](path)


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_commit_marker_read_is_bounded(tmp_path: Path, kind: str) -> None:
    """``COMMITTED -> /dev/zero`` (or a FIFO): ``verify`` (resume, ``--resume-from``, eval, convert) read it
    to the end, forever; the listing (``checkpoints``, resume's newest step) is refused the same way."""
    from elastic_pretrain.checkpoint.store import verify

    ckpt = committed_run(tmp_path / "run")
    _make(ckpt / "COMMITTED", kind)
    answer = in_child(verify, ckpt)
    assert answer.startswith(f"UserError: {ckpt / 'COMMITTED'}: is a "), answer
    assert "\n" not in answer
    answer = in_child(CheckpointStore(ckpt.parent).committed)
    assert answer.startswith(f"UserError: {ckpt / 'COMMITTED'}: is a "), answer


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_trainer_json_read_is_bounded(tmp_path: Path, kind: str) -> None:
    from elastic_pretrain.checkpoint.store import read_trainer_state

    ckpt = committed_run(tmp_path / "run")
    _make(ckpt / "trainer.json", kind)
    answer = in_child(read_trainer_state, ckpt)
    assert answer.startswith(f"UserError: {ckpt / 'trainer.json'}: is a "), answer


def run_cli(*args: str, timeout: float = 60, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The command in a subprocess, killed after ``timeout`` s (a hang fails the test, it does not hang it);
    ``path``: a folder put first on PATH."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PATH": f"{path}{os.pathsep}{os.environ['PATH']}"}
    try:
        return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"elastic-pretrain {shlex.join(args)} hung (killed after {timeout:.0f} s)")


def refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    out = proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, out
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, out
    for needle in needles:
        assert needle in lines[0], out


# (command, the file made hostile) -> what the error names. Each hung before: open() of a FIFO blocks.
CLI_CASES = [
    ("checkpoints", "checkpoints/latest"),
    ("checkpoints", "checkpoints/step_2/trainer.json"),
    ("status", "checkpoints/latest"),
    ("status", "slurm/job_id"),
    ("runs", "mlflow/run.json"),
]


@pytest.mark.parametrize(("command", "name"), CLI_CASES)
def test_a_fifo_in_a_run_directory_is_one_line_not_a_hang(tmp_path: Path, command: str, name: str) -> None:
    run = tmp_path / "run"
    committed_run(run)
    (run / "checkpoints" / "latest").write_text("step_2\n")
    _make(run / name, "fifo")
    refused(run_cli(command, str(run)), f"{run / name}: is a FIFO", "delete it")


@pytest.mark.parametrize(("command", "name"), [("status", "slurm/job_id"), ("runs", "mlflow/run.json")])
def test_dev_zero_in_a_run_directory_is_one_line(tmp_path: Path, command: str, name: str) -> None:
    run = tmp_path / "run"
    committed_run(run)
    _make(run / name, "/dev/zero")
    refused(run_cli(command, str(run)), f"{run / name}: is a symbolic link")


def test_good_run_directory_still_reads(tmp_path: Path) -> None:
    """The same commands on the files as the package writes them."""
    run = tmp_path / "run"
    committed_run(run)
    (run / "checkpoints" / "latest").write_text("step_2\n")
    (run / "slurm").mkdir()
    (run / "slurm" / "job_id").write_text("4242\n")
    proc = run_cli("checkpoints", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    assert [(r["step"], r["latest"]) for r in json.loads(proc.stdout)] == [(2, True)]
    bin_dir = tmp_path / "fake-slurm"  # squeue and sacct that know no job
    bin_dir.mkdir()
    for name in ("squeue", "sacct"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    proc = run_cli("status", str(run), path=bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert "job 4242" in proc.stdout and "last step:  2" in proc.stdout, proc.stdout


# ====================================================================== item 6: convert-checkpoint rng/
# The report's exact input, a real checkpoint converted end to end: tests/engine/test_convert.py
# (test_convert_copies_only_the_listed_rng_files, on that module's trained runs).
def test_a_listed_rng_link_is_refused(tmp_path: Path, victim: Path) -> None:
    """A link that COMMITTED lists (re-recorded by whoever made the checkpoint) is refused, not copied."""
    from elastic_pretrain.checkpoint.store import file_records, verify
    from elastic_pretrain.engine.convert import copy_rng

    ckpt = committed_run(tmp_path / "run")
    inside = ckpt / "model_optim" / "data.bin"  # a link must stay inside the checkpoint to pass verify
    inside.write_bytes(b"y" * 10)
    plant(ckpt / "rng" / "rank_00000.pt", inside)
    marker = json.loads((ckpt / "COMMITTED").read_text())
    marker["files"] = file_records(ckpt, [p for p in ckpt.rglob("*") if p.is_file() and p.name != "COMMITTED"])
    (ckpt / "COMMITTED").write_text(json.dumps(marker))
    out = tmp_path / "out"
    (out / "rng").mkdir(parents=True)
    with pytest.raises(UserError) as err:
        copy_rng(ckpt, out, verify(ckpt))
    one_line(err, "rng/rank_00000.pt: is a symbolic link")
    assert list((out / "rng").iterdir()) == []


# ============================================================================ end to end: eval on a share
def test_eval_refuses_a_planted_eval_directory_before_evaluating(tmp_path: Path, victim: Path) -> None:
    """``elastic-pretrain eval step_2`` of a shared run whose ``eval`` is a link: exit 2 with one line, before
    the model is loaded (the default output folder ``<run>/eval/step_2`` is checked below the run directory,
    not taken as given the way ``--out`` is)."""
    ckpt = committed_run(tmp_path / "shared")
    (tmp_path / "shared" / "config.yaml").write_text("name: tiny-cpu\n")  # a run directory (issue 33: eval/ beside)
    plant(tmp_path / "shared" / "eval", victim.parent)
    refused(run_cli("eval", str(ckpt), "--sequences", "2", "--no-track"),
            f"{tmp_path / 'shared' / 'eval'}: is a symbolic link")  # fmt: skip
    untouched(victim)
