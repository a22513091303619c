#!/usr/bin/env bash
# End-to-end overhead of the gate, side by side in one run: the same load (wrk, POST chat
# completions, keep-alive) against the stub directly, through nginx (a plain reverse proxy,
# buffering off) and through slackgate (every request admitted, dispatched, logged to a file).
# Everything on 127.0.0.1, bounded in time; prints a markdown table. On this shared 2-core
# machine wrk, the proxy and the stub compete for cores: compare the ratios, not the absolutes.
#
#   scripts/bench-proxy.sh [SECONDS] [CONNECTIONS]
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-8}
CONNS=${2:-32}
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null; }
cargo build --release -q -p slackgate
BIN=target/release/slackgate
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
wait_http() { for _ in $(seq 100); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "not up: $1" >&2; return 1; }

STUB=$(free_port); GATE=$(free_port); NGX=$(free_port); GATEM=$(free_port)
$BIN stub --listen 127.0.0.1:$STUB --slots 1024 --latency fixed:0ms --output-tokens 16 2>/dev/null & PIDS+=($!)
cat > "$WORK/gate.toml" <<TOML
[server]
listen = "127.0.0.1:$GATE"
ledger = "$WORK/ledger.db"
[log]
path = "$WORK/decisions.jsonl"
[[pools]]
name = "default"
slots = 1024
upstream = "http://127.0.0.1:$STUB"
[pools.prior]
overhead_ms = 1
decode_ms_per_token = 0.01
[[classes]]
name = "interactive"
deadline_ms = 30000
TOML
$BIN serve --config "$WORK/gate.toml" 2>/dev/null & PIDS+=($!)
# The same gate with its ledger in memory: what durability costs, side by side.
sed -e "s/127.0.0.1:$GATE/127.0.0.1:$GATEM/" -e 's|^ledger = .*|ledger = "memory"|' \
    -e "s|decisions.jsonl|decisions-mem.jsonl|" "$WORK/gate.toml" > "$WORK/gate-mem.toml"
$BIN serve --config "$WORK/gate-mem.toml" 2>/dev/null & PIDS+=($!)
cat > "$WORK/nginx.conf" <<NGINX
worker_processes 1;
daemon off;
pid $WORK/nginx.pid;
error_log $WORK/nginx.err;
events { worker_connections 4096; }
http {
  access_log off;
  upstream stub { server 127.0.0.1:$STUB; keepalive 64; }
  server {
    listen 127.0.0.1:$NGX;
    location / {
      proxy_pass http://stub;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }
  }
}
NGINX
nginx -c "$WORK/nginx.conf" -p "$WORK" 2>/dev/null & PIDS+=($!)
wait_http "http://127.0.0.1:$STUB/health"; wait_http "http://127.0.0.1:$GATE/healthz"; wait_http "http://127.0.0.1:$GATEM/healthz"; wait_http "http://127.0.0.1:$NGX/health"

cat > "$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"model":"stub","messages":[{"role":"user","content":"hello there"}],"max_tokens":16}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-Job-Class"] = "interactive"
LUA

run() { # name url
  local out; out=$(wrk -t1 -c"$CONNS" -d"${DUR}s" --latency -s "$WORK/post.lua" "$2/v1/chat/completions")
  local rps p50 p99 non2xx
  rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  p50=$(awk '$1=="50%" {print $2}' <<<"$out")
  p99=$(awk '$1=="99%" {print $2}' <<<"$out")
  non2xx=$(awk '/Non-2xx/ {print $5}' <<<"$out"); non2xx=${non2xx:-0}
  echo "$1|$rps|$p50|$p99|$non2xx"
}
echo "wrk -t1 -c$CONNS -d${DUR}s, POST /v1/chat/completions, stub latency 0 ms, $(nproc) cores" >&2
R1=$(run direct "http://127.0.0.1:$STUB")
R2=$(run nginx "http://127.0.0.1:$NGX")
R3=$(run "slackgate (SQLite ledger)" "http://127.0.0.1:$GATE")
R4=$(run "slackgate (memory ledger)" "http://127.0.0.1:$GATEM")
base=$(cut -d'|' -f2 <<<"$R1")
echo "| target | req/s | vs direct | p50 | p99 | non-2xx |"
echo "|---|---|---|---|---|---|"
for r in "$R1" "$R2" "$R3" "$R4"; do
  IFS='|' read -r name rps p50 p99 n <<<"$r"
  ratio=$(python3 -c "print(f'{float($rps)/float($base):.2f}')")
  echo "| $name | $rps | $ratio | $p50 | $p99 | $n |"
done
lines=$(wc -l < "$WORK/decisions.jsonl")
echo
echo "slackgate wrote $lines decision-log lines during its run (admit + dispatch + complete per request)"
echo "and held every request's tokens in its SQLite ledger ($(sqlite3 "$WORK/ledger.db" 'select count(*) from holds' 2>/dev/null || echo '?') rows), durable before each upstream call and before each response's end."
