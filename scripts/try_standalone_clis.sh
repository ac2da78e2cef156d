#!/usr/bin/env bash
# Runs docs/gateway.md's Standalone commands end to end: the standalone gateway on SmolLM2 (CPU), then
# stock Claude Code and Codex with the trimmed prompts the docs give for a small model. Prints each CLI's
# exit code and time, and the gateway's request log. Needs npm (scripts/install_agent_clis.sh installs
# the CLIs) and port 8000.
#
#   bash scripts/try_standalone_clis.sh          # OUT=dir keeps the logs there
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=$(bash scripts/install_agent_clis.sh | tail -1)
export PATH="$BIN:$PATH"
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"; echo "logs in $OUT"
.venv/bin/python -m rayrl.gateway serve --model smollm2-135m-instruct --port 8000 --admin-token ADMIN > $OUT/gateway.log 2>&1 &
GW=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 2; done
echo "gateway up after ~$((i*2)) s"
S1=$(curl -s -X POST -H 'Authorization: Bearer ADMIN' http://127.0.0.1:8000/rayrl/sessions)
TOKEN=$(echo "$S1" | python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])')
start=$(date +%s)
HOME=$(mktemp -d) ANTHROPIC_BASE_URL=http://127.0.0.1:8000 ANTHROPIC_AUTH_TOKEN=$TOKEN \
  CLAUDE_CODE_ATTRIBUTION_HEADER=0 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 \
  DISABLE_ERROR_REPORTING=1 DISABLE_AUTOUPDATER=1 CLAUDE_CODE_MAX_RETRIES=1 CLAUDE_CODE_MAX_OUTPUT_TOKENS=256 \
  timeout 600 claude -p "Say hello" --tools Bash --system-prompt "You are a terse shell assistant." </dev/null > $OUT/claude.out 2>&1
echo "claude rc=$? in $(( $(date +%s) - start )) s"; tail -5 $OUT/claude.out
S2=$(curl -s -X POST -H 'Authorization: Bearer ADMIN' http://127.0.0.1:8000/rayrl/sessions)
TOKEN2=$(echo "$S2" | python3 -c 'import json, sys; print(json.load(sys.stdin)["token"])')
export CODEX_HOME=$(mktemp -d) RAYRL_TOKEN=$TOKEN2
cat > $CODEX_HOME/config.toml <<'TOML'
model = "smollm2-135m-instruct"
model_provider = "rayrl"
check_for_update_on_startup = false
web_search = "disabled"
instructions = "You are a terse shell assistant."

[model_providers.rayrl]
name = "rayrl gateway"
base_url = "http://127.0.0.1:8000/v1"
env_key = "RAYRL_TOKEN"
wire_api = "responses"
request_max_retries = 1
stream_max_retries = 1

[skills]
include_instructions = false

[features]
plugins = false
apps = false
multi_agent = false
goals = false
TOML
start=$(date +%s)
timeout 600 codex exec --skip-git-repo-check --ephemeral "Say hello" </dev/null > $OUT/codex.out 2>&1
echo "codex rc=$? in $(( $(date +%s) - start )) s"; tail -5 $OUT/codex.out
for S in "$S1" "$S2"; do  # what each session recorded (turns, drift, errors)
    ID=$(echo "$S" | python3 -c 'import json, sys; print(json.load(sys.stdin)["session_id"])')
    curl -s -H 'Authorization: Bearer ADMIN' "http://127.0.0.1:8000/rayrl/sessions/$ID"; echo
done
grep -E "POST /v1|non-2xx|status" $OUT/gateway.log | tail -10
kill $GW; wait $GW 2>/dev/null
