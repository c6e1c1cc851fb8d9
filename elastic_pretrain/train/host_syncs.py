"""Count the host syncs of a training step on any device (issue 31 item 2; docs/gpu.md, "Host syncs").

A host sync is a read of a device tensor's value on the host: ``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool()``/``float()``/``int()`` of a tensor, ``nonzero`` (its output size), and the
wait of megatron's alltoall dispatcher for its device-to-host copy of the tokens per expert
(``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` at its ``cuda_sync_point``). On CUDA each
stalls the launch queue until the GPU catches up; on CPU nothing stalls, so :class:`HostSyncCounter`
counts the calls instead (a ``TorchFunctionMode``), per call site, which makes the count a CPU-checkable
proxy of ``torch.cuda.set_sync_debug_mode`` (``bench/gpu_check.sh``).

Some sites read tensors that are host tensors on CUDA too and so never sync there; they are counted
apart (``HOST_SITES``) with the reason.
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
READS = frozenset(
    {
        _T.item,
        _T.tolist,
        _T.cpu,
        _T.numpy,
        _T.__bool__,
        _T.__float__,
        _T.__int__,
        _T.__index__,
        _T.nonzero,
        torch.nonzero,
    }
)

# (path fragment, why the tensor read there is a host tensor on CUDA as well: no sync)
HOST_SITES = (
    (
        "megatron/core/transformer/moe/moe_utils.py",
        "sort_chunks_by_idxs: split sizes copied to the host at the dispatcher's sync point (counted there)",
    ),
    (
        "megatron/core/transformer/moe/experts.py",
        "SequentialMLP: tokens per expert, a host tensor after the dispatcher's sync point",
    ),
    ("torch/optim/", "the optimizer's step counters live on the host (capturable=False)"),
)
DISPATCHER = "megatron alltoall dispatcher (tokens per expert)"


class HostSyncCounter(TorchFunctionMode):
    """Counts host reads of tensors by call site (the first frame outside torch's own modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in READS:
            self.sites[_site(func)] += 1
        return func(*args, **(kwargs or {}))

    def device_syncs(self) -> dict[str, int]:
        """The counted sites that read a tensor on the device under CUDA (``HOST_SITES`` left out)."""
        return {s: n for s, n in self.sites.items() if not any(frag in s for frag, _ in HOST_SITES)}

    def total(self) -> int:
        return sum(self.device_syncs().values())


def _site(func: Any) -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path and "/torch/optim/" not in path:
            continue
        short = path.split("site-packages/")[-1]
        short = short[short.index("elastic_pretrain/") :] if "elastic_pretrain/" in short else short
        return f"{short}:{frame.lineno} {getattr(func, '__name__', func)}"
    return f"? {getattr(func, '__name__', func)}"


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncCounter]:
    """Count host reads and megatron dispatcher syncs (under ``DISPATCHER``) inside the block."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

    counter = HostSyncCounter()
    original = Dispatcher._maybe_dtoh_and_synchronize

    def counted(disp: Any, point: str, tokens_per_expert: Any = None) -> Any:
        if not disp.drop_and_pad and point == disp.cuda_sync_point != "no_sync":
            counter.sites[DISPATCHER] += 1  # megatron waits on its device-to-host copy here
        return original(disp, point, tokens_per_expert)

    Dispatcher._maybe_dtoh_and_synchronize = counted  # type: ignore[method-assign]
    try:
        with counter:
            yield counter
    finally:
        Dispatcher._maybe_dtoh_and_synchronize = original  # type: ignore[method-assign]
