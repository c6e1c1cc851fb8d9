"""Model FLOPs utilisation: achieved matmul FLOP/s per device over a named peak."""

from __future__ import annotations

import torch

# bf16 dense peak FLOP/s per device (vendor data sheets), matched against torch's device name.
KNOWN_PEAKS: dict[str, tuple[float, str]] = {
    "H200": (989e12, "H200 SXM bf16 dense"),
    "H100": (989e12, "H100 SXM bf16 dense"),
    "A100": (312e12, "A100 bf16 dense"),
}


def device_peak(configured: float | None) -> tuple[float, str] | None:
    """The peak MFU is measured against, with its name; None when unknown (CPU without a setting)."""
    if configured:
        return configured, f"{configured:.3g} FLOP/s (train.peak_flops_per_s)"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, peak in KNOWN_PEAKS.items():
            if key in name:
                return peak
    return None


def training_flops_per_token(forward_flops_per_token: float) -> float:
    """Forward + backward ≈ 3 × forward matmul FLOPs (no activation recomputation)."""
    return 3.0 * forward_flops_per_token
