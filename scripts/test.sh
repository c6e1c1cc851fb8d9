#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set up .venv, then pytest (slow, multi-process and Slurm
# tests included; the Slurm tests bring up their own local cluster), after ruff and mypy. Extra args go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MLFLOW_DISABLE_TELEMETRY=true
.venv/bin/ruff check --quiet .   # lint first: a second, not a 20-minute run
.venv/bin/ruff format --check --quiet .   # the code as `ruff format .` writes it (pyproject: line length 120)
.venv/bin/mypy                   # types of elastic_pretrain/ (pyproject [tool.mypy]); a failure stops the run
exec .venv/bin/python -m pytest "$@"
