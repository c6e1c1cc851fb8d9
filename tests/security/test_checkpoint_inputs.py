"""Hostile checkpoints (issue 13, cases 1, 5, 6): each test builds the exact input an attacker would
share — a crafted ``.metadata`` pickle, a poisoned byte item, a planted symlink, marker keys that
leave the checkpoint, malformed ``COMMITTED``/``trainer.json`` — and checks that no command runs, no
file outside the run is read or written, and the user gets one line naming the fix (exit code 2).

The attacker controls the whole checkpoint, so every tampered file is re-recorded in ``COMMITTED``
(size + CRC32 match): the checksums are integrity checks, not a defence, and these tests show it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from elastic_pretrain.checkpoint.store import CheckpointStore, file_records, read_trainer_state, verify
from elastic_pretrain.errors import UserError
from tests.conftest import REPO, VENV_BIN

CLI = str(VENV_BIN / "elastic-pretrain")
QUICK = ["parallel=single", "train.steps=3", "train.warmup_steps=1", "train.eval_sequences=4",
         "train.eval_interval=0", "checkpoint.interval=0", "tracking.backend=none"]  # fmt: skip


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The command failed with exit code 2 and one ``error:`` line (no traceback) holding ``needles``."""
    out = proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode == 2, out
    assert "Traceback" not in proc.stderr, out
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, out
    for needle in needles:
        assert needle in lines[0], out
    return lines[0]


def recommit(ckpt: Path) -> None:
    """Re-record every file's size and CRC32 in COMMITTED, as the author of a tampered checkpoint would."""
    marker = json.loads((ckpt / "COMMITTED").read_text())
    marker["files"] = file_records(ckpt, [p for p in ckpt.rglob("*") if p.is_file() and p.name != "COMMITTED"])
    (ckpt / "COMMITTED").write_text(json.dumps(marker))


def dotted_global_pickle(command: str) -> bytes:
    """Protocol 4: STACK_GLOBAL ("torch.distributed.checkpoint.metadata", "os.system"), called on ``command``.

    The module is on every metadata allow-list; the *name* walks to ``os`` through the module's own
    ``import os``. Hand-assembled opcodes: what the issue's reproduction wrote into ``.metadata``."""

    def short(s: str) -> bytes:
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b

    return (b"\x80\x04" + short("torch.distributed.checkpoint.metadata") + short("os.system") + b"\x93"
            + short(command) + b"\x85" + b"R" + b".")  # fmt: skip


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.command,)


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real committed checkpoint: the tiny job, two steps, one process."""
    proc = run_cli("prepare-data", "stdlib-code")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path_factory.mktemp("base") / "tiny"
    proc = run_cli("train", "jobs/tiny-cpu.yaml", "--run-dir", str(run), *QUICK[:1], "train.steps=2", *QUICK[2:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run / "checkpoints" / "step_2"


def hostile_copy(base: Path, tmp_path: Path, marker: Path) -> Path:
    """``<tmp>/run/checkpoints/step_2``: ``base`` whose ``.metadata`` runs ``touch <marker>`` when unpickled."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(base, ckpt)
    (ckpt / "model_optim" / ".metadata").write_bytes(dotted_global_pickle(f"touch {marker}"))
    recommit(ckpt)
    (ckpt.parent / "latest").write_text("step_2\n")
    return ckpt


# ------------------------------------------------------- case 1: the metadata unpickler bypass
def test_dotted_global_in_metadata_is_refused_before_anything_runs(base: Path, tmp_path: Path) -> None:
    """DCP's own metadata read (``filesystem.pickle.load``) inside ``restricted_unpickling``."""
    from torch.distributed.checkpoint import filesystem

    from elastic_pretrain.checkpoint.safe_load import restricted_unpickling

    marker = tmp_path / "PWNED"
    with restricted_unpickling():
        try:
            filesystem.pickle.load(io.BytesIO(dotted_global_pickle(f"touch {marker}")))
            error = None
        except pickle.UnpicklingError as err:
            error = str(err)
        assert not marker.exists(), "the metadata ran a shell command"
        assert error is not None and "os.system, which is not allowed" in error
        # the real file still loads: every global it names is on the exact list
        with open(base / "model_optim" / ".metadata", "rb") as f:
            assert filesystem.pickle.load(f).state_dict_metadata


ENTRY_POINTS = {
    "eval": lambda ckpt, tmp: ["eval", str(ckpt), "--data", "stdlib-code", "--sequences", "2",
                               "--out", str(tmp / "eval")],
    "generate": lambda ckpt, tmp: ["generate", str(ckpt), "--prompt", "x", "--loops", "2", "--max-new-tokens", "1"],
    "resume-from": lambda ckpt, tmp: ["train", "jobs/tiny-cpu.yaml", "--run-dir", str(tmp / "other"),
                                      "--resume-from", str(ckpt), *QUICK],
    "auto-resume": lambda ckpt, tmp: ["train", "jobs/tiny-cpu.yaml", "--run-dir", str(ckpt.parent.parent), *QUICK],
    "decider.init_from": lambda ckpt, tmp: ["train", "jobs/tiny-decider.yaml", "--run-dir", str(tmp / "decider"),
                                            f"decider.init_from={ckpt}", *QUICK],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_crafted_metadata_runs_no_command(base: Path, tmp_path: Path, entry: str) -> None:
    """Every command that loads a checkpoint someone gave us: the crafted .metadata runs nothing."""
    marker = tmp_path / "PWNED"
    ckpt = hostile_copy(base, tmp_path, marker)
    proc = run_cli(*ENTRY_POINTS[entry](ckpt, tmp_path))
    assert not marker.exists(), "the checkpoint ran a shell command"
    one_line_error(proc, "model_optim", "os.system", "not allowed")


@pytest.mark.slow
def test_poisoned_byte_item_is_one_line_not_a_traceback(base: Path, tmp_path: Path) -> None:
    """A byte item (megatron's ``_extra_state``) replaced by a torch.save pickle that calls os.system.

    It loads with ``weights_only=True`` and is refused inside DCP, which wraps the refusal in a
    ``CheckpointException`` — a BaseException: before, it escaped ``except Exception`` as a traceback."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    marker = tmp_path / "PWNED"
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(base, ckpt)
    meta_path, data_path = ckpt / "model_optim" / ".metadata", ckpt / "model_optim" / "__0_0.distcp"
    meta = FileSystemReader(str(base / "model_optim")).read_metadata()  # our own base checkpoint
    payload = io.BytesIO()
    torch.save({"evil": _RunsCommand(f"touch {marker}")}, payload)
    offset = data_path.stat().st_size
    with open(data_path, "ab") as f:
        f.write(payload.getvalue())
    for index, info in meta.storage_data.items():  # every byte item now points at the payload
        if isinstance(meta.state_dict_metadata[index.fqn], BytesStorageMetadata):
            meta.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    meta_path.write_bytes(pickle.dumps(meta))
    recommit(ckpt)
    proc = run_cli("eval", str(ckpt), "--data", "stdlib-code", "--sequences", "2", "--out", str(tmp_path / "eval"))
    assert not marker.exists()
    one_line_error(proc, "cannot load model tensors", "use another checkpoint")


@pytest.mark.slow
def test_metadata_naming_a_data_file_outside_the_checkpoint_is_refused(base: Path, tmp_path: Path) -> None:
    """``_StorageInfo.relative_path = "../../../../outside.distcp"``: DCP would read tensors from any file
    the user can read (e.g. into a frozen backbone that a decider job then saves and shares)."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(base, ckpt)
    outside = tmp_path / "outside.distcp"
    (ckpt / "model_optim" / "__0_0.distcp").rename(outside)
    meta_path = ckpt / "model_optim" / ".metadata"
    meta = FileSystemReader(str(base / "model_optim")).read_metadata()  # our own base checkpoint
    rel = os.path.relpath(outside, ckpt / "model_optim")
    assert rel == "../../../../outside.distcp"
    meta.storage_data = {k: dataclasses.replace(v, relative_path=rel) for k, v in meta.storage_data.items()}
    meta_path.write_bytes(pickle.dumps(meta))
    recommit(ckpt)
    proc = run_cli("eval", str(ckpt), "--data", "stdlib-code", "--sequences", "2", "--out", str(tmp_path / "eval"))
    one_line_error(proc, ".metadata", repr(rel), "not a file inside the checkpoint")


# ------------------------------------------------------------- case 5: planted symlinks
def _save(store: CheckpointStore, step: int) -> Path:
    tmp = store.prepare(step)
    (tmp / "model_optim" / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp / "trainer.json").write_text(json.dumps({"trainer": {"step": step, "tokens": 64 * step, "elapsed_s": 1.0}}))
    return store.commit(step, {"model_optim/__0_0.distcp": [100, zlib.crc32(b"x" * 100)]})


def test_symlink_planted_at_the_temp_path_is_never_written_through(tmp_path: Path) -> None:
    """A run directory shared with us holds ``checkpoints/.latest.tmp -> ~/victim``: saving must not
    truncate the victim, and ``latest`` must stay a plain file."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    store.root.mkdir(parents=True)
    (store.root / ".latest.tmp").symlink_to(victim)
    _save(store, 5)
    assert victim.read_text() == "precious\n"
    assert not store.latest_file.is_symlink() and store.latest_file.read_text() == "step_5\n"
    assert store.read_latest() == "step_5"


def test_latest_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("step_5\n")
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    _save(store, 5)
    store.latest_file.unlink()
    store.latest_file.symlink_to(outside)
    proc = run_cli("checkpoints", str(tmp_path / "run"))
    one_line_error(proc, "latest", "symbolic link", "delete it")
    _save(store, 6)  # the next save replaces the link itself, never its target
    assert outside.read_text() == "step_5\n" and store.read_latest() == "step_6"


# ------------------------------------------------------- case 6: COMMITTED and trainer.json
@pytest.mark.parametrize("key", ["/etc/passwd", "../../x"])
def test_marker_keys_outside_the_checkpoint_are_refused(tmp_path: Path, key: str) -> None:
    """``checkpoints --verify`` must not read a file the marker names outside the checkpoint — even with
    its true size and CRC32 recorded (what ``/etc/passwd`` of the victim's machine would need)."""
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    ckpt = _save(store, 5)
    target = Path(key) if key.startswith("/") else (ckpt / key)
    if not key.startswith("/"):
        target.write_text("a file outside the checkpoint\n")
    marker = json.loads((ckpt / "COMMITTED").read_text())
    marker["files"][key] = [target.stat().st_size, zlib.crc32(target.read_bytes())]
    (ckpt / "COMMITTED").write_text(json.dumps(marker))
    proc = run_cli("checkpoints", str(tmp_path / "run"), "--verify")
    one_line_error(proc, "COMMITTED", repr(key), "not a path inside the checkpoint")
    with pytest.raises(UserError, match="not a path inside the checkpoint"):
        verify(ckpt)


def test_marker_key_through_a_symlink_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    ckpt = _save(store, 5)
    secret = tmp_path / "secret"
    secret.write_text("outside\n")
    (ckpt / "model_optim" / "link").symlink_to(secret)
    recommit(ckpt)
    with pytest.raises(UserError, match="leads outside the checkpoint"):
        verify(ckpt)


BAD_MARKERS = {
    "a list": [],
    "files a list": {"version": 1, "step": 5, "files": []},
    "record a string": {"version": 1, "step": 5, "files": {"trainer.json": "big"}},
    "record of three": {"version": 1, "step": 5, "files": {"trainer.json": [1, 2, 3]}},
    "step a string": {"version": 1, "step": "5", "files": {}},
}


@pytest.mark.parametrize("shape", list(BAD_MARKERS))
def test_malformed_marker_is_one_line(tmp_path: Path, shape: str) -> None:
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    ckpt = _save(store, 5)
    (ckpt / "COMMITTED").write_text(json.dumps(BAD_MARKERS[shape]))
    one_line_error(run_cli("checkpoints", str(tmp_path / "run"), "--verify"), "COMMITTED", "malformed")


BAD_TRAINER = {
    "a list": [],
    "trainer a list": {"trainer": [2, 4096]},
    "tokens a string": {"trainer": {"step": 2, "tokens": "many", "elapsed_s": 1.0}},
    "config a string": {"trainer": {"step": 2, "tokens": 1, "elapsed_s": 1.0}, "config": "x"},
    "no trainer": {"config": {}},
}


@pytest.mark.parametrize("shape", list(BAD_TRAINER))
def test_malformed_trainer_json_is_one_line(tmp_path: Path, shape: str) -> None:
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    ckpt = _save(store, 5)
    (ckpt / "trainer.json").write_text(json.dumps(BAD_TRAINER[shape]))
    recommit(ckpt)
    one_line_error(run_cli("checkpoints", str(tmp_path / "run")), "trainer.json", "malformed")
    with pytest.raises(UserError, match=r"trainer\.json: malformed"):
        read_trainer_state(ckpt, require=("trainer", "config"))
