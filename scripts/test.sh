#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set up .venv, then pytest (slow, multi-process and Slurm
# tests included; the Slurm tests bring up their own local cluster). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MLFLOW_DISABLE_TELEMETRY=true
exec .venv/bin/python -m pytest "$@"
