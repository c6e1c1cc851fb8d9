"""``elastic-pretrain train``: run a job (one process, or one rank under torchrun)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from elastic_pretrain.quiet import third_party_warnings


def _quiet_logs() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    third_party_warnings()
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _launch(args: argparse.Namespace, overrides: list[str]) -> int:
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
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), ERRORS_ENV: errors}
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
    _quiet_logs()
    from elastic_pretrain.job import load_job

    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={args.run_dir}")
    if args.resume_from:
        overrides.append(f"checkpoint.resume_from={Path(args.resume_from).resolve()}")
    job = load_job(args.job, overrides)
    if args.nproc_per_node and "RANK" not in os.environ:
        return _launch(args, overrides)
    from elastic_pretrain.train.trainer import train

    train(job)
    return 0


def _show(args: argparse.Namespace) -> int:
    from elastic_pretrain.job import dump_job, load_job

    print(dump_job(load_job(args.job, list(args.overrides))), end="")
    return 0


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
        type=int,
        metavar="N",
        help="start torchrun with N local ranks (validates the job first); omit under torchrun/srun",
    )
    p.set_defaults(handler=_train)
    c = sub.add_parser("config", help="print the resolved job config (presets and overrides applied)")
    c.add_argument("job")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    c.set_defaults(handler=_show)
