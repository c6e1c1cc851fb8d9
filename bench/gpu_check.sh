#!/usr/bin/env bash
# The GPU check (docs/gpu.md, "GPU check"): run it first on any CUDA machine. One GPU, < 8 minutes on an
# H200. Prints TE vs local spec, bf16 steps, bf16 vs FP8, looped vs GPTModel, grouped vs per-expert MoE,
# memory vs the estimate and the recompute overhead (bench/gpu_check.py), then runs `pytest -m gpu` and
# the route-replay A/B (bench/bench_replay.py).
#
#   bash bench/gpu_check.sh [--dry-run] [--only SECTION ...]     # from the repository root or anywhere
#   bash bench/gpu_check.sh --prepare-deps   # on a machine with the project's .venv: copy megatron-core
#                                            # 0.16.1 into bench/.deps/ for a GPU machine without network
#
# Assumes an NGC PyTorch container (CUDA torch + Transformer Engine + pyyaml + numpy + pytest), or any
# Python with those. megatron-core 0.16.1 comes from the environment, else bench/.deps/, else pip
# (pip install --no-deps megatron-core==0.16.1). The project runs from this checkout (PYTHONPATH);
# `pip install --no-deps -e .` works too where setuptools can build it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--prepare-deps" ]]; then
    src="$(.venv/bin/python -c 'import megatron.core, os; print(os.path.dirname(os.path.dirname(megatron.core.__file__)))')"
    rm -rf bench/.deps && mkdir -p bench/.deps && cp -r "$src" bench/.deps/megatron
    find bench/.deps -name __pycache__ -prune -exec rm -rf {} +
    echo "bench/.deps/megatron ($(du -sh bench/.deps | cut -f1)): carry it to the GPU machine with the checkout"
    exit 0
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1
have_megatron() { "$PY" -c 'import sys, megatron.core as m; sys.exit(m.__version__ != "0.16.1")' 2>/dev/null; }
if ! have_megatron && [[ -d bench/.deps/megatron ]]; then
    export PYTHONPATH="$ROOT/bench/.deps:$PYTHONPATH"
fi
if ! have_megatron; then
    "$PY" -m pip install --quiet --no-deps "megatron-core==0.16.1" \
        || { echo "gpu_check: megatron-core 0.16.1 unavailable: pip install it or run --prepare-deps" >&2; exit 2; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"

status=0
timeout 360 "$PY" bench/gpu_check.py "$@" || status=$?
if [[ " $* " != *" --dry-run "* ]] && "$PY" -c 'import pytest' 2>/dev/null; then
    echo "== pytest -m gpu"
    timeout 100 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts="" || status=$?
    echo "== route replay, interleaved A/B (ELR: -11.7% update time; docs/route-replay.md)"
    timeout 120 "$PY" bench/bench_replay.py --repeats 11 --experts 64 --tokens 2048 || status=$?
fi
exit $status
