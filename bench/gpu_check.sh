#!/usr/bin/env bash
# The GPU check (docs/gpu.md, "GPU check"): run it first on any CUDA machine. One GPU, one budget of 8 minutes
# for everything (setup included); sections run most informative first and each stops at its own budget
# (bench/gpu_check.py prints the plan, the figures, PASS/FAIL lines and a summary).
#
#   bash bench/gpu_check.sh                   # everything, <= 480 s
#   bash bench/gpu_check.sh --dry-run         # the plan with each section's budget (no torch, any machine)
#   bash bench/gpu_check.sh --only trainer parity
#
# Needs a Python with a CUDA torch (Transformer Engine for the TE sections: an NGC PyTorch container). Offline,
# megatron-core and the project's other missing dependencies come from bench/.wheels (bash bench/gpu_deps.sh
# download, on a machine with network; carry the folder with the checkout). The project runs from this
# checkout (PYTHONPATH). TF32 is off for the whole check (NVIDIA_TF32_OVERRIDE=0): fp32 comparisons are fp32.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TOTAL="${GPU_CHECK_BUDGET:-480}"  # bench/gpu_check.py TOTAL_BUDGET_S (a smaller one: tests)

for arg in "$@"; do
    if [[ "$arg" == "--dry-run" ]]; then
        exec "$PY" bench/gpu_check.py "$@"
    fi
done

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export MLFLOW_DISABLE_TELEMETRY=true PYTHONUNBUFFERED=1 NVIDIA_TF32_OVERRIDE=0
# found, not imported (cheap, and importing streaming bare would pull in its optional vision stack)
have_deps() { "$PY" -c 'import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ("megatron", "streaming"))))'; }
if ! have_deps; then
    site="$(bash bench/gpu_deps.sh install)" || exit 2
    export PYTHONPATH="$PYTHONPATH:$site"  # the wheels hold nothing the image has: its torch and numpy stay
    have_deps || { echo "gpu_check: megatron-core or streaming still missing after installing bench/.wheels" >&2; exit 2; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"

left=$((TOTAL - SECONDS))
# SIGINT at the overall limit: gpu_check.py prints its summary of what ran; SIGKILL 10 s later if it cannot
timeout -s INT -k 10 "$left" "$PY" bench/gpu_check.py --budget "$((left - 10))" "$@"
status=$?
if [[ $status == 124 || $status == 137 ]]; then
    echo "gpu_check: stopped at the overall budget of $TOTAL s (exit $status)"
fi
exit $status
