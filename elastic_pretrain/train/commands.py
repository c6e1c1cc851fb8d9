"""``elastic-pretrain train``: run a job (one process, or one rank under torchrun)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_pretrain.quiet import quiet_logs

if TYPE_CHECKING:  # annotations only: the command imports what it runs when it runs
    from elastic_pretrain.job import JobConfig


def _launch(args: argparse.Namespace, overrides: list[str], run_dir: Path) -> int:
    """Validate the job here (one-line errors), then start torchrun's agent with one rank per process
    (``launch/local.py``: a user error on any rank prints here, once, exit 2 — no launcher traceback).

    Stop signals (SIGTERM, SIGUSR1/2, SIGINT) sent to this process go to every trainer, which saves at
    the next step boundary and exits 0 — the same contract as under Slurm (slurm/train.sbatch): the
    launcher runs in its own session with those signals blocked (its ranks inherit that, so a signal
    that comes before a trainer's handler waits for it); this process says so and signals the
    launcher, which passes the signal to every rank. A second SIGINT (Ctrl-C twice) kills the trainers."""
    import tempfile

    from elastic_pretrain.checkpoint.preempt import STOP_SIGNALS
    from elastic_pretrain.errors import UserError
    from elastic_pretrain.launch.environment import with_run_defaults
    from elastic_pretrain.launch.local import ERRORS_ENV, children, reported_error

    cmd = [
        sys.executable,
        "-m",
        "elastic_pretrain.launch.local",
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "--signals-to-handle",
        "SIGHUP,SIGQUIT",
        "-m",
        "elastic_pretrain.cli",
        "train",
        args.job,
        *overrides,
    ]

    def block_stop_signals() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        # if this process dies (even SIGKILL), the launcher gets SIGHUP, which it handles by ending its ranks
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGHUP))  # PR_SET_PDEATHSIG

    interrupts = 0

    def forward(signum: int, frame: object) -> None:
        nonlocal interrupts
        interrupts += signum == signal.SIGINT
        name = signal.Signals(signum).name
        if interrupts > 1:  # torchrun starts each rank in a session of its own: kill them by pid
            print(f"elastic-pretrain train: got {name} again: killing the trainers", file=sys.stderr, flush=True)
            for pid in [*children(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        again = " (Ctrl-C again kills them)" if signum == signal.SIGINT else ""
        print(f"elastic-pretrain train: got {name}: the trainers save at the next step and exit{again}",
              file=sys.stderr, flush=True)  # fmt: skip
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)  # the launcher passes it to every rank, started or about to start

    with tempfile.TemporaryDirectory(prefix="elastic-pretrain-errors-") as errors:
        env = with_run_defaults(
            {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), ERRORS_ENV: errors}, run_dir
        )
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=block_stop_signals)
        previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
        try:
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        message = reported_error(Path(errors))
    if message:
        raise UserError(message)
    return code


def _train(args: argparse.Namespace) -> int:
    quiet_logs()
    job = job_from_args(args)
    if args.nproc_per_node and "RANK" not in os.environ:
        from elastic_pretrain.parallel.validate import check_layout

        check_layout(job, args.nproc_per_node)  # once, here, not once per rank after torch imports
        _prepare_run_dir(job.run_path)
        if _finished(job):
            return 0
        return _launch(
            args, [*args.overrides, *(f"{flag}={path}" for flag, path in path_flags(args).items())], job.run_path
        )
    if "RANK" not in os.environ:  # one process, no launcher: say how to start the ranks the job needs
        _check_one_process(job)
        _prepare_run_dir(job.run_path)
        if _finished(job):
            return 0
    from elastic_pretrain.engine import build_session
    from elastic_pretrain.train.trainer import train

    train(job, build_session)  # the command picks the engine (job.engine)
    return 0


def _finished(job: JobConfig) -> bool:
    """The run is finished at ``train.steps``: say so in one line (what to do instead) and start no rank. A
    checkpoint past ``train.steps`` or a changed model shape is refused here too (``train/resume.py``)."""
    from elastic_pretrain.train.resume import check_before_launch

    message = check_before_launch(job)
    if message:
        print(message, flush=True)
    return message is not None


def _prepare_run_dir(run_dir: Path) -> None:
    """The run directory exists as a directory before any rank starts: a path naming a file (or under one, or
    unwritable) used to surface as a gloo error and a torchrun report, 106 lines (issue 33)."""
    from elastic_pretrain.errors import UserError

    if run_dir.is_symlink():
        raise UserError(f"run directory {run_dir} is a symbolic link: give the real directory (--run-dir)")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} exists and is not a directory: pick another --run-dir or move it")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-probe-{os.getpid()}"
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UserError(
            f"run directory {run_dir}: {reason} ({err.filename or run_dir}): pick a --run-dir you can write to"
        ) from None


def _check_one_process(job: JobConfig) -> None:
    """Without ``--nproc-per-node`` (and not under torchrun/srun) the job runs as one rank: a layout that needs
    more ranks gets the launcher flag in its message, not only the divisibility rule it breaks (issue 33)."""
    from elastic_pretrain.config import ConfigError
    from elastic_pretrain.errors import UserError
    from elastic_pretrain.parallel.validate import check_layout

    try:
        check_layout(job, 1)
    except ConfigError as single:
        need = next((n for n in range(2, 65) if _layout_ok(job, n)), None)
        hint = f"add --nproc-per-node {need} (this job's smallest world size)" if need else "add --nproc-per-node N"
        raise UserError(
            f"{single} — train without --nproc-per-node runs one process: {hint}, "
            "or run it as one process with parallel=single"
        ) from None


def _layout_ok(job: JobConfig, world_size: int) -> bool:
    from elastic_pretrain.config import ConfigError
    from elastic_pretrain.parallel.validate import check_layout

    try:
        check_layout(job, world_size)
    except ConfigError:
        return False
    return True


def _nproc(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: give at least 1 process per node (omit the flag under torchrun/srun)")
    return n


def job_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~elastic_pretrain.job.JobConfig` that ``train`` runs for its parsed arguments.

    Paths from flags are set as strings: as ``key=value`` overrides YAML would read ``#`` as a comment,
    ``: `` as a mapping and ``~`` as null, and the trainer would write elsewhere than the flag (and the
    Slurm batch script watching that directory) says."""
    from elastic_pretrain.job_loader import load_job

    paths = path_flags(args)
    values = {"run_dir": paths.get("--run-dir"), "checkpoint.resume_from": paths.get("--resume-from")}
    return load_job(args.job, list(args.overrides), values={k: v for k, v in values.items() if v is not None})


def path_flags(args: argparse.Namespace) -> dict[str, str]:
    """``--run-dir`` / ``--resume-from`` as given (``~`` expanded; the checkpoint made absolute)."""
    out = {}
    if args.run_dir:
        out["--run-dir"] = os.path.expanduser(args.run_dir)
    if args.resume_from:
        out["--resume-from"] = str(Path(args.resume_from).expanduser().resolve())
    return out


def _show(args: argparse.Namespace) -> int:
    from elastic_pretrain.job import dump_job
    from elastic_pretrain.job_loader import load_job

    if args.explain or args.reference:
        from elastic_pretrain.config_reference import explain, reference

        print(explain(args.explain) if args.explain else reference(), end="" if args.reference else "\n")
        return 0
    if args.job is None:
        from elastic_pretrain.errors import UserError

        raise UserError("config: give a job file (jobs/tiny-cpu.yaml), or --explain KEY, or --reference")
    overrides = list(args.overrides)
    if args.gpu_memory is not None:
        overrides.append(f"slurm.gpu_memory={args.gpu_memory}")
    job = load_job(args.job, overrides)
    summary = layout_summary(job, args.world_size) if args.world_size is not None else []
    print(dump_job(job), end="")
    for line in summary:  # YAML comments: the output stays a loadable job file
        print(f"# {line}")
    return 0


def layout_summary(job: JobConfig, world_size: int) -> list[str]:
    """Check the job's layout at ``world_size`` ranks (one-line error on the first broken rule) and
    describe it: the mesh, parameter counts, tokens per step."""
    from elastic_pretrain.model.params import count_parameters, format_count
    from elastic_pretrain.parallel.validate import check_layout, check_memory

    layout = check_layout(job, world_size)
    memory = check_memory(job, world_size, job.slurm.gpu_memory_bytes)
    counts = count_parameters(job.model)
    return [
        f"layout: {layout.describe()}",
        memory,
        f"parameters: {format_count(counts.total)} total, {format_count(counts.active)} active "
        f"({format_count(counts.experts)} in experts, {format_count(counts.embedding)} embedding + output)",
        f"tokens per step: {job.tokens_per_step:,} ({job.train.global_batch_size} x {job.data.seq_len}); "
        f"run: {job.tokens_per_step * job.train.steps:,} tokens in {job.train.steps:,} steps",
    ]


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a job (run under torchrun for several ranks)",
        description="Train jobs/<run>.yaml; presets by name, key.path=value overrides.",
    )
    p.add_argument("job", help="job YAML, e.g. jobs/tiny-cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. model.loops=4")
    p.add_argument("--run-dir", help="run directory (default runs/<name>)")
    p.add_argument(
        "--resume-from",
        metavar="CKPT",
        help="continue from this checkpoint (a checkpoints/step_<N> folder, possibly of another run)",
    )
    p.add_argument(
        "--nproc-per-node",
        type=_nproc,
        metavar="N",
        help="start torchrun with N local ranks (validates the job first); omit under torchrun/srun",
    )
    p.set_defaults(handler=_train)
    c = sub.add_parser("config", help="print the resolved job config (presets and overrides applied)")
    c.add_argument("job", nargs="?", help="job YAML (not needed with --explain / --reference)")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    c.add_argument("--explain", metavar="KEY", help="what a key (schedule.fixed_loops) or a section (schedule) means")
    c.add_argument("--reference", action="store_true", help="print every key with its type, default and meaning")
    c.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="check the layout for N ranks (divisibility of heads, experts, layers, batch, vocabulary; memory)",
    )
    c.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="with --world-size: memory of one GPU (80GiB, 141GB); default: the job's slurm.gpu_memory",
    )
    c.set_defaults(handler=_show)
