"""What a training rank imports: every rank of every launch pays for it (docs/testing.md, "Time").

``import streaming`` alone costs ~6 s of CPU (its package ``__init__`` imports transformers, hence
scikit-learn, pandas and accelerate), more than torch; a training rank only needs streaming's MDS
reader. These tests run in a fresh interpreter, because pytest's own process has imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO

# Imported by no training or evaluation rank: they belong to other commands (export, lm-eval, the
# DeepSpeed engine, plots, MLflow when tracking is on) or to streaming's unused vision/text datasets.
NOT_IN_A_RANK = ("transformers", "sklearn", "pandas", "accelerate", "matplotlib", "lm_eval", "datasets",
                 "deepspeed", "mlflow")  # fmt: skip


def _run(code: str, tmp_path: Path) -> dict[str, list[str]]:
    """Run ``code`` in a fresh interpreter; it leaves ``found`` (module names); returns its JSON report."""
    script = textwrap.dedent(code) + textwrap.dedent(f"""
        import json, sys
        print(json.dumps({{"found": found, "loaded": sorted(m for m in {NOT_IN_A_RANK!r} if m in sys.modules)}}))
    """)
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path)}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_training_rank_writes_and_reads_mds_shards_without_transformers(tmp_path):
    """The CLI, the trainer and evaluation modules, then an MDS shard written and read back through the
    project's own paths (``MDSSink``, streaming's reader): none of the heavy packages gets imported."""
    report = _run(
        f"""
        import json
        from pathlib import Path
        import numpy as np
        from elastic_pretrain import cli
        cli.build_parser()  # every command module, as `elastic-pretrain train` imports them
        import elastic_pretrain.train.trainer, elastic_pretrain.eval.loss  # noqa: F401
        from elastic_pretrain.data.shards import MDS_INDEX, MDSSink
        sink = MDSSink(Path({str(tmp_path / "mds")!r}), sample_tokens=5, dtype=np.dtype("uint16"), samples_per_shard=2)
        sink.write(np.arange(15, dtype=np.uint16).reshape(3, 5))
        shards = sink.finish()
        from streaming.base.format import reader_from_json
        entry = json.loads(open({str(tmp_path / "mds")!r} + "/" + MDS_INDEX).read())["shards"][1]
        row = reader_from_json({str(tmp_path / "mds")!r}, "", entry).get_item(0)["tokens"]
        found = [len(shards), row.tolist()]
    """,
        tmp_path,
    )
    assert report["found"] == [2, [10, 11, 12, 13, 14]]  # the third row, in the second shard
    assert report["loaded"] == [], f"a training rank imports {report['loaded']}: make the import lazy"


def test_the_whole_streaming_package_is_still_there_after_a_lean_import(tmp_path):
    """A deferred ``streaming`` package runs its ``__init__`` at the first package-level name, so code
    that uses ``streaming.StreamingDataset`` (bench/bench_loader.py, a user's script) keeps working."""
    report = _run(
        """
        from elastic_pretrain.data.streaming_compat import import_streaming, import_streaming_lean
        import_streaming_lean()
        import streaming.base.format  # noqa: F401
        import sys
        lean = "transformers" in sys.modules
        from streaming import MDSWriter, StreamingDataset
        import streaming.base
        found = [lean, StreamingDataset.__module__, MDSWriter.__module__,
                 streaming.base.StreamingDataLoader.__module__, import_streaming().Stream.__module__]
    """,
        tmp_path,
    )
    assert report["found"] == [False, "streaming.base.dataset", "streaming.base.format.mds.writer",
                               "streaming.base.dataloader", "streaming.base.stream"]  # fmt: skip
