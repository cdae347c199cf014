#!/bin/bash
# quiet.sh CMD...: runs CMD with the machine to itself: every 2 s it stops (SIGSTOP) the helpers' test runs,
# builds and installs and anything running in their worktrees, with their children, and resumes them all
# when CMD ends. CMD's own processes are never stopped.
me=$$
stopped=/tmp/quiet_stopped.$$
: > $stopped
tree() { echo "$1"; for c in $(cat /proc/$1/task/*/children 2>/dev/null); do tree "$c"; done; }
pause_all() {
  local mine=" $(tree $me | tr '\n' ' ') "  # CMD's own processes (its converters, its builds) keep running
  local busy p
  # test runs, builds and installs; and whatever runs in a helper's worktree (QUIET_TREES, a glob)
  busy=$(pgrep -f -- '-m pytest|cc1|ninja|cmake --build|pip install|pip download|convert_hf_to_gguf|llama-quantize|setup_vllm_cpu')
  for p in /proc/[0-9]*; do
    case "$(readlink "$p/cwd" 2>/dev/null)" in ${QUIET_TREES:-/work/wt-*}) busy="$busy ${p#/proc/}" ;; esac
  done
  for p in $busy; do
    for q in $(tree $p); do
      case "$mine" in *" $q "*) continue ;; esac
      kill -STOP "$q" 2>/dev/null && echo "$q" >> $stopped
    done
  done
}
( while kill -0 $me 2>/dev/null; do pause_all; sleep 2; done ) &
watcher=$!
pause_all
"$@"
rc=$?
kill $watcher; wait $watcher 2>/dev/null
for q in $(sort -u $stopped); do kill -CONT "$q" 2>/dev/null; done
# anything stopped by an earlier, killed run
for q in $(ps -eo pid,stat | awk '$2 ~ /^T/ {print $1}'); do kill -CONT "$q" 2>/dev/null; done
rm -f $stopped
exit $rc
