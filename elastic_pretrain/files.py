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

Reading a small file from such a directory (a JSON object, a code file to compare) goes through
:func:`read_small`: only a regular file (links followed; a FIFO or a device is refused without
blocking), never more bytes than the caller expects, and every failure one line (``UserError``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

from elastic_pretrain.errors import UserError

_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")
MAX_JSON_BYTES = 1 << 20  # the small JSON files of a run or an export are kilobytes


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


def _open_regular(path: Path, what: str) -> int:
    """A read-only descriptor of a regular file (links followed). A FIFO or device is refused without
    blocking: ``O_NONBLOCK`` makes opening a FIFO return at once, and ``fstat`` tells what it is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UserError(f"{path}: missing; {what}") from None
    except OSError as err:
        raise UserError(f"{path}: cannot be read ({err.strerror}); {what}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{path}: not a regular file; {what}")
    return fd


def check_regular(path: Path, what: str, *, limit: int | None = None) -> None:
    """``path`` is a regular file this user can read (links followed), of at most ``limit`` bytes."""
    fd = _open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if limit is not None and size > limit:
        raise UserError(f"{path}: {size:,} bytes, more than the {limit:,} expected; {what}")


def read_prefix(path: Path, n: int, what: str) -> bytes:
    """At most the first ``n`` bytes of a regular file (links followed)."""
    fd = _open_regular(path, what)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(n)
    except OSError as err:
        raise UserError(f"{path}: cannot be read ({err.strerror}); {what}") from None
    finally:
        os.close(fd)


def read_small(path: Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file (links followed) of at most ``limit`` bytes; nothing beyond is read."""
    data = read_prefix(path, limit + 1, what)
    if len(data) > limit:
        raise UserError(f"{path}: more than the {limit:,} bytes expected; {what}")
    return data


def read_json_object(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """A JSON object from a small regular file; deep nesting, 5,000-digit numbers and non-objects are
    one-line errors (``json`` raises ``RecursionError`` and ``ValueError`` for them)."""
    raw = read_small(path, limit, what)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; {what}") from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to be read; {what}") from None
    except ValueError as err:
        raise UserError(f"{path}: not valid JSON ({str(err)[:80]}); {what}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a JSON {type(data).__name__}, not an object; {what}")
    return data
