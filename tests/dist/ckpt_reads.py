"""Run by tests/checkpoint/test_parallel_io.py: ``torchrun --nproc-per-node 4 ckpt_reads.py OUT_DIR``.

4 ranks, EP 2 (dense tensors replicated on 4 ranks, each expert half on 2; the dense optimizer is
sharded over 4 DP ranks, each expert half's over 2): random Adam moments, a save through the trainer's
strategy (writes spread over DP), then two loads of it — megatron's plain torch_dist load (every
replica reads everything it needs) and the trainer's (reads spread over DP). Counted per rank:

* the optimizer state the save builds (bytes of the tensors it hands to the writer, and how many of
  those bytes are copies rather than views of the optimizer's own state) and the optimizer bytes this
  rank's files hold (raw tensor bytes, and as stored: DCP serialises each box with ``torch.save``);
* the optimizer state the load builds (bytes of the tensors it loads into);
* the bytes each load reads from the checkpoint's files, model and optimizer apart (every stored item
  DCP reads goes through ``FileSystemReader._slice_file``; plus the ``.metadata`` file each time);
* this rank's 1/DP share: the bytes of the optimizer slices it owns (``owned``).

Writes ``<OUT_DIR>/rank<R>.json``; both loads must give bitwise the same tensors (``same``).
"""

from __future__ import annotations

import json
import math
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

READ = {"model": 0, "optimizer": 0, "metadata": 0}

_read_data = FileSystemReader.read_data
_read_metadata = FileSystemReader.read_metadata


def _counting_read(self: FileSystemReader, plan: Any, planner: Any) -> Any:
    for item in plan.items:  # DCP reads each item's whole stored slice (FileSystemReader._slice_file)
        part = "optimizer" if item.storage_index.fqn.startswith("optimizer.") else "model"
        READ[part] += self.storage_data[item.storage_index].length
    return _read_data(self, plan, planner)


def _counting_metadata(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
    READ["metadata"] += Path(self.path, ".metadata").stat().st_size
    return _read_metadata(self, *args, **kwargs)


def tensor_bytes(d: Any) -> list[torch.Tensor]:
    out = []
    for v in d.values():
        out += tensor_bytes(v) if isinstance(v, dict) else [v.data if hasattr(v, "key") else v]
    return out


def load(net: Any, optimizer: Any, path: Path, strategy: Any) -> tuple[dict[str, int], int, dict[str, Any]]:
    model_sd = net.sharded_state_dict()
    template = optim_state.loading_template(optimizer, model_sd)
    built = sum(t.numel() * t.element_size() for t in tensor_bytes(template))
    dist.barrier()
    READ.update(model=0, optimizer=0, metadata=0)
    with torch.no_grad(), restricted_unpickling():
        loaded = dist_checkpointing.load(
            {"model": model_sd, "optimizer": template}, str(path), sharded_strategy=strategy
        )
    return dict(READ), built, loaded


def flat(d: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def stored_optimizer_bytes(ckpt: Path, rank: int) -> dict[str, int]:
    """Optimizer bytes in the checkpoint (all ranks' files, and this rank's), raw and as stored."""
    with restricted_unpickling():
        meta = FileSystemReader(str(ckpt)).read_metadata()
    out = {"optim_total": 0, "written_optim_raw": 0, "written_optim": 0, "optim_items_written": 0}
    for fqn, md in meta.state_dict_metadata.items():
        if not fqn.startswith("optimizer."):
            continue
        for chunk in md.chunks:
            raw = math.prod(chunk.sizes) * md.properties.dtype.itemsize
            out["optim_total"] += raw
            info = next(v for k, v in meta.storage_data.items() if k.fqn == fqn and k.offset == chunk.offsets)
            if info.relative_path.startswith(f"__{rank}_"):
                out["written_optim_raw"] += raw
                out["written_optim"] += info.length
                out["optim_items_written"] += 1
    return out


def main(out: Path) -> None:
    torch.set_num_threads(1)
    FileSystemReader.read_data = _counting_read  # type: ignore[method-assign]
    FileSystemReader.read_metadata = _counting_metadata  # type: ignore[method-assign]
    mesh = init_mesh(ParallelConfig(expert=2), seed=11)
    rank = mesh.rank
    net, _, optimizer = build("ep2")
    g = torch.Generator().manual_seed(5)
    owned, storages = 0, set()
    with torch.no_grad():
        for _, _, start, end, tensors in owned_slices(optimizer, net):
            for state in ("exp_avg", "exp_avg_sq"):
                tensors[state].copy_(torch.rand(tensors[state].shape, generator=g))
                storages.add(tensors[state].untyped_storage().data_ptr())
                owned += (end - start) * tensors[state].element_size()
            tensors["step"].fill_(3.0)
    # what the save hands to the writer for the optimizer, and how much of it is not a view of the state
    to_save = tensor_bytes(optim_state.sharded_optimizer_state(optimizer, net.sharded_state_dict())[0])
    save_built = sum(t.numel() * t.element_size() for t in to_save)
    save_copied = sum(t.numel() * t.element_size() for t in to_save if t.untyped_storage().data_ptr() not in storages)
    del to_save
    ckpt = out / "ckpt"
    if rank == 0:
        ckpt.mkdir()
    dist.barrier()
    save_tensors(net, optimizer, ckpt, parallel_io.save_strategy(TorchDistSaveShardedStrategy("torch_dist", 1)))
    dist.barrier()
    written = sum(p.stat().st_size for p in ckpt.glob(f"__{rank}_*.distcp"))
    plain_read, _, plain = load(net, optimizer, ckpt, TorchDistLoadShardedStrategy())
    spread_read, load_built, spread = load(net, optimizer, ckpt, parallel_io.load_strategy())
    a, b = flat(plain), flat(spread)
    same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    shard_bytes = [p.stat().st_size for p in ckpt.glob("*.distcp")]
    result = {
        "rank": rank, "dp": mesh.dp_size, "world": mesh.world_size, "written": written,
        "plain_read": sum(plain_read.values()), "spread_read": sum(spread_read.values()),
        "plain_read_model": plain_read["model"], "spread_read_model": spread_read["model"],
        "plain_read_optim": plain_read["optimizer"], "spread_read_optim": spread_read["optimizer"],
        "same": same, "owned": owned, "save_built": save_built, "save_copied": save_copied,
        "load_built": load_built, **stored_optimizer_bytes(ckpt, rank),
        "distcp_total": sum(shard_bytes), "metadata": (ckpt / ".metadata").stat().st_size,
        "largest_tensor": max(t.numel() * t.element_size() for t in a.values()),
        "largest_model_tensor": max(t.numel() * t.element_size() for k, t in a.items() if k.startswith("model.")),
        "params": JOB.model.hidden_size,
    }  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
