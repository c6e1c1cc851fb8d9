"""The run directory's own MLflow store (``<run_dir>/mlflow/mlflow.db``), checked before MLflow opens it.

A run directory may come from someone else, and its store says where MLflow uploads artifacts, with the
user's credentials. So before any MLflow client touches a local store (only sqlite3 runs here),
:func:`check_store` checks the files and the database, :func:`claim_locations` keeps artifact locations
relative to the store's folder (a copied run directory's absolute ``file://`` form rewritten, anything else
refused), and :func:`artifact_dir` rebuilds the upload folder itself. Relative locations keep a run directory
self-contained (issue 33). docs/security.md, "The run directory's own MLflow store (`mlflow/mlflow.db`)".
"""

from __future__ import annotations

import dataclasses
import os
import re
import sqlite3
import stat
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from elastic_pretrain.config import clip
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import copy_file, ensure_dir, read_text_or_none
from elastic_pretrain.tracking.config import local_store_dir, redact_uri

DB_NAME = "mlflow.db"
ARTIFACTS = "artifacts"  # the artifact root, relative to the store's folder
SIDE_FILES = ("-journal", "-wal", "-shm")  # sqlite opens these beside the database, following links
QUERY_TIME_LIMIT_S = 60.0  # one statement on a local store; a real store answers in well under a second
_HEADER = b"SQLite format 3\x00"
_RUN_ID = re.compile(r"[0-9a-f]{32}")
# Triggers MLflow's own migrations create (mlflow 3.x: secrets are immutable); any other one is foreign.
_MLFLOW_TRIGGERS = {("prevent_secrets_aad_mutation", "secrets")}
_MLFLOW_TABLES = ("experiments", "runs", "alembic_version")


def store_db(run_dir: Path) -> Path:
    return local_store_dir(run_dir) / DB_NAME


def _fix(run_dir: Path) -> str:
    return (
        f"move {local_store_dir(run_dir)} aside to start a fresh store, or log elsewhere "
        "(--uri, $MLFLOW_TRACKING_URI or tracking.uri; tracking.backend=none to turn it off)"
    )


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))  # fmt: skip


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


# --- the file ------------------------------------------------------------------------------------------------
def check_store_file(run_dir: Path, *, writing: bool) -> Path | None:
    """``mlflow.db`` of ``run_dir`` if it exists (None if not), after checking that it and the folder holding
    it are what the tracker creates: a real directory ``mlflow/`` and regular files, never a link (sqlite
    would open the file it names), a FIFO (the open blocks) or a device. ``writing``: a file with more than
    one hard link is refused too — a copy made with ``cp -l`` shares its store with the original."""
    store_dir = local_store_dir(run_dir)
    try:
        mode = os.lstat(store_dir).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        raise UserError(f"{store_dir}: is {_kind(mode)}, not the run's own MLflow folder: {_fix(run_dir)}")
    db = store_dir / DB_NAME
    for path in (db, *(db.with_name(DB_NAME + s) for s in SIDE_FILES)):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            raise UserError(
                f"{path}: is {_kind(st.st_mode)}, not a file of the run's own MLflow store (MLflow would read or "
                f"write what it names): {_fix(run_dir)}"
            )
        if writing and st.st_nlink > 1:
            raise UserError(
                f"{path}: has {st.st_nlink} hard links (a copy made with cp -l shares it with the original, which "
                f"logging here would change): replace it by a copy of its own (cp {path.name} x && mv x {path.name})"
            )
    return db if os.path.lexists(db) else None


def _read_header(db: Path) -> bytes:
    fd = os.open(db, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the lstat
            raise UserError(f"{db}: not a regular file")
        return os.read(fd, len(_HEADER))
    finally:
        os.close(fd)


# --- queries, time-boxed -------------------------------------------------------------------------------------
@contextmanager
def _connect(db: Path, *, readonly: bool) -> Iterator[sqlite3.Connection]:
    uri = db.absolute().as_uri() + ("?mode=ro" if readonly else "?mode=rw")
    with closing(sqlite3.connect(uri, uri=True, timeout=30.0)) as con:
        con.execute("PRAGMA trusted_schema=OFF")  # no SQL function with side effects from the schema
        yield con


def _query(con: sqlite3.Connection, db: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run one statement under :data:`QUERY_TIME_LIMIT_S`; every failure is one line naming the store."""
    deadline = time.monotonic() + QUERY_TIME_LIMIT_S
    con.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)  # nonzero: sqlite aborts the statement
    try:
        rows = con.execute(sql, params).fetchall()
        if con.in_transaction:
            con.commit()
        return rows
    except sqlite3.Error as err:
        raise store_error(db, err) from None
    finally:
        con.set_progress_handler(None, 0)


def store_error(db: Path, err: BaseException) -> UserError:
    """One line for an sqlite error on ``db``: a time-boxed query, a damaged file, a foreign schema."""
    text = " ".join(str(err).split())
    if "interrupted" in text:
        return UserError(
            f"{db}: a query on this MLflow store ran past {QUERY_TIME_LIMIT_S:.0f} s (a view or trigger that never "
            f"ends?): {_fix(db.parent.parent)}"
        )
    return UserError(f"{db}: not a readable MLflow store ({clip(text, 120)}): {_fix(db.parent.parent)}")


# --- the schema ------------------------------------------------------------------------------------------------
def check_store(run_dir: Path, *, writing: bool) -> Path | None:
    """``mlflow.db`` of ``run_dir`` checked as a file (:func:`check_store_file`) and as a database: an SQLite
    header, MLflow's tables, no view (MLflow makes none: one is how a store hangs every query) and no trigger
    but MLflow's own. None when there is no store yet (an empty file counts as none: MLflow fills it)."""
    db = check_store_file(run_dir, writing=writing)
    if db is None or os.lstat(db).st_size == 0:
        return None
    if _read_header(db) != _HEADER:
        raise UserError(f"{db}: not an SQLite database (its first bytes are not SQLite's header): {_fix(run_dir)}")
    with _connect(db, readonly=True) as con:
        objects = _query(con, db, "SELECT type, name, tbl_name FROM sqlite_master")
    tables = {name for kind, name, _ in objects if kind == "table"}
    views = sorted(name for kind, name, _ in objects if kind == "view")
    triggers = sorted((name, table) for kind, name, table in objects if kind == "trigger")
    foreign = [f"view {n!r}" for n in views] + [f"trigger {n!r}" for n, t in triggers if (n, t) not in _MLFLOW_TRIGGERS]
    if foreign:
        raise UserError(
            f"{db}: holds {', '.join(clip(f, 40) for f in foreign[:3])}, which MLflow never creates (a view or trigger "
            f"can make every query on the store run forever): {_fix(run_dir)}"
        )
    missing = [t for t in _MLFLOW_TABLES if t not in tables]
    if missing:
        raise UserError(f"{db}: not an MLflow store (no table {missing[0]!r}): {_fix(run_dir)}")
    return db


# --- artifact locations ------------------------------------------------------------------------------------------
def relative_location(location: str, run_dir: Path, what: str) -> str:
    """``location`` as a path relative to the store's folder, below ``artifacts/``, or a one-line refusal.

    Accepted: the relative form the tool stores; an absolute path or ``file://`` URI whose tail is
    ``mlflow/artifacts/...`` (MLflow's own form, from this run directory wherever it was created, copied
    or moved to: it maps to the same place here). Refused: any other scheme, host or path."""
    split = urllib.parse.urlsplit(location)
    path = urllib.parse.unquote(split.path) if split.scheme == "file" else location
    foreign = split.scheme not in ("", "file") or split.netloc not in ("", "localhost") or "\\" in path
    parts = PurePosixPath(path).parts if not foreign else ()
    if parts and parts[0] == "/":
        tails = [i for i in range(len(parts) - 1) if parts[i] == "mlflow" and parts[i + 1] == ARTIFACTS]
        parts = parts[tails[-1] + 1 :] if tails else ()
    if not parts or parts[0] != ARTIFACTS or any(p in ("..", ".", "") for p in parts):
        raise UserError(
            f"{store_db(run_dir)}: {what} keeps its artifacts at {clip(redact_uri(location), 100)}, outside this run "
            f"directory (a run directory from someone else must not choose where your files or MLflow credentials "
            f"go): {_fix(run_dir)}"
        )
    return str(PurePosixPath(*parts))


@dataclasses.dataclass
class _Row:
    table: str  # experiments | runs
    key: str  # experiment_id | run_uuid
    ident: Any
    location: str | None
    what: str


def _rows(con: sqlite3.Connection, db: Path, experiment: str | int | None, run_id: str | None) -> list[_Row]:
    rows: list[_Row] = []
    exp_ids: set[int] = set()
    if run_id is not None:
        for rid, exp_id, uri in _query(con, db, "SELECT run_uuid, experiment_id, artifact_uri FROM runs "
                                                "WHERE run_uuid = ?", (run_id,)):  # fmt: skip
            rows.append(_Row("runs", "run_uuid", rid, uri, f"run {rid}"))
            exp_ids.add(exp_id)
    if isinstance(experiment, str):
        found = _query(con, db, "SELECT experiment_id FROM experiments WHERE name = ?", (experiment,))
        exp_ids.update(r[0] for r in found)
    elif experiment is not None:
        exp_ids.add(experiment)
    for exp_id in sorted(exp_ids):
        for ident, name, loc in _query(con, db, "SELECT experiment_id, name, artifact_location FROM experiments "
                                                "WHERE experiment_id = ?", (exp_id,)):  # fmt: skip
            rows.append(_Row("experiments", "experiment_id", ident, loc, f"experiment {clip(str(name), 60)!r}"))
    return rows


def claim_locations(run_dir: Path, *, experiment: str | int | None = None, run_id: str | None = None) -> None:
    """Check the artifact locations of ``experiment`` (a name or an id) and of run ``run_id`` with its
    experiment — the ones the tool is about to use — and store each in relative form (the rewrite that makes
    a copied run directory its own). Refused in one line when one points outside the run directory.
    Nothing to do when the store does not exist yet."""
    db = check_store(run_dir, writing=True)
    if db is None:
        return
    with _connect(db, readonly=False) as con:
        rows = _rows(con, db, experiment, run_id)
        fixed = [(r, relative_location(r.location or "", run_dir, r.what)) for r in rows]  # all checked first
        for r, rel in fixed:
            if rel != r.location:
                _query(con, db, f"UPDATE {r.table} SET {_column(r.table)} = ? WHERE {r.key} = ?", (rel, r.ident))
        _relative_default_experiment(con, db)


def _column(table: str) -> str:
    return {"experiments": "artifact_location", "runs": "artifact_uri"}[table]


def _relative_default_experiment(con: sqlite3.Connection, db: Path) -> None:
    """MLflow creates experiment 0 ('Default') in every store with ``<working directory>/mlruns/0``: the
    tool never logs there, but a self-contained store names nothing outside it."""
    rows = _query(con, db, "SELECT artifact_location FROM experiments WHERE experiment_id = 0")
    if rows and isinstance(rows[0][0], str) and rows[0][0].rstrip("/").endswith("/mlruns/0"):
        _query(con, db, "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (f"{ARTIFACTS}/0",))


def artifact_dir(run_dir: Path, location: str) -> Path:
    """The folder inside ``run_dir``'s store that a checked location names, created if missing; a folder on
    the way that is a link (a planted ``artifacts -> ~/x``) or a file is refused in one line, not followed."""
    store_dir = local_store_dir(run_dir)
    return _make_dirs(store_dir, PurePosixPath(relative_location(location, run_dir, "the run")).parts)


def _make_dirs(root: Path, parts: tuple[str, ...]) -> Path:
    """``root/parts...``, each folder made if missing; one that exists must be a real directory (the safe
    writer's directory walk: files.ensure_dir, which refuses a link or a file on the way in one line)."""
    return ensure_dir(root.joinpath(*parts), root=root)


# --- uploads into the run directory ------------------------------------------------------------------------------
def copy_artifact(src: Path, dest_dir: Path, artifact_path: str | None) -> None:
    """``src`` (a file, or a folder's files) into ``dest_dir/<artifact_path>/`` — what MLflow's local artifact
    repository does, with the destination taken from the run directory, never from the store. Each file goes
    through a new exclusive temporary file renamed over its name: a link planted at a name is replaced, never
    written through; a link or a file where a folder belongs is refused (:func:`_make_dirs`)."""
    base = PurePosixPath(artifact_path).parts if artifact_path else ()
    if any(p in ("..", "/") for p in base):
        raise ValueError(f"artifact path {artifact_path!r} must stay inside the run's artifacts")
    if not src.is_dir():
        _copy_file(src, _make_dirs(dest_dir, base))
        return
    for dirpath, _, names in os.walk(src):  # links to folders inside a staging copy are not followed
        rel = Path(dirpath).relative_to(src).parts
        for name in names:
            _copy_file(Path(dirpath) / name, _make_dirs(dest_dir, (*base, src.name, *rel)))


def _copy_file(src: Path, folder: Path) -> None:
    """One regular file (never a link: a staging copy holds none) through the safe writer."""
    copy_file(src, folder / src.name, root=folder)


# --- MLflow's own queries on a local store, time-boxed ---------------------------------------------------------
_timed: set[str] = set()
_timed_lock = threading.Lock()


def time_box(db: Path) -> None:
    """Every statement MLflow's SQLAlchemy engine runs on ``db`` from now on is aborted after
    :data:`QUERY_TIME_LIMIT_S` (sqlite's progress handler; the caller sees an ``interrupted`` error). The
    schema check refuses the views and triggers known to loop; this bounds whatever else could."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    with _timed_lock:
        if not _timed:
            event.listen(Engine, "before_cursor_execute", _arm)
        _timed.add(str(db.absolute()))


def _arm(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
    url = conn.engine.url
    if url.get_backend_name() != "sqlite" or url.database not in _timed:
        return
    raw = conn.connection.dbapi_connection
    deadline = time.monotonic() + QUERY_TIME_LIMIT_S
    raw.set_progress_handler(lambda: time.monotonic() > deadline, 10_000)


def is_run_id(text: object) -> bool:
    """An MLflow run id: 32 lowercase hex digits (``uuid4().hex``)."""
    return isinstance(text, str) and bool(_RUN_ID.fullmatch(text))


def read_run_id(path: Path) -> str | None:
    """The MLflow run id a run directory's ``mlflow_run_id`` holds; None if the file is absent or empty.

    The file may be someone else's (``status`` printed whatever it linked to, issue 35): it is read as a
    regular file, no link followed, a FIFO not waited on, at most 256 bytes (``files.read_text_or_none``), and
    the text must be a run id; anything else is a one-line :class:`UserError`."""
    text = read_text_or_none(path, "mlflow_run_id")
    if text is not None and not is_run_id(text):
        raise UserError(
            f"{path}: holds {clip(text, 40)!r}, not an MLflow run id (32 hex digits): delete the file (each "
            "checkpoint records the run id too) or write the right id into it"
        )
    return text
