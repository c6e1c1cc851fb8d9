"""A rank of the node launcher with the trainer's stop contract and nothing else (no torch), for
test_stop_chain.py: the trainer's own :class:`~elastic_pretrain.checkpoint.preempt.StopRequest`, with
marker files in DIR so that a test can signal it at a chosen point.

``started`` (its pid) → waits for ``install`` → installs the stop handler (``StopRequest``), ``ready`` →
waits until a stop is requested → ``STOPPED`` (the signal's name; the "save") → leaves ``StopRequest``
(what the trainer does on its way out), ``exiting`` → waits for ``go`` → exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from elastic_pretrain.checkpoint.preempt import StopRequest


def _wait(path: Path) -> None:
    while not path.exists():
        time.sleep(0.02)


def main(folder: Path) -> int:
    # written whole, then renamed: the test reads the pid as soon as ``started`` exists
    (folder / "started.tmp").write_text(f"{os.getpid()}\n")
    os.replace(folder / "started.tmp", folder / "started")
    _wait(folder / "install")
    with StopRequest() as stop:
        (folder / "ready").write_text("")
        while not stop.requested:
            time.sleep(0.02)
        (folder / "STOPPED").write_text(stop.name)
    (folder / "exiting").write_text("")
    _wait(folder / "go")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
