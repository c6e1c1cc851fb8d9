"""The checkpoint folder of a run: step directories, commit markers, ``latest``, retention, checks.

A step directory counts only if it is named ``step_<N>`` *and* holds ``COMMITTED``: the marker is written after
every rank's files are complete, and the rename that makes the directory visible comes after it, so a crash at
any moment leaves the old or the new checkpoint committed, never half of one. Everything read here may come
from someone else's run: names, shapes and ``latest`` are checked, each violation a one-line :class:`UserError`.
Layout: docs/run-directory.md (names in ``rundir.py``); docs/checkpoints.md, "Guarantees" and "Crash safety".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_pretrain.errors import UserError
from elastic_pretrain.files import ensure_dir, read_bounded, remove_tree, write_atomic
from elastic_pretrain.files import fsync_dir as _fsync_dir
from elastic_pretrain.jsonsafe import StateError, count, number
from elastic_pretrain.jsonsafe import loads as json_loads
from elastic_pretrain.rundir import (
    COMMIT_FILE,
    LATEST_FILE,
    MODEL_DIR,
    RNG_DIR,
    CheckpointFiles,
    RunFiles,
    step_name,
)
from elastic_pretrain.rundir import STEP_DIR as _STEP_DIR
from elastic_pretrain.rundir import TRAINER_FILE as TRAINER_FILE  # the names of a checkpoint's files: rundir.py

if TYPE_CHECKING:
    from elastic_pretrain.checkpoint.config import CheckpointConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# Crash-safety tests: "<point>:<rank>[:<step>]" -> SIGKILL that rank at that point (of that step's save).
FAULT_ENV = "ELASTIC_PRETRAIN_CKPT_FAULT"
FAULT_POINTS = ("before_tensors", "before_marker", "after_marker", "after_rename")


def fault_point(point: str, rank: int, step: int) -> None:
    """``ELASTIC_PRETRAIN_CKPT_FAULT=<point>:<rank>[:<step>]`` kills this rank (SIGKILL, no clean-up) here.

    Points, in save order: ``before_tensors`` (step directory prepared, nothing written),
    ``before_marker`` (this rank's files written, no marker), ``after_marker`` (marker written inside
    ``.tmp-step_<N>``, not renamed; rank 0), ``after_rename`` (``step_<N>`` in place, ``latest`` still
    names the previous one; rank 0). Without ``<step>`` the first save that reaches the point dies. The
    variable is read once per process (the crash tests set it when they start one): outside the tests a save
    pays one cached lookup per point."""
    fault = _fault()
    if fault is not None and fault[0] == point and fault[1] == rank and fault[2] in (None, step):
        os.kill(os.getpid(), signal.SIGKILL)


@functools.cache
def _fault() -> tuple[str, int, int | None] | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    parts = spec.split(":")
    if parts[0] not in FAULT_POINTS or not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts[1:]):
        points = ", ".join(FAULT_POINTS)
        raise UserError(f"{FAULT_ENV}={spec}: write <point>:<rank>[:<step>], the point one of {points}")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None


def crc32_file(path: Path, durable: bool = False) -> int:
    """CRC32 of ``path``'s bytes; ``durable``: fsync it too (the commit records only files on disk)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
        if durable:
            os.fsync(f.fileno())
    return crc


# The tensor writer's records of the files it wrote (checkpoint/snapshot.py), beside them: the commit takes
# them instead of reading every tensor file again on the training thread. Removed before the commit.
WRITER_RECORDS = "__{rank}.records.json"


def write_records(folder: Path, rank: int, records: dict[str, list[int]]) -> None:
    """In the writer, after its (fsynced) files are complete: ``{file name: [size, crc32]}`` beside them
    (checksummed as they were written: checkpoint/writer.py)."""
    if records:
        write_atomic(folder / WRITER_RECORDS.format(rank=rank), json.dumps(records), root=folder)


def take_writer_records(folder: Path, rank: int) -> dict[str, list[int]]:
    """The records :func:`write_writer_records` left in ``folder`` for ``rank`` (removing them), or {}."""
    path = folder / WRITER_RECORDS.format(rank=rank)
    try:
        records = json_loads(read_bounded(path, "records"), path)
    except (OSError, ValueError, UserError):
        return {}
    path.unlink(missing_ok=True)
    return records if isinstance(records, dict) else {}


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_marker(marker: Any, ckpt: Path) -> dict[str, Any]:
    """``marker`` if it has the shape :meth:`CheckpointStore.commit` writes, with every file name a
    relative path that stays inside ``ckpt``; otherwise a one-line UserError naming what is wrong."""
    where = CheckpointFiles(ckpt).committed
    if not isinstance(marker, dict):
        raise UserError(f"{where}: malformed commit marker (a {type(marker).__name__}, not an object); {_NOT_OURS}")
    if marker.get("version") != FORMAT_VERSION:
        raise UserError(f"{where}: checkpoint format {marker.get('version')!r} is not {FORMAT_VERSION}")
    files = marker.get("files")
    if not _is_count(marker.get("step")) or not isinstance(files, dict):
        raise UserError(f"{where}: malformed commit marker (needs an integer step and a files object); {_NOT_OURS}")
    root = ckpt.resolve()
    for rel, record in files.items():
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts or "\\" in rel or "\0" in rel:
            raise UserError(f"{where}: lists {rel!r}, which is not a path inside the checkpoint; {_NOT_OURS}")
        if not (ckpt / rel).resolve().is_relative_to(root):  # a symlink inside the checkpoint
            raise UserError(f"{where}: {rel!r} leads outside the checkpoint (a symbolic link); {_NOT_OURS}")
        if not (isinstance(record, list) and len(record) == 2 and all(_is_count(v) for v in record)):
            raise UserError(f"{where}: the record of {rel!r} is not [size, crc32]; {_NOT_OURS}")
    return marker


_NOT_OURS = "it was not written by elastic-pretrain: use another checkpoint"


def file_records(root: Path, paths: list[Path], known: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """``{relative path: [size, crc32]}`` for the given files under ``root``, each fsynced. ``known``: records
    by file name that the writer computed (taken when the size still matches; the writer fsynced them)."""
    known = known or {}
    out = {}
    for p in sorted(paths):
        size, record = p.stat().st_size, known.get(p.name)
        ok = isinstance(record, list) and len(record) == 2 and record[0] == size and _is_count(record[1])
        out[str(p.relative_to(root))] = [size, record[1] if ok and record else crc32_file(p, durable=True)]
    return out


@dataclasses.dataclass(frozen=True)
class Committed:
    """One committed checkpoint."""

    step: int
    path: Path
    marker: dict[str, Any]

    @property
    def size_bytes(self) -> int:
        return sum(size for size, _ in self.marker["files"].values())


class CheckpointStore:
    """The ``checkpoints/`` folder of one run directory (all file-system decisions live here)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def _parent(self) -> Path:
        """What the store's writes are relative to: the run directory, so that a ``checkpoints`` planted
        there as a link is refused rather than written through (files.py)."""
        return self.root.parent

    @property
    def latest_file(self) -> Path:
        return self.root / LATEST_FILE

    def tmp_dir(self, step: int) -> Path:
        return self.root / f".tmp-{step_name(step)}"

    def step_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    # --- reading ---------------------------------------------------------------------------------
    def read_latest(self) -> str | None:
        """The ``step_<N>`` that ``latest`` names, None without one. A symlink is refused: we write a
        plain file, and following a link planted by someone else would read anything on the machine."""
        path = self.latest_file
        if path.is_symlink():
            raise UserError(
                f"{path}: is a symbolic link, not the plain file elastic-pretrain writes; delete it "
                "(resume uses the newest committed step_<N> without it)"
            )
        try:  # a step name is short: a FIFO, a device or anything longer is refused (files.py)
            text = read_bounded(path, "latest").decode("utf-8", "replace").strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return text if _STEP_DIR.match(text) else None

    def committed(self) -> list[Committed]:
        """Committed checkpoints, oldest first (directories without a readable marker are skipped;
        a marker that parses but has another shape than ours is a UserError: someone made it)."""
        out: list[Committed] = []
        if not self.root.is_dir():
            return out
        for d in self.root.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and d.is_dir() and os.path.lexists(d / COMMIT_FILE):
                try:  # a link, a FIFO or /dev/zero as the marker: a one-line UserError (files.py), not a hang
                    marker = check_marker(json_loads(read_bounded(d / COMMIT_FILE, "COMMITTED"), d / COMMIT_FILE), d)
                except (OSError, ValueError) as err:
                    log.warning("%s: unreadable commit marker (%s), ignoring this checkpoint", d / COMMIT_FILE, err)
                    continue
                out.append(Committed(int(m.group(1)), d, marker))
        return sorted(out, key=lambda c: c.step)

    def newest(self) -> Committed | None:
        found = self.committed()
        return found[-1] if found else None

    # --- writing (rank 0 only) -------------------------------------------------------------------------
    def prepare(self, step: int) -> Path:
        """A fresh, empty ``.tmp-step_<N>/`` (a leftover of a crashed save is removed first)."""
        tmp = self.tmp_dir(step)
        remove_tree(tmp)  # a link at the name is unlinked, its target untouched
        for sub in (MODEL_DIR, RNG_DIR):
            ensure_dir(tmp / sub, root=self._parent)  # refuses a planted checkpoints -> elsewhere
        return tmp

    def commit(self, step: int, extra_records: dict[str, list[int]], rank: int = 0) -> Path:
        """Write the marker (after every rank finished), rename into place, then update ``latest``."""
        tmp = self.tmp_dir(step)
        own = [p for p in tmp.rglob("*") if p.is_file() and not _rank_written(p)]
        files = {**file_records(tmp, own), **extra_records}
        marker = {"version": FORMAT_VERSION, "step": step, "files": dict(sorted(files.items()))}
        write_atomic(tmp / COMMIT_FILE, json.dumps(marker, indent=1), root=self._parent)
        fault_point("after_marker", rank, step)
        final = self.step_dir(step)
        if final.exists():  # the same step saved again (e.g. a resumed run stopped at once): replace it
            self._remove(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        fault_point("after_rename", rank, step)
        write_atomic(self.latest_file, step_name(step) + "\n", root=self._parent)
        return final

    def retain(self, keep_last: int, keep_every: int) -> list[int]:
        """Delete committed checkpoints outside (last ``keep_last``) ∪ (multiples of ``keep_every``)."""
        found = self.committed()
        keep = {c.step for c in found[-keep_last:]}
        keep |= {c.step for c in found if keep_every and c.step % keep_every == 0}
        removed = []
        for c in found:
            if c.step not in keep:
                self._remove(c.path)
                removed.append(c.step)
        return removed

    def clean_stale(self) -> None:
        """Remove ``.tmp-*``/``.trash-*`` leftovers of a crashed save (call before the first save)."""
        if self.root.is_dir():
            for d in self.root.iterdir():
                if d.name.startswith((".tmp-", ".trash-")):
                    with contextlib.suppress(OSError):
                        remove_tree(d)

    def _remove(self, path: Path) -> None:
        # Rename first: a crash mid-delete must not leave a step_<N> with COMMITTED but missing files.
        trash = path.with_name(f".trash-{path.name}")
        remove_tree(trash)
        os.replace(path, trash)  # a step_<N> that is a link: the link is renamed, then unlinked
        with contextlib.suppress(OSError):
            remove_tree(trash)


def resume_source(cfg: CheckpointConfig, store: CheckpointStore) -> Path | None:
    """The checkpoint a run continues from, or None for a fresh start (reads the file system only).

    The newest *committed* ``step_<N>`` wins, not ``latest``: a crash between the rename and the
    ``latest`` update leaves a complete newer checkpoint that ``latest`` does not name yet. ``cfg``: the job's
    ``checkpoint`` section."""
    if cfg.resume_from:
        return Path(cfg.resume_from)
    newest = store.newest()
    if cfg.resume == "never":
        if newest is not None:
            raise UserError(
                f"checkpoint.resume=never but {newest.path} exists: use a new run directory, or resume=auto"
            )
        return None
    return newest.path if newest else None


def resolve_checkpoint(path: Path) -> Path:
    """A step directory, or a run directory / its ``checkpoints`` folder (→ the newest committed step)."""
    if CheckpointFiles(path).trainer.exists():
        return path
    for root in (RunFiles(path).checkpoints, path):
        if root.is_dir():
            newest = CheckpointStore(root).newest()
            if newest is not None:
                return newest.path
    raise UserError(f"{path}: no committed checkpoint here (give a step_<N> directory or a run directory)")


def is_deepspeed(step: Path) -> bool:
    """A step directory written by ``engine: deepspeed`` (DeepSpeed's model-states files)."""
    return any((step / MODEL_DIR).glob("*_model_states.pt"))


def _rank_written(path: Path) -> bool:
    """Files whose records the writing rank computed itself (``__<rank>_<i>.distcp``, ``rank_<R>.pt``)."""
    return path.suffix == ".distcp" or (path.parent.name == RNG_DIR and path.name.startswith("rank_"))


def rank_records(tmp: Path, rank: int) -> dict[str, list[int]]:
    """Size + CRC32 of the files this rank wrote (its tensor files and its RNG file)."""
    files = CheckpointFiles(tmp)
    mine = [
        *files.tensors.glob(f"__{rank}_*.distcp"),
        files.rng(rank),
        *files.tensors.glob(f"zero_pp_rank_{rank}_*.pt"),  # engine=deepspeed (engine/deepspeed.py)
        *(files.tensors.glob("mp_rank_*.pt") if rank == 0 else []),
    ]
    return file_records(tmp, [p for p in mine if p.is_file()], take_writer_records(files.tensors, rank))


def verify_share(files: dict[str, Any], rank: int, world: int) -> set[str]:
    """The files of a marker's ``files`` that ``rank`` of ``world`` checks (checkpoint/parallel_io.py):
    largest first, each to the rank with the fewest bytes so far (the same answer on every rank)."""
    load, mine = [0] * world, set()
    for rel, (size, _) in sorted(files.items(), key=lambda kv: (-kv[1][0], kv[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += size
        if r == rank:
            mine.add(rel)
    return mine


def verify(ckpt: Path, share: tuple[int, int] | None = None) -> dict[str, Any]:
    """Check every file listed in ``COMMITTED`` (size, CRC32); raise a one-line UserError naming the file.
    ``share=(rank, world)``: only that rank's share of the files (the marker is checked in full)."""
    marker_path = CheckpointFiles(ckpt).committed
    try:
        marker = json_loads(read_bounded(marker_path, "COMMITTED"), marker_path, fix=_NOT_OURS)
    except FileNotFoundError:
        raise UserError(f"{ckpt}: not a committed checkpoint (no {COMMIT_FILE}; it was never finished)") from None
    except UserError:
        raise
    except (OSError, ValueError) as err:
        raise UserError(f"{marker_path}: unreadable commit marker ({err})") from None
    check_marker(marker, ckpt)
    mine = verify_share(marker["files"], *share) if share else None
    for rel, (size, crc) in marker["files"].items():
        if mine is not None and rel not in mine:
            continue
        path = ckpt / rel
        if not path.is_file():
            raise UserError(f"{path}: missing from the checkpoint")
        if path.stat().st_size != size:
            raise UserError(f"{path}: truncated or corrupt ({path.stat().st_size} bytes, {size} were written)")
        if crc32_file(path) != crc:
            raise UserError(f"{path}: corrupt (checksum differs from the one written at save time)")
    return marker


# trainer.json (Checkpointer.save): the state of every named stateful object under its name, and the
# checkpointer's own keys (adam_step from the tensors, layout, config). The known keys and their types:
TRAINER_KEYS: dict[str, tuple[type, ...]] = {
    "trainer": (dict,),
    "adam_step": (int, float),
    "scheduler": (dict,),
    "controller": (dict,),
    "data": (dict,),
    "tracker": (dict,),
    "layout": (dict,),
    "config": (dict,),
}
# What a resume needs (an object named in the trainer's mapping but absent here starts fresh, e.g. "faults")
RESUME_KEYS = ("trainer", "adam_step", "scheduler", "controller", "data", "layout", "config")
# Checkpoints written before the stateful mapping: optional objects under "extras", the run id at the top
_LEGACY_KEYS: dict[str, tuple[type, ...]] = {"extras": (dict,), "mlflow_run_id": (str, type(None))}
_COUNTERS = {"step": (int,), "tokens": (int,), "elapsed_s": (int, float)}


def read_trainer_state(ckpt: Path, require: tuple[str, ...] = ("config",)) -> dict[str, Any]:
    """``trainer.json`` of ``ckpt``: an object whose known keys have the types the checkpointer writes
    and which holds every key of ``require`` (``RESUME_KEYS`` for a resume); else a one-line UserError.
    A checkpoint of the earlier format reads as the current one (``extras.<name>`` → ``<name>``,
    ``mlflow_run_id`` → ``tracker.run_id``)."""
    path = CheckpointFiles(ckpt).trainer
    try:
        meta = json_loads(read_bounded(path, "trainer.json"), path, fix=_NOT_OURS)
    except FileNotFoundError:
        raise UserError(f"{path}: missing; {ckpt} is not an elastic-pretrain checkpoint") from None
    except UserError:
        raise
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: unreadable ({err})") from None
    if not isinstance(meta, dict):
        raise UserError(f"{path}: malformed (a {type(meta).__name__}, not an object); {_NOT_OURS}")
    missing = [k for k in require if k not in meta]
    if missing:
        raise UserError(f"{path}: malformed (no {', '.join(missing)}); {_NOT_OURS}")
    known = {**TRAINER_KEYS, **_LEGACY_KEYS}
    shapes = [(k, meta[k], known[k]) for k in known if k in meta]
    if isinstance(meta.get("trainer"), dict):
        shapes += [(f"trainer.{k}", meta["trainer"].get(k), t) for k, t in _COUNTERS.items()]
    if isinstance(meta.get("tracker"), dict):
        shapes.append(("tracker.run_id", meta["tracker"].get("run_id"), (str, type(None))))
    if isinstance(meta.get("extras"), dict):
        shapes += [(f"extras.{k}", v, (dict,)) for k, v in meta["extras"].items()]
    for key, value, types in shapes:
        if isinstance(value, bool) or not isinstance(value, types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise UserError(f"{path}: malformed ({key} is {type(value).__name__}, not {want}); {_NOT_OURS}")
    try:
        _check_counters(meta)
    except StateError as err:
        raise UserError(f"{path}: malformed ({err}); {_NOT_OURS}") from None
    for name, state in meta.pop("extras", {}).items():
        meta.setdefault(name, state)
    if "mlflow_run_id" in meta:
        meta.setdefault("tracker", {"run_id": meta.pop("mlflow_run_id")})
    return meta


def _check_counters(meta: dict[str, Any]) -> None:
    """The loop counters and Adam's step in range (their types are checked above): a step of 1e308 or a
    negative token count would otherwise reach the optimizer, the LR schedule and every report."""
    if "adam_step" in meta:
        count(meta, "adam_step", "")  # a float in trainer.json: fills Adam's float32 step tensors
    trainer = meta.get("trainer")
    if isinstance(trainer, dict):
        for key in ("step", "tokens"):
            if key in trainer:
                count(trainer, key, "trainer")
        for key in ("elapsed_s", "train_flops"):
            if trainer.get(key) is not None:
                number(trainer, key, "trainer")


def saved_run_id(meta: dict[str, Any]) -> str | None:
    """The MLflow run id a checkpoint's ``trainer.json`` (:func:`read_trainer_state`) holds, or None."""
    run_id = meta.get("tracker", {}).get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None
