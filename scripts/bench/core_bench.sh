#!/bin/bash
# Issue 30 (the engine core in its own process): the benchmarks, to run ALONE on the machine.
#   bash scripts/bench/core_bench.sh         # REPO: this checkout by default; OUT: ./runs/core_bench_out
# On the default model and on the 0.5B file:
#   (a) offline `bench throughput --dataset fixed` vs `bench serve --dataset fixed` (all at once, streaming)
#       against `minivllm serve` (engine-core process) and `--disable-frontend-multiprocessing`
#   (b) `bench serve --dataset random --input-len 64 --output-len 256 --max-concurrency 12` against both
#       servers, S12_PAIRS times (default 3), each bracketed by `bench latency --batch-size 12 --input-len 64
#       --output-len 256` runs just before and after it: the ratio is taken to the mean of the two, since
#       these machines drift by 10-20 % within minutes and a single pair measures the drift as much as the server
#   (c) idle CPU (user + system, from /proc) of the server's processes over 60 s
#   (d) vLLM-CPU's api_server vs `minivllm serve`: the fixed workload's lengths, 200 requests, all at once,
#       then Poisson at 70 % of vLLM's saturated request rate (our TPOT mean and P99 TTFT vs vLLM's), each
#       on a freshly started server (ONLY_RATE70=1: only these, at the rate of an earlier saturated run)
# Results: $OUT (one JSON per run, server logs, summary.md at the end).
# Ports 8441-8449.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)  # before the cd below: servers.sh lies beside this script
OUT=${OUT:-$PWD/runs/core_bench_out}
source "$HERE/servers.sh"  # REPO (cd there), PY, MV, M05, VLLM_PY; log, wait_healthy, stop_server, start_vllm, hf_checkpoint_05b
IDLE_S=60
VLLM_PROMPTS=${VLLM_PROMPTS:-200}  # requests of the saturated vLLM comparison (SKIP_RATE70=1: no Poisson run)
pid=""

start_minivllm() {  # name port args...
  local name=$1 port=$2; shift 2
  $MV serve --port "$port" "$@" > "$OUT/$name.log" 2>&1 &
  pid=$!
  wait_healthy "http://127.0.0.1:$port" "$name"
}

process_tree() {  # the pid and its descendants
  local p=$1 c
  echo "$p"
  for c in $(cat /proc/"$p"/task/*/children 2>/dev/null); do process_tree "$c"; done
}

cpu_ticks() {  # summed utime + stime of the given pids
  local total=0 p f
  for p in "$@"; do
    f=$(sed 's/.*) //' /proc/"$p"/stat 2>/dev/null) || continue
    set -- $f
    total=$((total + ${12} + ${13}))
  done
  echo "$total"
}

idle_cpu() {  # name: CPU of the server's process tree over IDLE_S idle seconds -> OUT/name-idle.json
  local name=$1 pids before after hz
  pids=$(process_tree "$pid")
  hz=$(getconf CLK_TCK)
  sleep 5  # the last request's stream is closed
  before=$(cpu_ticks $pids)
  sleep "$IDLE_S"
  after=$(cpu_ticks $pids)
  # printf, not bc's own output: bc writes .16 for 0.16, which is not JSON
  printf '{"pids": "%s", "seconds": %d, "cpu_seconds": %.4f, "percent_of_one_core": %.4f}\n' "$(echo $pids)" "$IDLE_S" \
    "$(echo "($after - $before) / $hz" | bc -l)" "$(echo "100 * ($after - $before) / $hz / $IDLE_S" | bc -l)" \
    > "$OUT/$name-idle.json"
  log "$name idle: $(cat "$OUT/$name-idle.json")"
}

bench_serve() {  # name port model-args... extra-args...
  local name=$1 port=$2; shift 2
  $MV bench serve --base-url "http://127.0.0.1:$port" --disable-tqdm --output-json "$OUT/$name.json" "$@" \
    > "$OUT/$name.txt" 2>&1
  log "$name: $(grep -E 'Total token throughput|Output token throughput|Mean TPOT|P99 TTFT|Time per request' "$OUT/$name.txt" | tr '\n' ';')"
}

latency_b12() {  # name model-args...: the engine's decode rate at batch 12, offline (the server idles meanwhile)
  local name=$1; shift
  $MV bench latency --batch-size 12 --input-len 64 --output-len 256 "$@" --output-json "$OUT/$name.json" \
    > "$OUT/$name.txt" 2>&1
  log "$name: $(grep -E 'Decode step:|Whole batch:' "$OUT/$name.txt" | tr '\n' ';')"
}

run_model() {  # tag model-args...
  local tag=$1; shift
  local margs=("$@")
  log "== $tag: offline"
  $MV bench throughput --dataset fixed "${margs[@]}" --disable-tqdm --output-json "$OUT/$tag-offline-fixed.json" \
    > "$OUT/$tag-offline-fixed.txt" 2>&1
  log "$tag offline fixed: $(grep 'Throughput' "$OUT/$tag-offline-fixed.txt")"

  local mode port=8441
  for mode in ${MODES:-core inproc}; do
    local extra=()
    [ "$mode" = inproc ] && extra=(--disable-frontend-multiprocessing)
    log "== $tag: minivllm serve ($mode)"
    if start_minivllm "$tag-serve-$mode" "$port" "${margs[@]}" "${extra[@]}"; then
      bench_serve "$tag-$mode-fixed-all" "$port" "${margs[@]}" --dataset fixed
      latency_b12 "$tag-$mode-b12-0" "${margs[@]}"
      for i in $(seq "${S12_PAIRS:-3}"); do
        bench_serve "$tag-$mode-12streams-$i" "$port" "${margs[@]}" --dataset random --input-len 64 --output-len 256 \
          --num-prompts 48 --max-concurrency 12 --seed "$i"
        latency_b12 "$tag-$mode-b12-$i" "${margs[@]}"
      done
      [ "$mode" = core ] && [ "$tag" = default ] && idle_cpu "$tag-$mode"
      stop_server
    fi
    port=$((port + 1))
  done
}

run_vllm() {  # tag checkpoint model-args...
  local tag=$1 ckpt=$2; shift 2
  local margs=("$@") rate
  log "== $tag: vLLM-CPU api_server vs minivllm serve, $VLLM_PROMPTS requests of the fixed workload"
  if [ -z "${ONLY_RATE70:-}" ]; then
    start_vllm "$tag-vllm-server" 8445 "$ckpt" || return
    bench_serve "$tag-vllm-sat" 8445 "${margs[@]}" --dataset fixed --num-prompts "$VLLM_PROMPTS"
    stop_server
    start_minivllm "$tag-serve-vs-vllm" 8446 "${margs[@]}" || return
    bench_serve "$tag-minivllm-sat" 8446 "${margs[@]}" --dataset fixed --num-prompts "$VLLM_PROMPTS"
    stop_server
  fi
  [ -n "${SKIP_RATE70:-}" ] && return
  rate=$("$PY" -c "import json; print(0.7 * json.load(open('$OUT/$tag-vllm-sat.json'))['metrics']['request_throughput'])")
  echo "$rate" > "$OUT/$tag-rate70"
  # Each Poisson run starts on a fresh server: after the saturated run (the same 200 prompts) a server
  # serves them from its prefix cache, as much as its KV pool keeps (vLLM's 2 GiB kept nearly all).
  start_vllm "$tag-vllm-server-rate70" 8445 "$ckpt" || return
  bench_serve "$tag-vllm-rate70" 8445 "${margs[@]}" --dataset fixed --num-prompts 200 --request-rate "$rate"
  stop_server
  start_minivllm "$tag-serve-rate70" 8446 "${margs[@]}" || return
  bench_serve "$tag-minivllm-rate70" 8446 "${margs[@]}" --dataset fixed --num-prompts 200 --request-rate "$rate"
  stop_server
}

log "start: REPO=$REPO commit $(git -C "$REPO" rev-parse --short HEAD)"
[ -f "$M05" ] || $MV fetch qwen2.5-coder-0.5b-instruct-q4_k_m > /dev/null
if [ -z "${ONLY_VLLM:-}" ]; then
  [ -z "${ONLY_05B:-}" ] && run_model default
  run_model q05b --model "$M05"
fi
if [ -n "${SKIP_VLLM:-}" ]; then
  log "(d) skipped: SKIP_VLLM"
elif [ -x "$VLLM_PY" ]; then
  [ -z "${ONLY_05B:-}" ] && run_vllm default "$PEERS/smollm2-135m-hf"
  [ -z "${SKIP_05B_VLLM:-}" ] && run_vllm q05b "$(hf_checkpoint_05b)" --model "$M05"
else
  log "no vLLM at $VLLM_PY: run ../shared/peers/setup_vllm_cpu.sh first; (d) skipped"
fi

"$PY" - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
def fmt(x, f="{:.1f}"):
    return "-" if x is None else f.format(x)
def rates(r):
    """bench latency's decode step rate and whole-batch rate (prefill included), from its fields: older
    sittings' JSON lacks the second"""
    return (r["batch_size"] * 1000 / r["decode_step_ms"],
            r["batch_size"] * r["output_len"] * len(r["latencies"]) / sum(r["latencies"]))
print("| model | measure | value | vs | ratio | target |\n|---|---|---:|---:|---:|---:|")
for tag in ("default", "q05b"):
    off = load(f"{tag}-offline-fixed")
    off_tps = off["result"]["total_tokens_per_s"] if off else None
    for mode in ("core", "inproc"):
        sat, idle = load(f"{tag}-{mode}-fixed-all"), load(f"{tag}-{mode}-idle")
        if sat:
            v = sat["metrics"]["total_token_throughput"]
            print(f"| {tag} | served fixed all-at-once total tok/s ({mode}) | {v:.1f} | offline {fmt(off_tps)} | "
                  f"{fmt(v / off_tps if off_tps else None, '{:.0%}')} | >= 90% |")
            print(f"| {tag} | time breakdown ms ({mode}, fixed) | {sat.get('time_breakdown_ms')} | | | |")
        ratios, whole, i = [], [], 1
        while all(run := [load(f"{tag}-{mode}-{name}") for name in (f"b12-{i - 1}", f"12streams-{i}", f"b12-{i}")]):
            before, s12, after = run
            dec, batch = zip(*(rates(b["result"]) for b in (before, after)))
            v = s12["metrics"]["output_throughput"]
            ratios.append(v / (sum(dec) / 2))
            whole.append(v / (sum(batch) / 2))
            print(f"| {tag} | 12 streams output tok/s ({mode}, pair {i}); TPOT {s12['metrics']['tpot_ms']['mean']:.1f} ms | "
                  f"{v:.1f} | latency b12 decode {dec[0]:.1f} before, {dec[1]:.1f} after; whole batch {batch[0]:.1f}, "
                  f"{batch[1]:.1f} | {ratios[-1]:.0%}; {whole[-1]:.0%} of the whole batch | |")
            print(f"| {tag} | time breakdown ms ({mode}, 12 streams, pair {i}) | {s12.get('time_breakdown_ms')} | | | |")
            i += 1
        if ratios:
            print(f"| {tag} | 12 streams ({mode}), mean of {len(ratios)} bracketed pairs | | | "
                  f"{sum(ratios) / len(ratios):.0%}; {sum(whole) / len(whole):.0%} of the whole batch | >= 90% |")
        if idle:
            print(f"| {tag} | idle CPU over 60 s ({mode}) | {idle['percent_of_one_core']:.2f}% of a core | | | < 2% |")
    vs, ms = load(f"{tag}-vllm-sat"), load(f"{tag}-minivllm-sat")
    if vs and ms:
        a, b = ms["metrics"]["total_token_throughput"], vs["metrics"]["total_token_throughput"]
        print(f"| {tag} | saturation total tok/s, minivllm vs vLLM | {a:.1f} | {b:.1f} | {a / b:.2f}x | >= 1.25x |")
    vr, mr = load(f"{tag}-vllm-rate70"), load(f"{tag}-minivllm-rate70")
    if vr and mr:
        a, b = mr["metrics"]["tpot_ms"]["mean"], vr["metrics"]["tpot_ms"]["mean"]
        print(f"| {tag} | 70% rate: mean TPOT ms | {a:.1f} | {b:.1f} | {a / b:.2f}x | <= 0.7x |")
        a, b = mr["metrics"]["ttft_ms"]["percentiles"]["99"], vr["metrics"]["ttft_ms"]["percentiles"]["99"]
        print(f"| {tag} | 70% rate: P99 TTFT ms | {a:.1f} | {b:.1f} | {a / b:.2f}x | <= 0.5x |")
PY
log "done"
