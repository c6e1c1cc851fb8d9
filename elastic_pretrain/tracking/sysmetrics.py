"""System metrics (CPU, memory, disk, network, GPU) sampled into the tracker's own buffer.

Why not ``mlflow.start_run(log_system_metrics=True)`` / MLflow's ``SystemMetricsMonitor``: it is
bound to the fluent API's global active run, it calls ``get_run`` on the server before every sample,
and on the first failed call it stops for good (mlflow 3.17.2, ``SystemMetricsMonitor.monitor``
returns on any exception) — one server hiccup would end system metrics for the rest of a week-long
job. We reuse MLflow's per-resource monitor classes for the sampling and push the values through
the tracker, so they get the same buffering, retries and back-fill as training metrics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from elastic_pretrain.tracking.names import SYSTEM_PREFIX

log = logging.getLogger("elastic_pretrain.tracking")


def _monitors() -> list[Any]:
    """MLflow's CPU/disk/network monitors (need psutil) and a GPU one when pynvml is importable."""
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    monitors: list[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    try:
        import pynvml  # noqa: F401  (GPUMonitor only checks sys.modules)
        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

        monitors.append(GPUMonitor())
    except Exception:  # no pynvml / no NVIDIA driver: CPU-side metrics only
        pass
    return monitors


class SystemMetricsSampler:
    """A daemon thread that calls ``sink({"system/<name>": value})`` every ``interval_s`` seconds."""

    def __init__(self, interval_s: float, sink: Callable[[dict[str, float]], None]) -> None:
        self._interval_s = interval_s
        self._sink = sink
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracking-system-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)  # sampling never blocks long; never hang close() on it

    def _run(self) -> None:
        try:
            from elastic_pretrain.tracking.mlflow_env import prepare_environment, quiet_loggers

            prepare_environment()
            monitors = _monitors()
            quiet_loggers()
        except ImportError as err:
            log.warning("system metrics off: %s (pip install psutil to enable them)", err)
            return
        while not self._stop.wait(self._interval_s):
            try:
                values: dict[str, float] = {}
                for monitor in monitors:
                    monitor.collect_metrics()
                    values.update(monitor.aggregate_metrics())
                    monitor.clear_metrics()
                self._sink({SYSTEM_PREFIX + k: float(v) for k, v in values.items()})
            except Exception as err:  # a sensor failing must not end sampling, nor training
                log.debug("system metrics sample failed: %s", err)
