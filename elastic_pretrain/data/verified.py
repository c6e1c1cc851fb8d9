"""Hash a shard once per machine, not once per rank (issue 31).

:func:`verify_shard_once`: the rank that checks a shard first records its expected sha256 with the file's
identity (device, inode, size, mtime, ctime) in the user's private cache; other ranks and later runs on the
machine trust a record whose digest and identity match. It cannot vouch for other bytes: any write moves the
ctime, which no user can set, and a replacement changes the inode. Without a usable cache every rank hashes.
docs/data.md, "Errors" (the paragraph on verifying shards).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from elastic_pretrain.data.manifest import ShardInfo, verify_shard
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import read_json_object, write_private

log = logging.getLogger(__name__)

ENV = "ELASTIC_PRETRAIN_VERIFY_CACHE"
RECORD_BYTES = 4096


def cache_dir() -> Path | None:
    """The user's private record directory, created 0700; None when it cannot be made or is not ours."""
    base = os.environ.get(ENV) or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "elastic-pretrain" / "verified"
    )
    path = Path(base)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    if path.is_symlink() or not path.is_dir() or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return None  # a link, or a directory others can write into: records there would vouch for nothing
    return path


def identity(st: os.stat_result) -> list[int]:
    """What changes when the file's bytes can have changed: a write moves ctime, a replacement the inode."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def verify_shard_once(path: Path, info: ShardInfo, mode: str) -> str | None:
    """:func:`~elastic_pretrain.data.manifest.verify_shard`, hashing at most once per machine (module docstring)."""
    root = cache_dir() if mode == "sha256" and info.sha256 else None
    if root is None:
        return verify_shard(path, info, mode)
    key = hashlib.sha256(f"{path.resolve()}\0{info.sha256}".encode()).hexdigest()
    with _locked(root / f"{key}.lock") as held:
        try:
            before = identity(path.stat())
        except OSError:
            return verify_shard(path, info, mode)  # missing: says so
        record = root / f"{key}.json"
        if _trusted(record, info, before):
            return None
        problem = verify_shard(path, info, mode)
        if problem is None and held and identity(path.stat()) == before:
            with contextlib.suppress(OSError):
                write_private(record, json.dumps({"sha256": info.sha256, "file": before}), root=root)
        return problem


def _trusted(record: Path, info: ShardInfo, now: list[int]) -> bool:
    try:
        data = read_json_object(record, "a shard verification record", limit=RECORD_BYTES)
    except (OSError, UserError):
        return False  # none yet, or not one of ours: hash
    return data.get("sha256") == info.sha256 and data.get("file") == now


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` for the block; yields False (no lock, no record written) where the
    lock file cannot be opened or locked (e.g. a file system without locks)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
