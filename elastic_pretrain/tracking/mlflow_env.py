"""The few places that touch MLflow's process-wide state: env knobs, loggers, error classification.

``import mlflow`` costs ~3 s on our CPUs, so callers import this module freely and only the
functions below import MLflow, on first use (in the tracker's background thread, or in a command).
"""

from __future__ import annotations

import logging
import os
from typing import Any

# Defaults we set before MLflow reads them (a user's own environment wins, except the timeout,
# which the config owns). MLflow's client would otherwise retry a dead server 7 times with
# exponential backoff (minutes per request); the tracker retries on its own schedule instead, so
# one failed request must fail fast and the one warning line can be printed promptly.
_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",  # cluster nodes often have no internet; never phone home
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # we log one line with the run URL ourselves
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # MLflow's own INFO chatter (db migrations, monitor start/stop)
}
_NOISY_LOGGERS = ("mlflow", "alembic", "urllib3.connectionpool")


def prepare_environment(request_timeout_s: int | None = None) -> None:
    """Set MLflow env knobs; call before the first ``import mlflow`` in the process."""
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if request_timeout_s is not None:
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(request_timeout_s))


def quiet_loggers() -> None:
    """MLflow configures its logger at import; re-quiet it (and alembic's migration INFO lines)."""
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR if name.startswith("urllib3") else logging.WARNING)


def make_client(uri: str, request_timeout_s: int | None = None) -> Any:
    """An ``MlflowClient`` for ``uri`` with our env knobs applied (imports MLflow)."""
    prepare_environment(request_timeout_s)
    from mlflow import MlflowClient

    quiet_loggers()
    return MlflowClient(tracking_uri=uri)


def http_status(err: BaseException) -> int | None:
    """HTTP status MLflow attaches to its exception (connection failures map to 500), else None."""
    get = getattr(err, "get_http_status_code", None)
    if get is None:
        return None
    try:
        return int(get())
    except Exception:
        return None


def is_transient(err: BaseException) -> bool:
    """True when retrying later may succeed: no connection, timeouts, 5xx, 429, a locked sqlite file.

    4xx answers (bad name, changed param, unknown run) are permanent: retrying them would wedge the
    queue forever, so the caller drops those items with a warning instead.
    """
    from elastic_pretrain.errors import UserError

    if isinstance(err, UserError):  # a store we refuse (tracking/store.py) stays refused
        return False
    status = http_status(err)
    if status is None:
        return True  # OSError, requests/sqlalchemy errors: the store is not reachable right now
    return status >= 500 or status == 429


def short_error(err: BaseException, limit: int = 160) -> str:
    """One line for a log message: MLflow errors embed whole URLs and chained reprs."""
    from elastic_pretrain.tracking.config import redact_uri

    text = redact_uri(" ".join(str(err).split()))  # MLflow quotes the request URL, credentials included
    if "Connection refused" in text or "NewConnectionError" in text:
        text = "connection refused"
    elif "timed out" in text or "Timeout" in text:
        text = "request timed out"
    return f"{type(err).__name__}: {text[:limit]}"
