#!/usr/bin/env bash
# The embedded default, from a fresh clone: set up .venv, prepare the CPython-stdlib corpus (MDS
# shards, byte-level), train jobs/tiny-cpu.yaml on 2 CPU processes (gloo, expert parallel 2).
# Extra arguments are job overrides, e.g.  bash scripts/run-default.sh train.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/elastic-pretrain prepare-data stdlib-code
exec .venv/bin/elastic-pretrain train jobs/tiny-cpu.yaml --nproc-per-node 2 "$@"
