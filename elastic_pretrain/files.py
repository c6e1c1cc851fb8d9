"""File names from untrusted files, and atomic replacement that never writes through a planted link.

A name read from a manifest or a checkpoint's metadata becomes a path only if :func:`is_plain_name`
holds (one file name: no separator, not ``.``/``..``) and the joined path stays inside its directory
(:func:`inside`, links followed).

A run directory or a prepared dataset may come from someone else (docs/security.md): a fixed
temporary name such as ``.latest.tmp`` could already be a symlink to any file the user can write,
and ``open(tmp, "w")`` would truncate that file, then ``rename`` would make ``latest`` the link.
The temporary file here is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under an unpredictable
name in the target's own directory (so the rename stays on one file system), and the rename
replaces a link at ``path`` itself, never its target.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")


def is_plain_name(name: object) -> bool:
    """One file name, no separator, not ``.``/``..``: joined to a directory it stays in that directory."""
    return isinstance(name, str) and bool(_PLAIN_NAME.fullmatch(name)) and name not in (".", "..")


def inside(path: Path, root: Path) -> bool:
    """``path`` resolves (links followed) to a place under ``root`` (resolved the same way)."""
    return path.resolve().is_relative_to(root.resolve())


_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def create_exclusive(directory: Path, prefix: str, mode: int = 0o666) -> tuple[int, Path]:
    """A new file ``<directory>/<prefix><random>.tmp`` opened for writing: (fd, path). ``mode`` is
    reduced by the umask, as for ``open``; an existing entry of that name (file or link) is never used."""
    for _ in range(64):
        tmp = directory / f"{prefix}{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, _FLAGS, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{directory}: cannot create a temporary file {prefix}*.tmp (64 names taken)")


def write_atomic(path: Path, text: str, *, mode: int = 0o666) -> None:
    """Write + fsync a new temporary file beside ``path``, then rename it over ``path``."""
    fd, tmp = create_exclusive(path.parent, f".{path.name}.", mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
