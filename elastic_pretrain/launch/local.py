"""The node launcher: torchrun's agent, run in a process of ours. ``train --nproc-per-node N`` runs it
on this machine; under Slurm ``slurm/train.sbatch`` runs it once per node (``srun``), instead of torchrun.

Why not the ``torchrun`` binary: a user error on a rank would print a ``ChildFailedError`` traceback per
failure after every rank printed the same message. Here a rank leaves its one-line error in :data:`ERRORS_ENV`'s
folder and exits 2, and the error is printed once. Stop signals are blocked in the ranks and this process,
taken by a thread (``sigwait``) and passed on, so none is lost before a trainer's handler exists.
docs/checkpoints.md, "Signals (preemption)"; docs/slurm.md, "When the job stops on a user error".
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from elastic_pretrain.checkpoint.preempt import STOP_SIGNALS
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import write_atomic

ERRORS_ENV = "ELASTIC_PRETRAIN_ERRORS"
USER_ERROR_EXIT = 2


def _errors_dir() -> Path | None:
    folder = os.environ.get(ERRORS_ENV)
    return Path(folder) if folder and "RANK" in os.environ else None


def report_user_error(message: str) -> bool:
    """Under this launcher: leave this rank's one-line error for the launcher to print once. True if left."""
    folder = _errors_dir()
    if folder is None:
        return False
    path = folder / f"rank_{int(os.environ['RANK']):05d}"
    if not folder.is_dir():  # made by the launcher (or node 0's batch script): absent here, not shared with us
        return False
    try:
        write_atomic(path, message, root=folder)
    except (OSError, UserError):  # e.g. the folder is not shared with this node: print it here after all
        return False
    return True


def peer_reported() -> bool:
    """Under this launcher: another rank left a user error (so a broken collective here is its echo)."""
    folder = _errors_dir()
    return folder is not None and any(folder.glob("rank_*"))


def reported_error(folder: Path) -> str | None:
    """The ranks' errors as one line: the lowest rank's message, plus any different one (with its rank)."""
    seen: dict[str, int] = {}
    for path in sorted(folder.glob("rank_*")):
        with contextlib.suppress(OSError, UnicodeDecodeError, ValueError):
            seen.setdefault(path.read_text().strip().replace("\n", " "), int(path.name.removeprefix("rank_")))
    if not seen:
        return None
    first, *others = seen
    return first + "".join(f" (rank {seen[o]}: {o})" for o in others)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


class _QuietOnReported(logging.Filter):
    """Drop the agent's 'closing signal' / 'failed (exitcode: …)' lines once a rank reported a user error."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        noise = record.msg.startswith(("Sending process", "failed (exitcode")) if isinstance(record.msg, str) else False
        return not (noise and any(self.folder.glob("rank_*")))


def _relay_stop_signals(nproc: int) -> None:
    """Pass every stop signal this process gets on to its ranks, waiting for them if they are not started
    yet (their blocked mask keeps it pending until the trainer's handler is in place)."""
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        name = signal.Signals(info.si_signo).name
        if info.si_pid != os.getppid():  # not relayed by `elastic-pretrain train` (which said so itself)
            print(
                f"elastic-pretrain train: the launcher (pid {os.getpid()}) got {name} from pid {info.si_pid}: "
                "the trainers save at the next step and exit",
                file=sys.stderr,
                flush=True,
            )
        ranks = children(os.getpid())
        for _ in range(600):  # the agent starts the ranks within seconds of its own start
            if len(ranks) >= nproc:
                break
            time.sleep(0.2)
            ranks = children(os.getpid())
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, info.si_signo)


def main(argv: list[str]) -> int:
    """``python -m elastic_pretrain.launch.local <torchrun arguments>``; run by ``train --nproc-per-node`` and
    by slurm/train.sbatch on each node."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # before any thread or rank exists: all inherit it
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
    threading.Thread(target=_relay_stop_signals, args=(nproc,), name="stop-signals", daemon=True).start()
    folder = Path(os.environ[ERRORS_ENV]) if os.environ.get(ERRORS_ENV) else None
    if folder is not None:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietOnReported(folder))
    try:
        run(args)
    except ChildFailedError:
        if folder is not None and any(folder.glob("rank_*")):
            return USER_ERROR_EXIT  # the elastic-pretrain process prints the ranks' message once
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
