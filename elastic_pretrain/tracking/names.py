"""Metric names shared by the trainer, the tracker, the ``runs`` command and the docs.

MLflow accepts metric/param names made of alphanumerics, ``_ - . /``, spaces and (except on
Windows servers) ``:``; a name must not change under ``posixpath.normpath`` (no leading ``/``, no
``//``, ``.`` or ``..`` parts). We stay inside ``[A-Za-z0-9_.-/]`` so every server accepts them, and
use ``/`` for grouping because the MLflow UI groups charts by the prefix before the first ``/``.
"""

from __future__ import annotations

import re

LOSS = "loss"  # training loss of the step (mean over its micro-batches, whatever loop count each used)
LR = "lr"
GRAD_NORM = "grad_norm"
TOKENS_PER_S = "tokens_per_s"
MFU = "mfu"  # model FLOPs utilisation in [0, 1]; the peak used is the tag MFU_PEAK_TAG
HFU = "hfu"  # hardware FLOPs utilisation: MFU + recomputed forward + ghost-pass MoE calls (train/mfu.py)
GHOST_PASS_FRACTION = "ghost_pass_fraction"  # ghost passes / executed passes (expert-parallel mixed depth)
DEPTH_EFFICIENCY = "depth_efficiency"  # useful / executed passes of the step, global (1 - ghost_pass_fraction)
DEPTH_BALANCE = "depth_balance"  # mean / max executed passes per replica of the step (train/mfu.py: DepthCounts)
GHOST_TIME_S = "ghost_time_s"  # estimated seconds of the step spent in ghost passes (train/mfu.py: ghost_time_share)
# CUDA only: the caching allocator's peak since the previous report, GiB (train/memory_peaks.py)
PEAK_ALLOCATED_GIB = "memory/peak_allocated_gib"
PEAK_RESERVED_GIB = "memory/peak_reserved_gib"
TRAIN_FLOPS_VS_BASELINE = "train_flops_vs_baseline"  # model FLOPs trained so far / the ℓ=1 baseline's (same tokens)
MFU_PEAK_TAG = "mfu.peak_flops_per_s"  # e.g. "989 TFLOP/s (H100 SXM bf16 dense)"
SYSTEM_PREFIX = "system/"

_VAL_LOSS_LOOPS = re.compile(r"^val_loss_loops_(\d+)$")
_BAD_CHARS = re.compile(r"[^A-Za-z0-9_.\-/]")


def loss_loops(k: int) -> str:
    """Training loss of the micro-batches that ran with ``k`` loops."""
    return f"loss_loops_{k}"


def val_loss_loops(k: int) -> str:
    """Validation loss with ``k`` loops (logged by :meth:`Tracker.log_quality_budget`)."""
    return f"val_loss_loops_{k}"


def val_ppl_loops(k: int) -> str:
    """Validation perplexity ``exp(loss)`` with ``k`` loops (logged by :meth:`Tracker.log_quality_budget`)."""
    return f"val_ppl_loops_{k}"


def routing(layer: int | str, loop_pass: int | str, stat: str) -> str:
    """Router health of one MoE layer in one loop pass, e.g. ``routing/3/1/max_load``."""
    return f"routing/{layer}/{loop_pass}/{stat}"


def loops_of_val_loss(name: str) -> int | None:
    """``"val_loss_loops_4"`` -> 4; anything else -> None."""
    m = _VAL_LOSS_LOOPS.match(name)
    return int(m.group(1)) if m else None


def sanitize(name: str) -> str:
    """Map any string to a name every MLflow server accepts (bad characters -> ``_``)."""
    clean = _BAD_CHARS.sub("_", name)
    parts = [p if p not in (".", "..") else p.replace(".", "_") for p in clean.split("/") if p]
    return "/".join(parts)[:250] or "_"
