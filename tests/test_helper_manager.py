"""The helper process every saving rank starts (``checkpoint/helper_manager.py``: the Manager through which
megatron's checkpoint writers report): cheap, and proof against the stop signals that reach every process
of a Slurm job step. Each case runs a real rank-like script in a fresh interpreter (a script ``__main__``
that imports torch at its top, as tests/dist's and bench's do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO

RANK = """
import json, os, signal, sys, threading, time
import multiprocessing as mp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult


def writer(q):  # what megatron's forked writer does with its results
    q.put({0: [WriteResult(index=MetadataIndex("w"), size_in_bytes=3, storage_data=None)]})


def kids():
    found = []
    for stat in os.listdir("/proc"):
        try:
            if stat.isdigit() and int(open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append(int(stat))
        except (OSError, ValueError):
            pass
    return found


if __name__ == "__main__":
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from elastic_pretrain.checkpoint import manager
    from elastic_pretrain.checkpoint.preempt import StopRequest

    with StopRequest() as stop:
        before = set(kids())
        # a stop signal to this rank while the helper starts (as soon as the spawned process exists)
        def signal_during_start():
            while not set(kids()) - before - {threading.get_native_id()}:
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGUSR1)
        threading.Thread(target=signal_during_start, daemon=True).start()
        manager.start_write_results_queue()
        helper = manager._results_manager._process.pid
        q = filesystem_async._results_queue
        p = mp.get_context("fork").Process(target=writer, args=(q,))
        p.start()
        p.join()
        result = q.get_nowait()
        for _ in range(100):  # the signal's Python handler runs in this thread, between bytecodes
            if stop.requested:
                break
            time.sleep(0.01)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):  # as under Slurm
            os.kill(helper, sig)
        time.sleep(0.5)
        q.put("still serving")
        print(json.dumps({
            "result": type(result[0][0]).__name__,
            "stop": stop.name if stop.requested else None,
            "helper_alive": q.get_nowait() == "still serving",
            "helper_has_torch": "libtorch" in open(f"/proc/{helper}/maps").read(),
        }))
"""


def test_the_helper_survives_stop_signals_keeps_one_sent_while_it_starts_and_imports_no_torch(tmp_path: Path) -> None:
    """The writers' results cross as bytes (the helper never unpickles torch's ``WriteResult``) and the helper
    never reruns the rank's torch-importing main script: no torch in it (it cost ~3 s of CPU per saving
    rank per launch). It ignores the stop signals; the rank's own stop signal during the helper's start is
    delivered, not discarded (the start used to set ``SIG_IGN`` in the rank meanwhile)."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["result"] == "WriteResult", report
    assert report["stop"] == "SIGUSR1", f"the stop signal sent while the helper started was lost: {report}"
    assert report["helper_alive"], f"a stop signal killed the helper: {report}"
    assert not report["helper_has_torch"], f"the helper imported torch: {report}"
