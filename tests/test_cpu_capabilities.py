"""The quick numerics tests hold on every CPU vector path torch may pick, not only this machine's (issue 33).

torch's CPU kernels are compiled for several instruction sets and one is chosen at start-up
(``ATEN_CPU_CAPABILITY``: default, avx2, avx512); each rounds differently in the last bits (SIMD lanes,
fused multiply-add, vectorised transcendental functions). A tolerance tuned on one of them failed on another
(route replay's gates: 4.5e-8 against 1e-12 under AVX-512). This test reruns the model's numerics tests in a
fresh interpreter under every capability this CPU can execute besides its native one, so CI on an AVX2 machine
also runs the scalar path, and an AVX-512 machine also runs AVX2 and the scalar path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NUMERICS = ["tests/model"]  # the model math against naive references and megatron (tolerances per test)
# What torch's dispatcher needs for each level (aten/src/ATen/cpu/Utils.cpp: AVX-512 wants F, BW, VL, DQ).
NEEDS = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def native() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability().lower()


def runnable() -> list[str]:
    flags = cpu_flags()
    here = native()
    return [cap for cap, need in NEEDS.items() if need <= flags and cap != here]


def test_the_capability_table_matches_this_cpu():
    """The native capability is one this CPU has the flags for (else the table above is wrong and the
    reruns would pick an instruction set the CPU cannot execute: SIGILL)."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this machine")
    assert NEEDS[native()] <= flags


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_numerics_hold_under_another_vector_path(capability):
    if capability not in runnable():
        pytest.skip(f"{capability}: this CPU's native path ({native()}) or not executable here")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu", *NUMERICS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
    assert proc.returncode == 0, f"ATEN_CPU_CAPABILITY={capability}:\n{tail}"
