#!/usr/bin/env bash
# Claude Code (`claude -p`, Messages API) and Codex CLI (`codex exec`, Responses API), unchanged,
# against a local `minivllm serve` of the 0.5B Qwen2.5-Coder file: each gets a short task and must
# finish it (exit 0). Offline but for the first npm install. Not part of `make test` (minutes: each
# CLI's first request is a 10k-15k-token prompt of system text and tool schemas).
#
#   scripts/agent_clis.sh            # both;   scripts/agent_clis.sh claude|codex   # one
#
# Environment: AGENT_CLIS_DIR (where the npm packages go, default ~/.cache/minivllm/agent-clis),
# PORT (default 8765), TASK (the prompt), KEEP=1 keeps the work directory (logs, the CLIs' homes).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
CLIS=${AGENT_CLIS_DIR:-$HOME/.cache/minivllm/agent-clis}
PORT=${PORT:-8765}
NAME=qwen2.5-coder-0.5b
TASK=${TASK:-"What is 17 + 25? Answer with the number only."}
WHICH=${1:-both}
WORK=$(mktemp -d /tmp/agent-clis.XXXXXX)
URL=http://127.0.0.1:$PORT

if [ ! -x "$CLIS/node_modules/.bin/claude" ] || [ ! -x "$CLIS/node_modules/.bin/codex" ]; then
  mkdir -p "$CLIS" && (cd "$CLIS" && nice -n 19 npm install --no-audit --no-fund @anthropic-ai/claude-code @openai/codex) \
    || { echo "npm install failed"; exit 2; }
fi
MODEL=$(nice -n 19 "$PY" -m minivllm.cli fetch qwen2.5-coder-0.5b-instruct-q4_k_m | tail -n 1)

# The model's own template (Qwen2.5 renders tools and calls in the hermes format); a context that
# holds Claude Code's ~15k-token first prompt with room to answer.
nice -n 19 "$PY" -m minivllm.cli serve "$MODEL" --port "$PORT" --served-model-name "$NAME" --max-model-len 32768 \
  --enable-auto-tool-choice --tool-call-parser hermes >"$WORK/server.log" 2>&1 &
SERVER=$!
cleanup() {
  kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null
  [ "${KEEP:-0}" = 1 ] && echo "logs in $WORK" || rm -rf "$WORK"
}
trap cleanup EXIT
for _ in $(seq 300); do
  grep -q "^minivllm: serving" "$WORK/server.log" && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log"; exit 2; }
  sleep 1
done

run_claude() {
  mkdir -p "$WORK/claude" "$WORK/claude-config"
  (cd "$WORK/claude" && ANTHROPIC_BASE_URL=$URL ANTHROPIC_API_KEY=local CLAUDE_CONFIG_DIR="$WORK/claude-config" \
    ANTHROPIC_MODEL=$NAME ANTHROPIC_SMALL_FAST_MODEL=$NAME CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
    DISABLE_AUTOUPDATER=1 API_TIMEOUT_MS=1800000 CLAUDE_STREAM_IDLE_TIMEOUT_MS=1800000 \
    timeout 1800 nice -n 19 "$CLIS/node_modules/.bin/claude" -p "$TASK" --model "$NAME" --max-turns 3 \
    >"$WORK/claude.out" 2>&1)
  local rc=$?
  echo "claude -p exit code: $rc"; echo "--- its answer:"; tail -n 20 "$WORK/claude.out"
  return $rc
}

run_codex() {
  mkdir -p "$WORK/codex-home" "$WORK/codex"
  cat >"$WORK/codex-home/config.toml" <<EOF
model = "$NAME"
model_provider = "minivllm"

[model_providers.minivllm]
name = "minivllm"
base_url = "$URL/v1"
wire_api = "responses"
env_key = "LOCAL_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 1800000
EOF
  (cd "$WORK/codex" && CODEX_HOME="$WORK/codex-home" LOCAL_API_KEY=local \
    timeout 1800 nice -n 19 "$CLIS/node_modules/.bin/codex" exec --skip-git-repo-check "$TASK" </dev/null \
    >"$WORK/codex.out" 2>&1)
  local rc=$?
  echo "codex exec exit code: $rc"; echo "--- its answer:"; tail -n 20 "$WORK/codex.out"
  return $rc
}

status=0
case "$WHICH" in
  claude) run_claude || status=1 ;;
  codex) run_codex || status=1 ;;
  *) run_claude || status=1; run_codex || status=1 ;;
esac
echo "--- what the server saw:"; grep -E "POST|ignoring|error" "$WORK/server.log" | tail -n 20
exit $status
