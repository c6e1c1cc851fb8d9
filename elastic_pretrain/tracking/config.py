"""Tracking configuration: where metrics go and how hard the tracker tries before giving up.

Nothing here imports MLflow: every rank builds the job config, only rank 0 talks to MLflow.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from elastic_pretrain.config import ConfigError, field
from elastic_pretrain.rundir import RunFiles

ENV_TRACKING_URI = "MLFLOW_TRACKING_URI"
REDACTED = "<redacted>"
# scheme://user:password@host: the credentials part of any URL in a string
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")


@dataclass(kw_only=True)
class TrackingConfig:
    """Experiment tracking (MLflow from rank 0; never fatal to training)."""

    backend: Literal["mlflow", "none"] = field(
        "mlflow", doc="'mlflow' logs params/metrics/artifacts from rank 0; 'none' turns tracking off."
    )
    uri: str | None = field(
        None,
        doc="MLflow tracking URI (http://host:port, sqlite:////abs/path.db). Unset: $MLFLOW_TRACKING_URI if set, "
        "else a local store sqlite:///<run_dir>/mlflow/mlflow.db with artifacts in <run_dir>/mlflow/artifacts.",
    )
    experiment: str | None = field(None, doc="MLflow experiment name; unset: the job name.")
    run_name: str | None = field(None, doc="MLflow run name; unset: the job name.")
    flush_interval_s: float = field(
        5.0, doc="Seconds between background sends of buffered metrics (a full batch is sent sooner)."
    )
    max_buffered: int = field(
        100_000,
        doc="Most metric values held while MLflow is unreachable; beyond it the oldest are dropped (and counted).",
    )
    system_metrics: bool = field(
        True, doc="Log CPU/memory/disk/network (and GPU if pynvml is present) as system/* metrics."
    )
    system_metrics_interval_s: float = field(30.0, doc="Seconds between system-metrics samples.")
    request_timeout_s: int = field(
        15, doc="Timeout of one HTTP request to the tracking server (MLFLOW_HTTP_REQUEST_TIMEOUT), whole seconds."
    )
    retry_max_interval_s: float = field(
        60.0, doc="Longest wait between retries while the server is unreachable (backoff doubles from 1 s)."
    )
    close_timeout_s: float = field(
        30.0, doc="At the end of training, the longest wait for buffered data to reach MLflow before giving up."
    )

    def __post_init__(self) -> None:
        if self.uri is not None and not self.uri.strip():
            raise ConfigError("uri: empty string; leave it unset for the default or give a URI like http://host:5000")
        if self.experiment is not None and not self.experiment.strip():
            raise ConfigError("experiment: empty name; leave it unset to use the job name")
        for name in ("flush_interval_s", "system_metrics_interval_s", "retry_max_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0 seconds, got {getattr(self, name)}")
        if self.close_timeout_s < 0:
            raise ConfigError(f"close_timeout_s: must be >= 0 seconds, got {self.close_timeout_s}")
        if self.request_timeout_s < 1:
            raise ConfigError(f"request_timeout_s: must be >= 1 second, got {self.request_timeout_s}")
        if self.max_buffered < 1:
            raise ConfigError(f"max_buffered: must be >= 1, got {self.max_buffered} (e.g. 100000)")


def local_store_dir(run_dir: Path) -> Path:
    """Folder that holds the tracker's files for a run: local store, artifacts, plots, run.json."""
    return RunFiles(Path(run_dir).absolute()).mlflow


def local_store_uri(run_dir: Path) -> str:
    """``sqlite:///`` + absolute path (four slashes in total): the offline default store."""
    return "sqlite:///" + str(local_store_dir(run_dir) / "mlflow.db")


def resolve_uri(cfg: TrackingConfig, run_dir: Path) -> str:
    """The URI to use: the config's, else ``$MLFLOW_TRACKING_URI``, else the local sqlite store."""
    if cfg.uri:
        return cfg.uri
    env = os.environ.get(ENV_TRACKING_URI, "").strip()
    return env or local_store_uri(run_dir)


def is_local_sqlite(uri: str) -> bool:
    return uri.startswith("sqlite:")


def redact_uri(text: str) -> str:
    """``text`` with the ``user:password@`` of every URL in it removed: for logs, files, MLflow params.
    (Only the live tracking client gets the URI as configured.)"""
    return _USERINFO.sub(r"\g<scheme>", text)
