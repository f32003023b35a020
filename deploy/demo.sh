#!/usr/bin/env bash
# The main job, on one machine: `shunter serve` (API + dispatcher + its own local Ray + SQLite at ./shunter.db),
# an example 2-worker DDP job submitted over REST and watched to its end, then the service stopped (and its Ray).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
export SHUNTER_PORT="${SHUNTER_PORT:-8080}"
URL="http://127.0.0.1:${SHUNTER_PORT}"
mkdir -p shunter-data
LOG=shunter-data/serve.log

"$BIN/shunter" serve >"$LOG" 2>&1 &
SERVE_PID=$!
stop() {
  if kill -0 "$SERVE_PID" 2>/dev/null; then
    echo "stopping shunter serve (and its local Ray) ..."
    kill -TERM "$SERVE_PID"; wait "$SERVE_PID" || true
  fi
}
trap stop EXIT

printf 'starting shunter serve and a local Ray (log: %s) ' "$LOG"
for _ in $(seq 1 120); do
  if curl -sf "$URL/readyz" >/dev/null; then break; fi
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then echo; echo "shunter serve exited:"; tail -30 "$LOG"; exit 1; fi
  printf '.'; sleep 1
done
curl -sf "$URL/readyz" >/dev/null || { echo; echo "service not ready after 120 s"; tail -30 "$LOG"; exit 1; }
DASHBOARD=$("$BIN/python" -c 'import json; print(json.load(open("shunter-data/ray-head.json"))["dashboard_url"])' 2>/dev/null || echo "$SHUNTER_RAY_DASHBOARD_URL")
echo " ready: API $URL, web page $URL/ui, Ray dashboard $DASHBOARD"

echo "submitting examples/mlp-ddp.yaml over REST ..."
"$BIN/shunter" submit examples/mlp-ddp.yaml --server "$URL" --watch
JOB=$("$BIN/shunter" list --server "$URL" --json | "$BIN/python" -c 'import json,sys; print(json.load(sys.stdin)["items"][0]["id"])')
echo
"$BIN/shunter" status "$JOB" --server "$URL"
echo
echo "try: curl -s $URL/v1/jobs/$JOB | python3 -m json.tool"
