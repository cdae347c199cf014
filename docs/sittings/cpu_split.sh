#!/bin/bash
# CPU of the frontend, the engine core and the bench client over 30 s in the middle of a twelve-stream run
# (default model), from /proc; run it alone (quiet.sh). Writes /work/runs/omp_ab/.
set -u
OUT=/work/runs/omp_ab
source "$(cd "$(dirname "$0")" && pwd)/servers.sh"
ticks() { local f; f=$(sed 's/.*) //' /proc/$1/stat) ; set -- $f; echo $(( ${12} + ${13} )); }
$MV serve --port 8462 > $OUT/cpu-serve.log 2>&1 &
pid=$!
wait_healthy http://127.0.0.1:8462 cpu
sleep 1
$MV bench serve --base-url http://127.0.0.1:8462 --disable-tqdm --dataset random --input-len 64 --output-len 256 --num-prompts 48 --max-concurrency 12 > $OUT/cpu-12s.txt 2>&1 &
cl=$!
sleep 20  # the client's start-up (imports, tokenizer) and the first prefills
for c in $(cat /proc/$pid/task/*/children); do ps -o pid=,args= -p $c; done > $OUT/children.txt
eng=$(for c in $(cat /proc/$pid/task/*/children); do echo "$(ticks $c) $c"; done | sort -n | tail -1 | cut -d' ' -f2)
f0=$(ticks $pid); e0=$(ticks $eng); c0=$(ticks $cl); t0=$(date +%s.%N)
sleep 30
f1=$(ticks $pid); e1=$(ticks $eng); c1=$(ticks $cl); t1=$(date +%s.%N)
log "over $(echo "$t1 - $t0" | bc) s: frontend $((f1-f0)) ticks, engine $((e1-e0)) ticks, client $((c1-c0)) ticks (100/s)"
wait $cl
log "$(grep -E 'Output token throughput' $OUT/cpu-12s.txt)"
stop_server
