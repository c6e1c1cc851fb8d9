"""Loader throughput: TokenBatches over MDS and WebDataset shards vs raw ``np.memmap`` reads.

All three read the same packed sequences (a capped slice of the stdlib corpus) in the same
global order, so the ratio is the cost of the real shard readers (streaming's MDS reader, the
webdataset tar pipeline) and the order computation. Prints numbers; asserts nothing.

    .venv/bin/python bench/bench_loader.py [--tokens 4e6] [--steps 100] [--batch 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from elastic_pretrain.config import build
from elastic_pretrain.data.config import DataConfig
from elastic_pretrain.data.loader import TokenBatches
from elastic_pretrain.data.prepare import prepare_data
from elastic_pretrain.data.streaming_compat import import_streaming

SEQ_LEN = 128


def _recipe(root: Path, fmt: str, tokens: int) -> DataConfig:
    out = root / fmt
    return build(DataConfig, {
        "format": fmt, "seq_len": SEQ_LEN, "streams": [{"path": str(out)}],
        "prepare": {"source": "stdlib", "output": str(out), "max_tokens": tokens, "samples_per_shard": 4096},
    })  # fmt: skip


def _loader(cfg: DataConfig, batch: int) -> TokenBatches:
    return TokenBatches(cfg, micro_batch_size=batch, num_micro_batches=1, dp_rank=0, dp_size=1, seed=0)


class _Clock:
    """Wall and CPU time of a block: the machine may be shared, CPU time is the steadier number."""

    def __enter__(self) -> _Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def rates(self, tokens: int) -> tuple[float, float]:
        return tokens / self.wall, tokens / max(self.cpu, 1e-9)


def _time_loader(cfg: DataConfig, batch: int, steps: int) -> tuple[float, float]:
    loader = _loader(cfg, batch)
    loader.next_step()  # first touch: imports, shard verification (sha256), first tar window
    with _Clock() as clock:
        for _ in range(steps):
            loader.next_step()
    return clock.rates(steps * batch * (SEQ_LEN + 1))


def _memmap_baseline(cfg: DataConfig, root: Path, batch: int, steps: int) -> tuple[float, float]:
    """The same rows, flat in one uint16 file, gathered by the same global order."""
    loader = _loader(cfg, batch)
    reader = loader.readers[0]
    rows = np.stack([reader.get(i) for i in range(len(reader))])
    path = root / "flat.u16"
    rows.tofile(path)
    mm = np.memmap(path, dtype=rows.dtype, mode="r", shape=rows.shape)
    order = [loader.order(np.arange(s * batch, (s + 1) * batch))[1] for s in range(steps + 1)]
    np.asarray(mm[np.sort(order[0])], dtype=np.int64)
    with _Clock() as clock:
        for idx in order[1:]:
            np.asarray(mm[idx], dtype=np.int64)
    return clock.rates(steps * batch * (SEQ_LEN + 1))


def _training_tokens_per_s(steps: int = 8) -> float:
    """Tokens/s one process of the default job consumes (model of jobs/tiny-cpu.yaml, fwd+bwd+AdamW
    of one 4 x 128 micro-batch, 1 thread) — what the loader has to keep up with per rank."""
    import torch

    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown

    torch.set_num_threads(1)
    job = load_job(Path(__file__).resolve().parent.parent / "jobs" / "tiny-cpu.yaml")
    init_mesh(ParallelConfig(), seed=0)
    try:
        model = build_model(job.model, ParallelConfig())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 257, (job.train.micro_batch_size, SEQ_LEN + 1))

        def step() -> None:
            opt.zero_grad()
            model(tokens[:, :-1], labels=tokens[:, 1:])[job.model.max_loops].mean().backward()
            opt.step()

        step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return steps * tokens[:, 1:].numel() / (time.perf_counter() - start)
    finally:
        teardown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=4e6, help="training tokens to prepare per format")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as tmp:
        root = Path(tmp)
        os.environ["TMPDIR"] = tmp  # streaming's lock files stay inside the scratch directory
        cfgs = {fmt: _recipe(root, fmt, int(args.tokens)) for fmt in ("mds", "wds")}
        start = time.perf_counter()
        import_streaming()  # ~10 s once per process (it imports transformers): not the writer's cost
        print(f"import streaming: {time.perf_counter() - start:.1f} s")
        for fmt, cfg in cfgs.items():
            start = time.perf_counter()
            m = prepare_data(cfg, progress=False)
            secs = time.perf_counter() - start
            print(
                f"prepare {fmt}: {m.splits['train'].tokens / 1e6:.1f} M tokens in {secs:.1f} s "
                f"({m.splits['train'].tokens / secs / 1e6:.1f} M tok/s incl. reading the stdlib)"
            )
        base = _memmap_baseline(cfgs["mds"], root, args.batch, args.steps)
        print(f"{'reader':18s} {'wall M tok/s':>13s} {'CPU M tok/s':>12s} {'CPU ratio':>10s}")
        print(f"{'np.memmap gather':18s} {base[0] / 1e6:13.2f} {base[1] / 1e6:12.2f} {1:10.4f}")
        walls = {}
        for fmt, cfg in cfgs.items():
            wall, cpu = _time_loader(cfg, args.batch, args.steps)
            walls[fmt] = wall
            print(f"{'TokenBatches ' + fmt:18s} {wall / 1e6:13.2f} {cpu / 1e6:12.2f} {cpu / base[1]:10.4f}")
        train = _training_tokens_per_s()
        print(f"\ntiny training step (1 process): {train:,.0f} tok/s")
        for fmt, wall in walls.items():
            print(
                f"  loader {fmt} / training consumption: {wall / train:,.0f}x (the loader is not the bottleneck"
                f" while this is >> 1)"
            )


if __name__ == "__main__":
    main()
