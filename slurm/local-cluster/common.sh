# Shared settings and helpers of up.sh / down.sh (sourced, not run).
#
# Everything the local cluster owns lives under $ELASTIC_SLURM_HOME:
#   etc/slurm.conf  etc/hosts  env.sh       configuration (env.sh exports SLURM_CONF)
#   munge/          key, socket, pid of the private munged
#   state/ spool/   slurmctld state, slurmd spool dirs (wiped on a fresh start)
#   log/ run/       daemon logs and pid files
#
# Knobs (environment):
#   ELASTIC_SLURM_HOME          state directory                        (/tmp/elastic-slurm)
#   ELASTIC_SLURM_NODES         compute nodes node1..nodeN             (2)
#   ELASTIC_SLURM_CPUS          CPUs declared per node (may exceed hw) (2)
#   ELASTIC_SLURM_MEM_MB        RealMemory declared per node           (4000)
#   ELASTIC_SLURM_PORT          slurmctld port; slurmd of nodeK: +K    (16900)
#   ELASTIC_SLURM_CRED_EXPIRE   credential lifetime in s; a requeued job may restart only after it (10)
#   ELASTIC_SLURM_TIMEOUT       seconds to wait for idle nodes         (60)

ES_HOME=${ELASTIC_SLURM_HOME:-/tmp/elastic-slurm}
ES_NODES=${ELASTIC_SLURM_NODES:-2}
ES_CPUS=${ELASTIC_SLURM_CPUS:-2}
ES_MEM=${ELASTIC_SLURM_MEM_MB:-4000}
ES_PORT=${ELASTIC_SLURM_PORT:-16900}
ES_CRED_EXPIRE=${ELASTIC_SLURM_CRED_EXPIRE:-10}
ES_TIMEOUT=${ELASTIC_SLURM_TIMEOUT:-60}

ES_CONF=$ES_HOME/etc/slurm.conf
ES_MUNGE_SOCKET=$ES_HOME/munge/munge.sock
# Marker in the environment of every daemon we start (inherited by slurmstepd), so down.sh can
# find leftovers of *this* cluster without matching on process names.
ES_MARKER="ELASTIC_SLURM_DAEMON=$ES_HOME"
export SLURM_CONF=$ES_CONF

es_log() { printf '[%s %s] %s\n' "${0##*/}" "$(date +%T)" "$*"; }

# es_alive PIDFILE: the pid file names a live process that carries our marker
es_alive() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  es_has_marker "$pid"
}

es_has_marker() {
  { tr '\0' '\n' <"/proc/$1/environ"; } 2>/dev/null | grep -qxF -- "$ES_MARKER"
}

# es_stop PIDFILE...: SIGTERM the live ones together, wait up to 10 s, SIGKILL what is left
es_stop() {
  local f pid pids=()
  for f in "$@"; do
    if es_alive "$f"; then
      pid=$(cat "$f")
      kill "$pid" 2>/dev/null && pids+=("$pid")
    fi
    rm -f "$f"
  done
  [ "${#pids[@]}" -gt 0 ] || return 0
  for _ in $(seq 100); do
    local left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ "$left" = 0 ] && return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

# es_sweep: SIGKILL every process left over from this cluster: slurmstepd (carries the marker) and
# job processes (their environment names our slurm.conf and a job id). No process-name matching.
es_sweep() {
  local p pid env n=0
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    [ "$pid" = $$ ] && continue
    env=$( { tr '\0' '\n' <"$p/environ"; } 2>/dev/null) || continue
    if grep -qxF -- "$ES_MARKER" <<<"$env" ||
      { grep -qxF -- "SLURM_CONF=$ES_CONF" <<<"$env" && grep -q '^SLURM_JOB_ID=' <<<"$env"; }; then
      kill -9 "$pid" 2>/dev/null && n=$((n + 1))
    fi
  done
  [ "$n" = 0 ] || es_log "killed $n leftover process(es) of this cluster"
}
