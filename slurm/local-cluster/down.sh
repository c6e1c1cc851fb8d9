#!/usr/bin/env bash
# down.sh - stop everything up.sh started: cancel the jobs, stop slurmd x N, slurmctld, munged
# (pid file + environment marker, never by process name), then kill leftover slurmstepd / job
# processes of this cluster (no cgroups here, so a stray job process could outlive its job).
# Usage: down.sh [--purge]     --purge also removes $ELASTIC_SLURM_HOME
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"

if es_alive "$ES_HOME/run/slurmctld.pid"; then
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    es_log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null
    for _ in $(seq 40); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.25; done
  fi
fi
es_stop "$ES_HOME"/run/slurmd-*.pid "$ES_HOME/run/slurmctld.pid"
es_stop "$ES_HOME/munge/munged.pid"
es_sweep
if [ "${1:-}" = --purge ]; then
  case "$ES_HOME" in /|"") ;; *) rm -rf "$ES_HOME" ;; esac
fi
es_log "down"
