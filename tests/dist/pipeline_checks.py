"""Run by tests/parallel/test_pipeline.py: ``torchrun --nproc-per-node 4 pipeline_checks.py OUT_DIR``.

The pipeline checks in one launch, so the processes import torch and megatron-core once:
pipeline_parity.py (4 ranks: the 1-process reference, then PP=2 x EP=2) into OUT_DIR/parity, then
pipeline_resume.py (ranks 0 and 1: the trainer at PP=1 / PP=2 and checkpoints across them) into
OUT_DIR/resume, then fp8_weight_cache.py (ranks 0 and 1: TE's FP8 weight cache under PP=2) into
OUT_DIR/fp8_cache. The imports stay under ``__main__``: a process spawned by megatron's checkpoint writer
re-runs this file's top level.
"""

if __name__ == "__main__":
    import os
    import sys
    from pathlib import Path

    from tests.dist import fp8_weight_cache, pipeline_parity, pipeline_resume

    out = Path(sys.argv[1]).resolve()
    os.chdir(Path(__file__).resolve().parents[2])  # the data recipe's paths are relative to the repository root
    (out / "parity").mkdir(parents=True, exist_ok=True)
    (out / "resume").mkdir(parents=True, exist_ok=True)
    (out / "fp8_cache").mkdir(parents=True, exist_ok=True)
    pipeline_parity.main(out / "parity", "pp2ep2")
    if int(os.environ["RANK"]) < 2:
        pipeline_resume.main(out / "resume")
        fp8_weight_cache.main(out / "fp8_cache")
