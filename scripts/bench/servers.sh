# Shared by the benchmark scripts beside it (sourced): the checkout they run (REPO, default the one holding
# these scripts, made the
# working directory), its Python and CLI, the 0.5B file; a log line with the time, a server's start and
# stop. The caller sets OUT (the results folder) first, and pid (the server being waited for or stopped).
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
cd "$REPO" || exit 1
PY=$REPO/.venv/bin/python
export PYTHONPATH=$REPO
MV="$PY -m minivllm.cli"
mkdir -p "$OUT"
M05=$HOME/.cache/minivllm/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/run.log"; }

wait_healthy() {  # url name: up to 15 min (a cold start compiles kernels, packs weights)
  local i
  for i in $(seq 900); do
    if curl -sf -o /dev/null "$1/health"; then return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then log "$2 exited while starting; see $OUT/$2.log"; return 1; fi
    sleep 1
  done
  log "$2 not healthy after 900 s"; return 1
}

stop_server() {
  kill "$pid"; wait "$pid"
  log "stopped (exit code $?)"
}
