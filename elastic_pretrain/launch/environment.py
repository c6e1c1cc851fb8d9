"""The environment a training job runs in on a GPU cluster: an NCCL preset, variables derived from the
job's parallel layout, and the user's ``slurm.env`` on top (it overrides any of the others, key by key).

The preset holds what is right on any InfiniBand/RoCE or Ethernet GPU cluster; what depends on the
site (which network interfaces, which HCAs, GPUDirect RDMA levels) is left out on purpose — NCCL
detects it, and a site that must pin it sets it in ``slurm.env`` (docs/slurm.md, "GPU clusters").
"""

from __future__ import annotations

import shlex
from pathlib import Path

from elastic_pretrain.parallel.config import ParallelConfig

# Applied on GPU nodes only (the CPU/gloo path does not use NCCL).
NCCL_PRESET: dict[str, str] = {
    # A failed or timed-out collective aborts the communicator and the process (torchrun's
    # --kill-on-bad-exit then ends the step) instead of leaving every other rank hanging in NCCL.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # On a collective timeout, each rank dumps its flight recorder (its last 2000 collectives) to
    # <run_dir>/nccl_trace_rank_<rank> (run_environment below): which rank was missing, in which collective.
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    # Free NCCL's send buffers when the collective finishes rather than on a later stream sync
    # (megatron's recommendation: lower peak memory with overlapped gradient reduction).
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    # InfiniBand: ride out a link flap or a switch reboot instead of failing the job (timeout
    # 4.096 us * 2^22 ~ 17 s per retry, 7 retries). Ignored on clusters without IB.
    "NCCL_IB_TIMEOUT": "22",
    "NCCL_IB_RETRY_CNT": "7",
    # Warnings and errors in the job log, not NCCL's per-communicator INFO lines (set INFO to debug).
    "NCCL_DEBUG": "WARN",
}

# What the site usually sets (left unset here: NCCL detects them). Listed in the rendered script.
SITE_VARIABLES = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_NET_GDR_LEVEL", "UCX_NET_DEVICES")


def cuda_device_max_connections(parallel: ParallelConfig) -> str | None:
    """``CUDA_DEVICE_MAX_CONNECTIONS`` for this layout (None: leave CUDA's default, 8).

    * TP > 1 (sequence parallelism is on with it): megatron overlaps each tensor-parallel all-gather /
      reduce-scatter with the GEMM next to it and relies on kernels starting in launch order, which
      only one hardware work queue guarantees (``tensor_parallel/layers.py``; Megatron-LM refuses to
      start TP without it).
    * otherwise with EP > 1: the MoE all-to-alls run on their own stream beside expert compute (and
      megatron's EP communication overlap needs it): several queues let them overlap, so 32.
    """
    if parallel.tensor > 1:
        return "1"
    if parallel.expert > 1:
        return "32"
    return None


def job_environment(parallel: ParallelConfig, *, gpus: bool) -> dict[str, str]:
    """The variables the job derives from its parallel layout (GPU nodes only)."""
    if not gpus:
        return {}
    value = cuda_device_max_connections(parallel)
    return {} if value is None else {"CUDA_DEVICE_MAX_CONNECTIONS": value}


def run_environment(run_dir: Path) -> dict[str, str]:
    """Defaults of every launch (``train --nproc-per-node`` and the sbatch script); a value the user has
    set (the environment, ``slurm.env``) wins. Harmless without CUDA or NCCL, which ignore them.

    * ``expandable_segments``: ℓ changes the activation footprint step to step; growing segments in
      place instead of caching fixed-size blocks of every size seen keeps reserved memory near the
      allocated peak (PyTorch's CUDA allocator docs; issue 31 item 4).
    * the flight recorder's dumps (on a collective timeout) go to the run directory, which outlives the
      node and its container's ``/tmp``: torch appends the rank (``TORCH_FR_DUMP_TEMP_FILE``, and its
      older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``).
    """
    trace = str(run_dir / "nccl_trace_rank_")
    return {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_FR_DUMP_TEMP_FILE": trace,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace,
    }


def with_run_defaults(env: dict[str, str], run_dir: Path) -> dict[str, str]:
    """``env`` with :func:`run_environment`'s defaults where ``env`` does not set the variable."""
    return {**run_environment(run_dir), **env}


def export_lines(
    *, gpus: bool, derived: dict[str, str], user: dict[str, str], defaults: dict[str, str] | None = None
) -> list[str]:
    """``export`` lines in four commented groups: preset, derived, run defaults (kept where the submitting
    environment set the variable: sbatch passes it on), ``slurm.env`` (which wins)."""
    out: list[str] = []
    defaults = {k: v for k, v in (defaults or {}).items() if k not in user}
    preset = {k: v for k, v in NCCL_PRESET.items() if k not in user} if gpus else {}
    derived = {k: v for k, v in derived.items() if k not in user}
    if preset:
        out.append("# NCCL preset (launch/environment.py); slurm.env overrides any of it. Site-specific, left to")
        out.append(f"# NCCL's detection unless slurm.env sets them: {', '.join(SITE_VARIABLES)}")
        out += [f"export {k}={shlex.quote(v)}" for k, v in preset.items()]
    if derived:
        out.append("# derived from the job's parallel layout (launch/environment.py)")
        out += [f"export {k}={shlex.quote(v)}" for k, v in sorted(derived.items())]
    if defaults:
        out.append("# run defaults (launch/environment.py); a value set where sbatch ran, or in slurm.env, wins")
        out += [f'[ -n "${{{k}+set}}" ] || export {k}={shlex.quote(v)}' for k, v in sorted(defaults.items())]
    if user:
        out.append("# slurm.env")
        out += [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(user.items())]
    return out
