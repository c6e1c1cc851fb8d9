"""The bounded, thread-safe hand-off between the training thread and the tracker's sender thread.

The training thread only appends under a lock (microseconds); the sender takes batches out, and
puts a batch back at the front when a send fails, so order is kept and nothing is lost until the
bound is hit. At the bound the oldest values go first: when a long outage ends, recent history is
worth more than the start of the outage, and the run's first steps were sent before it began.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("elastic_pretrain.tracking")

# key, value, timestamp (ms since epoch), step — the fields of mlflow.entities.Metric
MetricRow = tuple[str, float, int, int]


@dataclass
class Staged:
    """An artifact waiting for upload: a local file or folder and where it goes in the run."""

    local: Path
    artifact_path: str | None
    owned: bool  # a private copy the sender deletes after upload (vs. a file the tracker keeps)


@dataclass
class TrackerStats:
    """Counters for tests, logs and the end-of-run summary."""

    buffered: int = 0  # metric values waiting to be sent
    sent: int = 0  # metric values accepted by MLflow
    dropped: int = 0  # oldest values discarded because the buffer was full
    skipped: int = 0  # values whose step was not after the last step logged for their key
    rejected: int = 0  # values MLflow refused (4xx); see the warning that names the error
    failed_attempts: int = 0  # sends that failed in a retryable way (one warning per outage, not per attempt)
    reachable: bool | None = None  # None until the first attempt to reach MLflow


class Buffer:
    """Pending metrics, params, tags and artifacts, guarded by one condition variable."""

    def __init__(self, max_metrics: int) -> None:
        self.cond = threading.Condition()
        self.max_metrics = max_metrics
        self.metrics: deque[MetricRow] = deque()
        self.params: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.artifacts: dict[tuple[str | None, str], Staged] = {}
        self.last_step: dict[str, int] = {}  # per key, the last step queued in this process
        self.latest_step = -1  # the largest step queued for any key (system metrics use it)
        self.garbage: list[Staged] = []  # replaced private artifact copies, deleted by the sender
        self.in_flight = 0  # metric values taken by the sender and not yet confirmed or put back
        self.stats = TrackerStats()
        self.flush_requested = False
        self.stopping = False
        self.disabled = False  # MLflow refused the run for good: accept nothing more
        self._full_warned = False

    # -- producer side (training thread, system-metrics thread); caller holds no lock --
    def add_metrics(self, rows: list[MetricRow]) -> None:
        """Queue values whose step is after the last step queued for their key; count the others.

        One value per key and step keeps the step axis clean: a resumed job that repeats steps
        after its last checkpoint, or a value logged twice, does not draw a zigzag in the UI.
        """
        with self.cond:
            if self.disabled:
                return
            for row in rows:
                key, step = row[0], row[3]
                if step <= self.last_step.get(key, -1):
                    self.stats.skipped += 1
                    continue
                self.last_step[key] = step
                self.latest_step = max(self.latest_step, step)
                self.metrics.append(row)
            self._enforce_bound()
            if len(self.metrics) >= 1000:  # a full MLflow batch: no reason to wait for the interval
                self.cond.notify_all()

    def _enforce_bound(self) -> None:
        over = len(self.metrics) - self.max_metrics
        if over <= 0:
            return
        for _ in range(over):
            self.metrics.popleft()
        self.stats.dropped += over
        if not self._full_warned:
            self._full_warned = True
            log.warning(
                "tracking buffer full (%d metric values): dropping the oldest until MLflow accepts data again; "
                "the number dropped is reported then",
                self.max_metrics,
            )

    # -- consumer side (sender thread) --
    def take_metrics(self, n: int) -> list[MetricRow]:
        with self.cond:
            k = min(n, len(self.metrics))
            batch = [self.metrics.popleft() for _ in range(k)]
            self.in_flight += k
            return batch

    def done_metrics(self, batch: list[MetricRow], sent: int, rejected: int = 0) -> None:
        with self.cond:
            self.in_flight -= len(batch)
            self.stats.sent += sent
            self.stats.rejected += rejected

    def put_back(self, batch: list[MetricRow]) -> None:
        """A send failed: the batch goes back in front of newer values, keeping the step order."""
        with self.cond:
            self.in_flight -= len(batch)
            self.metrics.extendleft(reversed(batch))
            self._enforce_bound()

    def reset_full_warning(self) -> int:
        """After recovery: arm the buffer-full warning again; return how many were dropped so far."""
        with self.cond:
            self._full_warned = False
            return self.stats.dropped

    def idle(self) -> bool:
        """Nothing pending or in flight (caller holds ``cond``)."""
        return not (self.metrics or self.params or self.tags or self.artifacts or self.in_flight)

    def snapshot(self) -> TrackerStats:
        with self.cond:
            s = self.stats
            return TrackerStats(
                buffered=len(self.metrics) + self.in_flight,
                sent=s.sent,
                dropped=s.dropped,
                skipped=s.skipped,
                rejected=s.rejected,
                failed_attempts=s.failed_attempts,
                reachable=s.reachable,
            )
