#!/usr/bin/env bash
# Create .venv/ (Python 3.11) with everything elastic-pretrain needs on a CPU machine. Idempotent:
# a second run only checks. Never installs transformer-engine (GPU extra; breaks megatron on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || { echo "setup: $PY not found: install Python 3.11 (e.g. apt-get install python3.11-venv)" >&2; exit 1; }
stamp=.venv/.setup-$(cat pyproject.toml requirements/*.txt scripts/setup.sh | sha1sum | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c requirements/constraints-cpu.txt)
echo "setup: installing into .venv (torch CPU wheel, megatron-core, streaming, mlflow, lm-eval, ...)"
# torch first, from the local CPU wheel; the constraints file keeps it there for everything after.
"${PIP[@]}" "torch==2.13.0" 2>&1 | { grep -v "is ignored: it is neither" || true; }
# Exact pins (requirements/lock-cpu.txt), then the package itself, both without resolving: the lock is
# the venv's whole closure (`pip freeze`), so pip has nothing to look up; `pip check` below fails if a
# regenerated lock ever misses a dependency. DeepSpeed (engine=deepspeed) is an sdist: DS_BUILD_OPS=0
# builds it without compiled ops (none are used on CPU).
DS_BUILD_OPS=0 "${PIP[@]}" --no-deps -r requirements/lock-cpu.txt 2>&1 | { grep -v "is ignored: it is neither" || true; }
"${PIP[@]}" --no-deps -e . 2>&1 | { grep -v "is ignored: it is neither" || true; }
# No torchvision: mosaicml-streaming declares it, but PyPI's build beside CPU torch is a CUDA one that cannot
# import ("operator torchvision::nms does not exist"), and transformers imports torchvision whenever it is
# installed, so no Hugging Face model would load in this venv. Nothing uses it (streaming's vision module
# gets two stand-in names: elastic_pretrain/data/streaming_compat.py). A venv set up before has it: removed.
if .venv/bin/python -c "import importlib.metadata as m; m.version('torchvision')" 2>/dev/null; then
  .venv/bin/python -m pip uninstall --quiet --yes --disable-pip-version-check torchvision
fi
# `pip check`, tolerating exactly that one missing requirement (tests/test_install.py)
PIP_CHECK_TOLERATED='^mosaicml-streaming [^ ]+ requires torchvision, which is not installed\.$'
problems=$(.venv/bin/python -m pip check --disable-pip-version-check 2>&1 \
  | grep -Ev "$PIP_CHECK_TOLERATED|^No broken requirements found\.$" || true)
if [ -n "$problems" ]; then
  printf '%s\n' "$problems" >&2
  echo "setup: requirements/lock-cpu.txt misses the dependencies above: regenerate it (its header says how)" >&2
  exit 1
fi
# deepspeed's import alone costs ~3.5 s of CPU: its presence is checked, tests/engine imports it
.venv/bin/python -W ignore -c "import importlib.util, torch, megatron.core; assert importlib.util.find_spec('deepspeed'); assert torch.__version__.startswith('2.13.0'), torch.__version__" \
  || { echo "setup: the venv is broken (torch/megatron import failed): rm -rf .venv and rerun" >&2; exit 1; }
rm -f .venv/.setup-*
touch "$stamp"
echo "setup: done"
