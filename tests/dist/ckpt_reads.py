"""Run by tests/checkpoint/test_parallel_io.py: ``torchrun --nproc-per-node 4 ckpt_reads.py OUT_DIR``.

4 ranks, EP 2 (dense tensors replicated on 4 ranks, each expert half on 2): random Adam moments,
a save through the trainer's strategy (writes spread over DP), then two loads of it — megatron's
plain torch_dist load (every replica reads everything it needs) and the trainer's (reads spread over
DP) — counting the bytes each rank reads from the checkpoint's files (every stored item DCP reads goes
through ``FileSystemReader._slice_file``; plus the ``.metadata`` file each time it is read). Writes
``<OUT_DIR>/rank<R>.json``: bytes written (this rank's files), bytes read by each load, and whether
both loads gave bitwise the same tensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader

from elastic_pretrain.checkpoint import optim_state, parallel_io
from elastic_pretrain.checkpoint.manager import save_tensors
from elastic_pretrain.checkpoint.safe_load import restricted_unpickling
from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
from tests.dist.ckpt_reshard import JOB, build, owned_slices

READ = {"bytes": 0}


_slice_file = FileSystemReader._slice_file
_read_metadata = FileSystemReader.read_metadata


def _counting_slice(self: FileSystemReader, file: Any, sinfo: Any) -> Any:
    READ["bytes"] += sinfo.length  # the bytes of one stored item that this rank asked for
    return _slice_file(self, file, sinfo)


def _counting_metadata(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
    READ["bytes"] += Path(self.path, ".metadata").stat().st_size
    return _read_metadata(self, *args, **kwargs)


def load(net: Any, optimizer: Any, path: Path, strategy: Any) -> tuple[int, dict[str, Any]]:
    model_sd = net.sharded_state_dict()
    template = optim_state.loading_template(optimizer, model_sd)
    dist.barrier()
    READ["bytes"] = 0
    with torch.no_grad(), restricted_unpickling():
        loaded = dist_checkpointing.load(
            {"model": model_sd, "optimizer": template}, str(path), sharded_strategy=strategy
        )
    return READ["bytes"], loaded


def flat(d: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def main(out: Path) -> None:
    torch.set_num_threads(1)
    FileSystemReader._slice_file = _counting_slice  # type: ignore[method-assign]
    FileSystemReader.read_metadata = _counting_metadata  # type: ignore[method-assign]
    mesh = init_mesh(ParallelConfig(expert=2), seed=11)
    rank = mesh.rank
    net, _, optimizer = build("ep2")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, _, _, _, tensors in owned_slices(optimizer, net):
            for state in ("exp_avg", "exp_avg_sq"):
                tensors[state].copy_(torch.rand(tensors[state].shape, generator=g))
            tensors["step"].fill_(3.0)
    ckpt = out / "ckpt"
    if rank == 0:
        ckpt.mkdir()
    dist.barrier()
    save_tensors(net, optimizer, ckpt, parallel_io.save_strategy(TorchDistSaveShardedStrategy("torch_dist", 1)))
    dist.barrier()
    written = sum(p.stat().st_size for p in ckpt.glob(f"__{rank}_*.distcp"))
    plain_bytes, plain = load(net, optimizer, ckpt, TorchDistLoadShardedStrategy())
    spread_bytes, spread = load(net, optimizer, ckpt, parallel_io.load_strategy())
    a, b = flat(plain), flat(spread)
    same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    shard_bytes = [p.stat().st_size for p in ckpt.glob("*.distcp")]
    result = {
        "rank": rank, "dp": mesh.dp_size, "world": mesh.world_size, "written": written,
        "plain_read": plain_bytes, "spread_read": spread_bytes, "same": same,
        "distcp_total": sum(shard_bytes), "metadata": (ckpt / ".metadata").stat().st_size,
        "largest_tensor": max(t.numel() * t.element_size() for t in a.values()),
        "params": JOB.model.hidden_size,
    }  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
