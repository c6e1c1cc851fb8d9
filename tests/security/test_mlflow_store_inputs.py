"""A run directory's own MLflow store from someone else (issue 35, items 1, 7, 8, 9; issue 33, item 1).

Every store here is a real one, made by MLflow, then changed the way its author could: artifact locations
pointing at a loopback HTTP server that records requests (with the user's ``MLFLOW_TRACKING_TOKEN`` set), at
another folder, a symlinked ``mlflow.db``, random bytes, a recursive view. ``train`` and ``eval`` open the store
through ``create_tracker`` (``eval`` after ``eval_tracking``), ``runs`` through ``resolve_target``: both are
exercised in-process.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from elastic_pretrain import cli
from elastic_pretrain.errors import UserError
from elastic_pretrain.tracking.config import TrackingConfig, local_store_dir
from elastic_pretrain.tracking.tracker import create_tracker

TOKEN = "user-token-0123456789"
JOB = Path(__file__).resolve().parents[2] / "jobs" / "tiny-cpu.yaml"
EXPERIMENT = "tiny"


# --- a real store, and a server that records what reaches it ------------------------------------------------------
@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """An MLflow-made store (migrations cost seconds: made once, copied per test) with experiment ``tiny`` and
    one run, both at MLflow's absolute ``file://`` locations under an ``original`` run directory."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient

    original = tmp_path_factory.mktemp("original")
    local_store_dir(original).mkdir()
    db = _db(original)
    client = MlflowClient(f"sqlite:///{db}")
    exp = client.create_experiment(EXPERIMENT, artifact_location=(local_store_dir(original) / "artifacts").as_uri())
    run = client.create_run(exp, run_name=EXPERIMENT)
    client.log_metric(run.info.run_id, "loss", 1.5, step=3)
    client.set_terminated(run.info.run_id)
    return db, run.info.run_id


def _db(run_dir: Path) -> Path:
    return local_store_dir(run_dir) / "mlflow.db"


def _run_dir(tmp_path: Path, template: tuple[Path, str]) -> tuple[Path, str]:
    run = tmp_path / "shared-run"
    local_store_dir(run).mkdir(parents=True)
    shutil.copyfile(template[0], _db(run))
    return run, template[1]


def _set(db: Path, sql: str, *params: Any) -> None:
    with sqlite3.connect(db) as con:
        con.execute(sql, params)


class _Recorder(BaseHTTPRequestHandler):
    requests: list[tuple[str, str, str | None]]

    def _answer(self) -> None:
        self.requests.append((self.command, self.path, self.headers.get("Authorization")))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[tuple[str, str, str | None]]]]:
    requests: list[tuple[str, str, str | None]] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Recorder,), {"requests": requests}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def user_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)  # what a foreign location would collect
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run directory's own store is used


def _cfg() -> TrackingConfig:
    return TrackingConfig(system_metrics=False, flush_interval_s=0.1, close_timeout_s=30, request_timeout_s=2)


def _log_into(run: Path, resume: str | None = None) -> Any:
    """What ``train`` and ``eval`` do with the store: open it, log a metric and an artifact, flush, close."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("name: tiny\n")
    tracker = create_tracker(_cfg(), run_dir=run, job_name=EXPERIMENT, rank=0, resume_run_id=resume)
    tracker.log_metrics({"loss": 1.0}, step=4)
    tracker.log_artifact(run / "config.yaml", "config")
    tracker.flush(30)
    tracker.close(10)
    return tracker


def _one_line(err: BaseException | str) -> str:
    text = str(err)
    assert "\n" not in text.strip() and "Traceback" not in text, text
    return text


def _runs(run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["runs", str(run), "--experiment", EXPERIMENT])
    err = capsys.readouterr().err.strip()
    return code, _one_line(err)


# --- item 1: locations outside the run ------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["experiment", "run"])
def test_a_store_that_sends_artifacts_to_a_server_is_refused_before_any_request(
    tmp_path: Path, template: tuple[Path, str], recorder: Any, where: str
) -> None:
    """The author set the experiment's artifact_location (or the run's artifact_uri) to their server: MLflow
    would upload there with ``Authorization: Bearer <the user's token>``."""
    evil, requests = recorder
    run, run_id = _run_dir(tmp_path, template)
    db = _db(run)
    if where == "experiment":
        _set(db, "UPDATE experiments SET artifact_location = ? WHERE name = ?", evil, EXPERIMENT)
    else:
        _set(db, "UPDATE runs SET artifact_uri = ? WHERE run_uuid = ?", f"{evil}/{run_id}/artifacts", run_id)
    with pytest.raises(UserError) as err:
        _log_into(run, resume=run_id if where == "run" else None)
    assert requests == [], f"the store sent {len(requests)} request(s) to {evil}: {requests[:2]}"
    text = _one_line(err.value)
    assert f"keeps its artifacts at {evil}" in text and "outside this run directory" in text, text
    assert f"move {local_store_dir(run)} aside" in text and "--uri" in text


@pytest.mark.parametrize("where", ["experiment", "run"])
def test_a_store_that_writes_artifacts_elsewhere_is_refused(
    tmp_path: Path, template: tuple[Path, str], where: str
) -> None:
    """``file://`` locations outside the run: MLflow's local artifact repository writes wherever they say."""
    elsewhere = tmp_path / "elsewhere"  # file:///tmp/elsewhere, in this test's own folder
    run, run_id = _run_dir(tmp_path, template)
    db = _db(run)
    if where == "experiment":
        _set(db, "UPDATE experiments SET artifact_location = ? WHERE name = ?", elsewhere.as_uri(), EXPERIMENT)
    else:
        _set(db, "UPDATE runs SET artifact_uri = ? WHERE run_uuid = ?", elsewhere.as_uri(), run_id)
    with pytest.raises(UserError) as err:
        _log_into(run, resume=run_id if where == "run" else None)
    assert not elsewhere.exists(), sorted(p.name for p in elsewhere.rglob("*"))
    assert f"keeps its artifacts at {elsewhere.as_uri()}" in _one_line(err.value)


def test_eval_refuses_the_store_before_evaluating(tmp_path: Path, template: tuple[Path, str], recorder: Any) -> None:
    """``eval`` checks the run directory's store before it computes anything (eval_tracking), and logs nothing."""
    from elastic_pretrain.eval.commands import eval_tracking
    from elastic_pretrain.job_loader import load_job

    evil, requests = recorder
    run, _ = _run_dir(tmp_path, template)
    (run / "config.yaml").write_text("name: tiny\n")
    ckpt = run / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    _set(_db(run), "UPDATE experiments SET artifact_location = ? WHERE name = ?", evil, EXPERIMENT)
    job = load_job(JOB, [f"tracking.experiment={EXPERIMENT}"])
    with pytest.raises(UserError) as err:
        eval_tracking(job, ckpt, uri=None)
    assert requests == [] and f"experiment '{EXPERIMENT}' keeps its artifacts at {evil}" in _one_line(err.value)


@pytest.mark.parametrize(
    "location",
    ["s3://bucket/mlflow/artifacts", "mlflow-artifacts:/1", "file://host/x/mlflow/artifacts", "/srv/shared/mlruns/1",
     "artifacts/../../..", "mlflow/artifacts", "https://h/mlflow/artifacts", ""],
)  # fmt: skip
def test_only_locations_inside_the_run_are_accepted(tmp_path: Path, location: str) -> None:
    from elastic_pretrain.tracking import store

    with pytest.raises(UserError, match="outside this run directory"):
        store.relative_location(location, tmp_path, "experiment 'x'")


@pytest.mark.parametrize(
    ("location", "relative"),
    [("artifacts", "artifacts"), ("artifacts/0123/artifacts", "artifacts/0123/artifacts"),
     ("file:///old/runs/a/mlflow/artifacts", "artifacts"),  # MLflow's absolute form, from a copied directory
     ("/old/runs/a/mlflow/artifacts/0123/artifacts", "artifacts/0123/artifacts")],
)  # fmt: skip
def test_mlflow_absolute_locations_map_into_this_run(tmp_path: Path, location: str, relative: str) -> None:
    from elastic_pretrain.tracking import store

    assert store.relative_location(location, tmp_path, "experiment 'x'") == relative


def test_a_copied_run_logs_into_the_copy_and_stores_relative_locations(
    tmp_path: Path, template: tuple[Path, str]
) -> None:
    """Issue 33: the store of ``cp -r original copy`` names the original's artifact folder; resuming the copy
    overwrote the original's artifacts. Now the copy's locations become relative, artifacts land in the copy."""
    copy, run_id = _run_dir(tmp_path, template)
    original_artifacts = template[0].parent / "artifacts"
    tracker = _log_into(copy, resume=run_id)
    assert tracker.run_id == run_id  # the same MLflow run continues
    assert (local_store_dir(copy) / "artifacts" / run_id / "artifacts" / "config" / "config.yaml").is_file()
    assert not original_artifacts.exists()
    with sqlite3.connect(_db(copy)) as con:
        locations = [r[0] for r in con.execute("SELECT artifact_location FROM experiments")]
        locations += [r[0] for r in con.execute("SELECT artifact_uri FROM runs")]
    assert locations == ["artifacts/0", "artifacts", f"artifacts/{run_id}/artifacts"], locations


def test_a_new_store_is_relocatable(tmp_path: Path) -> None:
    """The tool's own new store holds no absolute path (MLflow records file:///<abs> by default)."""
    run = tmp_path / "run"
    tracker = _log_into(run)
    with sqlite3.connect(_db(run)) as con:
        rows = con.execute("SELECT artifact_location FROM experiments UNION ALL SELECT artifact_uri FROM runs")
        locations = [r[0] for r in rows]
    assert locations == ["artifacts/0", "artifacts", f"artifacts/{tracker.run_id}/artifacts"], locations


def test_a_link_below_the_artifact_root_is_not_followed(tmp_path: Path, template: tuple[Path, str]) -> None:
    from elastic_pretrain.tracking import store

    run, run_id = _run_dir(tmp_path, template)
    outside = tmp_path / "outside"
    outside.mkdir()
    (local_store_dir(run) / "artifacts").symlink_to(outside)
    with pytest.raises(UserError, match="is a symbolic link, not a directory; elastic-pretrain writes only into real"):
        store.artifact_dir(run, f"artifacts/{run_id}/artifacts")
    assert list(outside.iterdir()) == []


# --- item 1: mlflow.db itself --------------------------------------------------------------------------------------
def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_symlinked_store_is_refused_and_the_file_it_names_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``mlflow.db -> ~/other.db``: MLflow created its 60 tables inside the linked SQLite file."""
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as con:
        con.execute("CREATE TABLE notes (body TEXT)")
        con.execute("INSERT INTO notes VALUES ('mine')")
    before = _sha(other)
    run = tmp_path / "shared-run"
    local_store_dir(run).mkdir(parents=True)
    _db(run).symlink_to(other)
    with pytest.raises(UserError) as err:
        _log_into(run)
    assert "mlflow.db: is a symbolic link, not a file of the run's own MLflow store" in _one_line(err.value)
    code, text = _runs(run, capsys)
    assert code == 2 and "is a symbolic link" in text
    assert _sha(other) == before


@pytest.mark.timeout(60)
def test_a_fifo_store_is_refused_without_blocking(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "shared-run"
    local_store_dir(run).mkdir(parents=True)
    os.mkfifo(_db(run))
    code, text = _runs(run, capsys)
    assert code == 2 and "mlflow.db: is a FIFO" in text, text
    with pytest.raises(UserError, match="is a FIFO"):
        _log_into(run)


def test_a_linked_store_folder_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "shared-run"
    run.mkdir()
    local_store_dir(run).symlink_to(elsewhere)
    with pytest.raises(UserError, match="mlflow: is a symbolic link"):
        _log_into(run)
    assert list(elsewhere.iterdir()) == []


def test_a_hard_linked_store_is_not_written(tmp_path: Path, template: tuple[Path, str]) -> None:
    """``cp -al runs/a runs/b`` shares mlflow.db between both: logging into b would change a."""
    run, _ = _run_dir(tmp_path, template)
    twin = tmp_path / "twin.db"
    os.link(_db(run), twin)
    before = _sha(twin)
    with pytest.raises(UserError, match="has 2 hard links"):
        _log_into(run)
    assert _sha(twin) == before


# --- items 7 and 8: a store that hangs or is garbage ------------------------------------------------------------------
def test_a_garbage_store_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "shared-run"
    local_store_dir(run).mkdir(parents=True)
    _db(run).write_bytes(random.Random(35).randbytes(8192))
    code, text = _runs(run, capsys)
    assert code == 2 and "mlflow.db: not an SQLite database" in text, text
    with pytest.raises(UserError, match="not an SQLite database"):
        _log_into(run)


def _recursive_view(db: Path) -> None:
    """``latest_metrics`` (read by ``runs`` for every run) replaced by a view that never ends."""
    with sqlite3.connect(db) as con:
        columns = [r[1] for r in con.execute("PRAGMA table_info(latest_metrics)")]
        values = {"key": "'loss'", "value": "0.0", "timestamp": "0", "step": "n", "is_nan": "0",
                  "run_uuid": "(SELECT run_uuid FROM runs LIMIT 1)"}  # fmt: skip
        select = ", ".join(f"{values.get(c, '0')} AS {c}" for c in columns)
        con.execute("DROP TABLE latest_metrics")
        con.execute(
            f"CREATE VIEW latest_metrics AS WITH RECURSIVE r(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM r) "
            f"SELECT {select} FROM r"
        )


@pytest.mark.timeout(120)
def test_a_recursive_view_is_refused_before_any_query(
    tmp_path: Path, template: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = _run_dir(tmp_path, template)
    _recursive_view(_db(run))
    code, text = _runs(run, capsys)
    assert code == 2 and "holds view 'latest_metrics', which MLflow never creates" in text, text


@pytest.mark.timeout(120)
def test_queries_on_the_store_are_time_boxed(
    tmp_path: Path, template: tuple[Path, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the schema check does not know about: every statement MLflow runs on the run's store ends."""
    from elastic_pretrain.tracking import store

    run, _ = _run_dir(tmp_path, template)
    _recursive_view(_db(run))
    monkeypatch.setattr(store, "check_store", lambda run_dir, writing: _db(run_dir))  # as if unseen
    monkeypatch.setattr(store, "QUERY_TIME_LIMIT_S", 1.0)
    code, text = _runs(run, capsys)
    assert code == 2 and "a query on this MLflow store ran past 1 s" in text, text


def test_a_good_store_is_listed(tmp_path: Path, template: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    run, run_id = _run_dir(tmp_path, template)
    assert cli.main(["runs", str(run), "--experiment", EXPERIMENT]) == 0
    out = capsys.readouterr().out
    assert run_id in out and "FINISHED" in out and "1.5000" in out


# --- item 9: mlflow_run_id and a bare step folder ---------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["link", "fifo", "junk", "huge"])
def test_status_does_not_print_what_mlflow_run_id_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("PRIVATE KEY 0123456789abcdef0123456789abcdef\n")
    run = tmp_path / "shared-run"
    run.mkdir()
    id_file = run / "mlflow_run_id"
    if kind == "link":
        id_file.symlink_to(secret)
    elif kind == "fifo":
        os.mkfifo(id_file)
    elif kind == "junk":
        id_file.write_text("\x1b[2J--user=root; rm -rf ~\n")
    else:
        id_file.write_bytes(b"0" * 32 + b" " * (1 << 20))
    code = cli.main(["status", str(run)])
    captured = capsys.readouterr()
    assert code == 2 and "PRIVATE" not in captured.out + captured.err
    text = _one_line(captured.err.strip())
    assert {"link": "is a symbolic link", "fifo": "is a FIFO", "junk": "not an MLflow run id (32 hex digits)",
            "huge": "more than 256 bytes"}[kind] in text, text  # fmt: skip


def test_status_shows_a_run_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "mlflow_run_id").write_text("0123456789abcdef0123456789abcdef")
    assert cli.main(["status", str(run)]) == 0
    assert "mlflow run: 0123456789abcdef0123456789abcdef" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["bare", "checkpoints-without-run"])
def test_eval_of_a_bare_step_folder_creates_no_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    """``eval ~/Downloads/checkpoints/step_2`` created ``~/Downloads/mlflow/mlflow.db``: a step folder outside
    a run directory (no config.yaml beside its checkpoints/) is not logged unless a URI is given."""
    from elastic_pretrain.eval.commands import track_eval
    from elastic_pretrain.eval.curves import CurvePoint, QualityCurve
    from elastic_pretrain.job_loader import load_job

    downloads = tmp_path / "downloads"
    ckpt = downloads / "step_2" if layout == "bare" else downloads / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text('{"config": {}, "tracker": {"run_id": null}}')
    job = load_job(JOB, ["tracking.system_metrics=false"])
    curve = QualityCurve(name="tiny", points=(CurvePoint(loops=1, relative_compute=1.0, loss=2.0),))
    assert track_eval(job, ckpt, curve, [], []) is None
    made = {p.relative_to(downloads).as_posix() for p in downloads.rglob("*")}
    expected = {"step_2", "step_2/trainer.json"}
    assert made == (expected if layout == "bare" else {"checkpoints", *(f"checkpoints/{p}" for p in expected)}), made
    assert "is not in a run directory" in _one_line(capsys.readouterr().err.strip())
