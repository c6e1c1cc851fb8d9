"""Where this process computes: ``cuda:<local rank>`` with CUDA, ``cpu`` without (docs/gpu.md).

Every tensor a collective reduces on a group that would be NCCL on a cluster, and every batch the
model reads, must live on :func:`device`. ``parallel/strict.py`` checks it (also on CPU machines).
"""

from __future__ import annotations

import torch


def device() -> torch.device:
    """The device the model and every NCCL collective of this process use."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` on :func:`device`. With CUDA a host tensor is pinned first, so the copy is asynchronous
    (``non_blocking``) and overlaps the kernels already queued; on CPU this returns ``t`` itself."""
    target = device()
    if target.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(target, non_blocking=True)
    return t.to(target)
