"""One trainer per run directory: rank 0 holds an exclusive ``flock`` on ``trainer.lock`` for the whole run.

Two trainers in one run directory (a second ``train`` of the same job, an experiment rerun while its runs
train) would write the same checkpoints and history over each other. The second is refused before it writes
anything; the lock goes with the process (a crash or a kill releases it). docs/run-directory.md."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from elastic_pretrain.errors import UserError
from elastic_pretrain.jsonsafe import JSONInputError
from elastic_pretrain.jsonsafe import loads as json_loads

_NOTE_LIMIT = 4096  # the holder's note: one small JSON object
_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def _printable(value: object, limit: int = 64) -> str:
    text = str(value)
    return "".join(c if c.isprintable() else "?" for c in text)[:limit]


def describe_holder(note: bytes) -> str:
    """The holder's note in words (it is another process's file: parsed, never trusted, bounded)."""
    try:
        d = json_loads(note, "trainer.lock")
        pid, host, since = int(d["pid"]), _printable(d["host"]), _printable(d["since"])
    except (JSONInputError, ValueError, KeyError, TypeError):
        return "another trainer"
    return f"another trainer (pid {pid} on {host}, since {since})"


class RunLock:
    """The exclusive lock on a run directory's ``trainer.lock`` (taken by one process: rank 0)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock: None when taken, else who holds it (:func:`describe_holder`). A link or a
        non-regular file in its place is a one-line UserError (nothing in a run directory points outside it)."""
        try:
            fd = os.open(self.path, _FLAGS, 0o644)
        except OSError as err:
            if self.path.is_symlink():
                raise UserError(
                    f"{self.path} is a symbolic link (a run directory holds no links): delete it and train again"
                ) from None
            raise UserError(f"{self.path}: {err.strerror}: pick a --run-dir you can write to") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UserError(f"{self.path} is not a regular file: delete it and train again")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return describe_holder(os.pread(fd, _NOTE_LIMIT, 0))
            note = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(note) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return None

    def release(self) -> None:
        """Give the lock back (the note stays: it is read only while someone holds the lock)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def refusal(run_dir: Path, holder: str) -> str:
    return (
        f"run directory {run_dir} is being trained by {holder}: wait for it to finish (or stop it), "
        "or train into another --run-dir"
    )
