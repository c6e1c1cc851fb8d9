"""TrackingConfig validation, URI resolution, metric names, the no-op tracker, cheap imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elastic_pretrain.config import ConfigError, build
from elastic_pretrain.tracking.config import TrackingConfig, local_store_uri, resolve_uri
from elastic_pretrain.tracking.names import loops_of_val_loss, routing, sanitize, val_loss_loops
from elastic_pretrain.tracking.tracker import Tracker, create_tracker


def test_defaults_build_from_empty_mapping() -> None:
    cfg = build(TrackingConfig, {})
    assert cfg.backend == "mlflow" and cfg.uri is None and cfg.max_buffered >= 1000


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"backend": "wandb"}, "backend: 'wandb' is not one of 'mlflow', 'none'"),
        ({"flush_interval_s": 0}, "flush_interval_s: must be > 0"),
        ({"max_buffered": 0}, "max_buffered: must be >= 1"),
        ({"uri": "  "}, "uri: empty string"),
        ({"request_timeout_s": 0}, "request_timeout_s: must be >= 1"),
        ({"flush_every": 3}, "unknown key 'flush_every'"),
    ],
)
def test_bad_values_name_the_key_and_fix(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        build(TrackingConfig, data)


def test_uri_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    local = resolve_uri(TrackingConfig(), tmp_path)
    assert local == local_store_uri(tmp_path) == f"sqlite:///{tmp_path.absolute()}/mlflow/mlflow.db"
    assert local.startswith("sqlite:////")  # four slashes: an absolute path
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert resolve_uri(TrackingConfig(), tmp_path) == "http://tracking:5000"
    assert resolve_uri(TrackingConfig(uri="http://other:1"), tmp_path) == "http://other:1"


def test_metric_names() -> None:
    assert routing(3, 1, "max_load") == "routing/3/1/max_load"
    assert loops_of_val_loss(val_loss_loops(12)) == 12
    assert loops_of_val_loss("val_ppl_loops_2") is None
    assert sanitize("a b@c") == "a_b_c"
    assert sanitize("/x//../y") == "x/__/y"
    assert sanitize("ok/name-1.5") == "ok/name-1.5"


@pytest.mark.parametrize(("backend", "rank"), [("none", 0), ("mlflow", 1)])
def test_other_ranks_and_backend_none_get_a_noop_tracker(tmp_path: Path, backend: str, rank: int) -> None:
    cfg = TrackingConfig(backend=backend)  # type: ignore[arg-type]
    tracker = create_tracker(cfg, run_dir=tmp_path, job_name="j", rank=rank, resume_run_id=None)
    assert type(tracker) is Tracker and tracker.run_id is None
    tracker.log_params({"a": {"b": 1}})
    tracker.set_tags({"t": "v"})
    tracker.log_metrics({"loss": 1.0}, step=0)
    tracker.log_artifact(tmp_path / "missing.txt")
    tracker.log_quality_budget({1: 2.0}, step=0)
    assert tracker.flush(0.0)
    tracker.close(0.0)
    assert list(tmp_path.iterdir()) == []  # nothing written by a no-op tracker


def test_importing_tracking_does_not_import_mlflow_or_matplotlib() -> None:
    code = (
        "import sys, elastic_pretrain.tracking.tracker, elastic_pretrain.tracking.commands\n"
        "heavy = [m for m in ('mlflow', 'matplotlib', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
