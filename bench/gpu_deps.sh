#!/usr/bin/env bash
# Bring megatron-core and the project's other missing dependencies onto an OFFLINE GPU machine as wheels
# (docs/gpu.md, "GPU check"). The list is bench/gpu_wheels.txt; what the image already has, bench/gpu_image.txt.
#
#   bash bench/gpu_deps.sh download        # here, with network: wheels for the GPU machine's Python 3.12
#                                          # (manylinux x86-64) into bench/.wheels/ (git-ignored, ~15 MB)
#   bash bench/gpu_deps.sh install [DIR]   # there, offline: pip install --no-index --no-deps --target DIR
#                                          # (default /tmp/elastic-pretrain-site); prints DIR for PYTHONPATH
#   bash bench/gpu_deps.sh check           # here: the list covers what the image lacks (bench/gpu_deps.py)
#
# bench/.wheels/ is ignored by git, so it travels only when named: the device tool's `run` takes
# carry: ["bench/.wheels"]. bench/gpu_check.sh runs `install` itself when megatron-core does not import.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${GPU_WHEELS:-$ROOT/bench/.wheels}"  # GPU_WHEELS: another folder (tests)
PY="${PYTHON:-python3}"

case "${1:-}" in
download)
    pip_py="$PY"
    [[ -x "$ROOT/.venv/bin/python" ]] && pip_py="$ROOT/.venv/bin/python"
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    mapfile -t args < <("$PY" "$ROOT/bench/gpu_deps.py" pip-args "$WHEELS")
    "$pip_py" -m pip "${args[@]}" --quiet
    "$pip_py" "$ROOT/bench/gpu_deps.py" check >&2  # reads requirements from the installed metadata (.venv)
    echo "gpu_deps: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in bench/.wheels: carry it" >&2
    ;;
install)
    target="${2:-/tmp/elastic-pretrain-site}"
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "gpu_deps: no wheels in bench/.wheels: run 'bash bench/gpu_deps.sh download' on a machine with" \
             "network and carry bench/.wheels with the checkout" >&2
        exit 2
    fi
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$target" "$WHEELS"/*.whl >&2
    echo "$target"
    ;;
check)
    [[ -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python"
    exec "$PY" "$ROOT/bench/gpu_deps.py" check
    ;;
*)
    sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
