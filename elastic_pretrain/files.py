"""Every file the package writes into a run directory, a checkpoint or an export, and every metadata file it
reads from one, goes through this module (issue 35).

A run directory may come from someone else: any name in it can be a planted link, a FIFO or ``/dev/zero``.
So writes go to a new ``O_EXCL | O_NOFOLLOW`` temporary file renamed over the target, directories below the
user's root are opened ``O_NOFOLLOW``, and reads require a regular file and stop at a bound (:data:`LIMITS`).
``tests/security/test_no_unsafe_writes.py`` fails on a write that does not come through here.
docs/security.md, "Files in a run directory: writes and reads".
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from elastic_pretrain.errors import UserError

_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]+")
MAX_JSON_BYTES = 1 << 20  # the small JSON files of an export are kilobytes

KiB, MiB = 1 << 10, 1 << 20
# The most bytes each kind of metadata file may hold (a bigger one was not written by elastic-pretrain). A
# bound is what stops a sparse file or a link to /dev/zero from filling memory; each is far above what a
# real run writes (measured in docs/security.md).
LIMITS: dict[str, int] = {
    "job_id": 64,  # a Slurm job id: at most 20 digits
    "latest": 64,  # "step_<N>"
    "mlflow_run_id": 256,  # 32 hex digits
    "marker": 64 * KiB,  # FINISHED / STOPPED / CANCELLED: one small JSON object or line
    "run.json": 1 * MiB,
    "config.yaml": 16 * MiB,  # a resolved job
    "trainer.json": 64 * MiB,  # counters, controller, data position, config, layout
    "COMMITTED": 64 * MiB,  # one [size, crc32] per file of the checkpoint
    "records": 64 * MiB,  # the tensor writer's records, one per file it wrote
    "history": 1024 * MiB,  # history.jsonl / summary.json: one line per step of the run
    "quality_budget.csv": 64 * MiB,
    "export.json": 16 * MiB,  # an export's config.json / provenance
    "rng": 64 * MiB,  # rng/rank_<R>.pt: a few RNG states
}


def is_plain_name(name: object) -> bool:
    """One file name, no separator, not ``.``/``..``: joined to a directory it stays in that directory."""
    return isinstance(name, str) and bool(_PLAIN_NAME.fullmatch(name)) and name not in (".", "..")


def inside(path: Path, root: Path) -> bool:
    """``path`` resolves (links followed) to a place under ``root`` (resolved the same way)."""
    return path.resolve().is_relative_to(root.resolve())


# --- what a name in a run directory is -----------------------------------------------------------------
def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISREG, "a regular file")):  # fmt: skip
        if test(mode):
            return name
    return "of an unknown type"


def _not_plain(path: Path | str, what: str) -> UserError:
    return UserError(
        f"{path}: is {what}, not the plain file elastic-pretrain writes there (something planted in a run "
        "directory must not make it read or write elsewhere): delete it"
    )


def _not_a_dir(path: Path, what: str) -> UserError:
    return UserError(
        f"{path}: is {what}, not a directory; elastic-pretrain writes only into real directories below the one "
        "you named (a link planted there would send the write elsewhere): delete it"
    )


# --- directories ----------------------------------------------------------------------------------------
def _below(path: Path, root: Path) -> tuple[str, ...]:
    """The names leading from ``root`` to ``path`` (lexically: neither is resolved)."""
    rel = Path(os.path.abspath(path)).relative_to(os.path.abspath(root))  # ValueError: a caller's mistake
    if any(p in ("..", ".") for p in rel.parts):
        raise ValueError(f"{path} is not below {root}")
    return rel.parts


def open_dir(path: Path, *, root: Path, create: bool = True) -> int:
    """A descriptor of directory ``path``: ``root`` opened as given (created with its parents if missing),
    then each name below it opened with ``O_NOFOLLOW`` from its parent's descriptor — made first if
    missing and ``create`` — so that a link or a file there is a one-line error, never followed."""
    if create:
        Path(root).mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = Path(root)
    try:
        for name in _below(path, root):
            where = where / name
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise _not_a_dir(where, _kind(os.lstat(name, dir_fd=fd).st_mode)) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure_dir(path: Path, *, root: Path) -> Path:
    """Create (or check) directory ``path`` below ``root`` as :func:`open_dir` does; returns ``path``."""
    os.close(open_dir(path, root=root))
    return path


def remove_tree(path: Path) -> None:
    """Remove ``path``: a link or a file is unlinked (its target untouched), a directory removed with its
    contents (``shutil.rmtree`` never follows the links inside). Nothing there: nothing to do."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


# --- writes ------------------------------------------------------------------------------------------------
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _create_temp(dir_fd: int, prefix: str, mode: int) -> tuple[int, str]:
    for _ in range(64):
        name = f"{prefix}{secrets.token_hex(6)}.tmp"
        try:
            return os.open(name, _NEW, mode, dir_fd=dir_fd), name
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary file {prefix}*.tmp (64 names taken)")


def create_exclusive(directory: Path, prefix: str, mode: int = 0o666) -> tuple[int, Path]:
    """A new file ``<directory>/<prefix><random>.tmp`` opened for writing: (fd, path). ``mode`` is reduced by
    the umask, as for ``open``; an existing entry of that name (file or link) is never used."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd, name = _create_temp(dir_fd, prefix, mode)
    finally:
        os.close(dir_fd)
    return fd, directory / name


@contextlib.contextmanager
def _replacing(path: Path, root: Path, mode: int) -> Iterator[tuple[int, int, str]]:
    """(directory fd, temp file fd, temp name): on success the temp file is fsynced and renamed over
    ``path`` (and the directory fsynced); on an error it is removed."""
    dir_fd = open_dir(path.parent, root=root)
    try:
        fd, tmp = _create_temp(dir_fd, f".{path.name}.", mode)
        try:
            yield dir_fd, fd, tmp
            os.fsync(fd)
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def atomic_file(path: Path, *, root: Path, mode: int = 0o666) -> Iterator[BinaryIO]:
    """A new binary file that replaces ``path`` (below ``root``) when the block ends without an error:
    ``with atomic_file(p, root=run_dir) as f: torch.save(obj, f)``."""
    with _replacing(path, root, mode) as (_, fd, _), os.fdopen(os.dup(fd), "wb") as f:
        yield f
        f.flush()


@contextlib.contextmanager
def atomic_path(path: Path, *, root: Path, mode: int = 0o666) -> Iterator[Path]:
    """For a library that writes to a path it opens itself (the profiler's trace): a new empty temporary
    file beside ``path``, created exclusively; renamed over ``path`` when the block ends without an error."""
    with _replacing(path, root, mode) as (_, _, tmp):
        yield path.parent / tmp


def write_atomic(path: Path, data: str | bytes, *, root: Path, mode: int = 0o666) -> Path:
    """Replace ``path`` (below ``root``) by ``data`` (text is UTF-8) through a new temporary file; returns ``path``."""
    with atomic_file(path, root=root, mode=mode) as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return path


def write_private(path: Path, data: str | bytes, *, root: Path) -> Path:
    """:func:`write_atomic`, readable by the owner only (created 0600; a umask only takes bits away): the one
    writer of files that may hold a secret (a tracking URI, ``slurm.env`` values, the resolved job). The mode
    is the new file's from its creation, so no reader ever sees the data under a wider one."""
    return write_atomic(path, data, root=root, mode=0o600)


def append_text(path: Path, text: str, *, root: Path) -> None:
    """Append ``text`` to ``path`` (below ``root``; created if missing), which must be a regular file with one
    link: ``O_NOFOLLOW`` refuses a planted link, ``O_NONBLOCK`` a FIFO without a reader, ``fstat`` the rest."""
    dir_fd = open_dir(path.parent, root=root)
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path.name, flags, 0o666, dir_fd=dir_fd)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.ENXIO):
                raise
            raise _not_plain(path, _kind(os.lstat(path.name, dir_fd=dir_fd).st_mode)) from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_plain(path, _kind(st.st_mode))
        if st.st_nlink != 1:
            raise _not_plain(path, f"a file with {st.st_nlink} hard links")
        data = text.encode()
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


def open_new(path: Path) -> BinaryIO:
    """``open(path, "wb")`` for a large file written in place inside a directory this process just created
    (the tensor files of a save): a link at ``path`` is refused (``O_NOFOLLOW``), never written through."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _not_plain(path, _kind(st.st_mode))
    return os.fdopen(fd, "wb")


def copy_file(src: Path, dst: Path, *, root: Path, follow: bool = False, mode: int = 0o666) -> Path:
    """Copy the regular file ``src`` to ``dst`` (below ``root``) as :func:`atomic_file` writes. ``src`` is
    refused when it is a link, unless ``follow`` (a file the user named, such as their tokenizer)."""
    with _open_plain(src, follow=follow) as f_in, atomic_file(dst, root=root, mode=mode) as f_out:
        shutil.copyfileobj(f_in, f_out, 1 << 20)
    return dst


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reads -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _open_plain(path: Path, *, follow: bool = False) -> Iterator[BinaryIO]:
    """``path`` opened for reading if it is a regular file (a FIFO is opened without blocking, then refused)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise _not_plain(path, "a symbolic link") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_plain(path, _kind(mode))
        yield f


def read_bounded(path: Path, kind: str) -> bytes:
    """The bytes of the regular file ``path``, at most ``LIMITS[kind]`` of them; a link, a FIFO, a device, or
    a larger file is a one-line UserError. A missing file raises ``FileNotFoundError`` as ``open`` does."""
    limit = LIMITS[kind]
    with _open_plain(path) as f:
        # the size first (a sparse file claims gigabytes on no disk), then one byte more for a file still growing
        data = f.read(limit + 1) if os.fstat(f.fileno()).st_size <= limit else None
    if data is None or len(data) > limit:
        raise UserError(
            f"{path}: more than {limit:,} bytes, far more than elastic-pretrain writes in a {kind} file (it was "
            "not written by elastic-pretrain): delete it or use another run directory"
        )
    return data


def read_text_bounded(path: Path, kind: str) -> str:
    """:func:`read_bounded` decoded as UTF-8 (else a one-line UserError)."""
    data = read_bounded(path, kind)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: byte {err.start} is not UTF-8 text; it was not written by elastic-pretrain") from None


def read_text_or_none(path: Path, kind: str) -> str | None:
    """Stripped contents of a small metadata file (:func:`read_text_bounded`), None if missing or empty."""
    try:
        text = read_text_bounded(path, kind).strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text or None


# --- reads of an export folder (links followed) ---------------------------------------------------------
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
