#!/bin/bash
# A change that should change nothing, measured so: the commit before it (BASE, a worktree) and this checkout, in one
# sitting, alternated: batch-1 decode on the default model and the 0.5B file, the fixed workload on both, and the same
# greedy bf16 tokens (scripts/bench/same_tokens.py). Run alone, from the repository root:
#   git worktree add ../base d72ad8d && BASE=../base bash scripts/bench/house_ab.sh
set -u
HERE=$(pwd); BASE=$(cd "${BASE:?the worktree of the commit before}" && pwd); OUT=$HERE/${OUT:-runs/house_ab}
PY=$HERE/.venv/bin/python
mkdir -p "$OUT"
M=$($PY -c "from minivllm.model.fetch import fetch; print(fetch('qwen2.5-coder-0.5b-instruct-q4_k_m'))")
run() {  # tree label bench-args...: the tree's minivllm on the shared venv
  local tree=$1 label=$2; shift 2
  (cd "$tree" && PYTHONPATH=$tree $PY -m minivllm.cli "$@" --output-json "$OUT/$label.json") > "$OUT/$label.log" 2>&1
  echo "$label: $(grep -E 'tok/s' "$OUT/$label.log" | tail -2 | tr '\n' ' ')"
}
for rep in 1 2; do
  for side in before after; do
    tree=$([ $side = before ] && echo "$BASE" || echo "$HERE")
    run "$tree" "latency_default_${side}_$rep" bench latency --batch-size 1 --input-len 128 --output-len 128
    run "$tree" "latency_0.5B_${side}_$rep" bench latency --model "$M" --batch-size 1 --input-len 128 --output-len 128
    run "$tree" "fixed_default_${side}_$rep" bench throughput --dataset fixed
    run "$tree" "fixed_0.5B_${side}_$rep" bench throughput --model "$M" --dataset fixed
  done
done
for side in before after; do
  tree=$([ $side = before ] && echo "$BASE" || echo "$HERE")
  (cd "$tree" && PYTHONPATH=$tree $PY "$HERE/scripts/bench/same_tokens.py" "$OUT/tokens_$side.json")
done
$PY -c "import json, sys; a, b = (json.load(open(f'$OUT/tokens_{s}.json')) for s in ('before', 'after'));
print('the same tokens before and after:', all(a[k] == b[k] for k in ('default', '0.5B')))"
