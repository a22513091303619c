#!/usr/bin/env bash
# The gate overloaded: what a refusal costs and what a queued request weighs.
#
# 1. Refusals under a flood. Four requests hold the pool's four slots (the stub keeps them)
#    and the prior says each takes 16 s, so every interactive request (2 s deadline) is
#    refused at once with 429 `projected_wait_exceeds_slack`. wrk then sends as fast as it can
#    (far past 10x the pool's capacity): its req/s are refusals per second, its latencies the
#    refusals'. Beside it, nginx answering a fixed 429 from its config: the cheapest refusal
#    an HTTP server can give, as the reference.
# 2. Memory per queued request. With the slots held, N best-effort requests (no deadline) are
#    sent on N connections and queue in the gate; the gate's resident memory before and while
#    they wait, divided by the queue depth /stats reports (the connection, its body and the
#    job: what an operator pays per queued request).
#
# Everything on 127.0.0.1, bounded in time.
#
#   scripts/bench-overload.sh [SECONDS] [QUEUED]   (QUEUED at most 1000: server.max_connections_per_addr)
#
# Environment: ROUNDS=3 (flood rounds, alternated with nginx), SLACKGATE_BIN=PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-6}
QUEUED=${2:-900}
ROUNDS=${ROUNDS:-1}
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null; }
if [ -n "${SLACKGATE_BIN:-}" ]; then
  BIN=$SLACKGATE_BIN
else
  cargo build --release -q -p slackgate
  BIN=target/release/slackgate
fi
ulimit -n 16384
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
. scripts/bench-lib.sh
rss_kb() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
pool_depth() {
  curl -s --max-time 5 "http://127.0.0.1:$GATE/stats" | python3 -c 'import json,sys
try: print(json.load(sys.stdin)["gate"]["pools"][0]["depth"])
except Exception: print(0)'
}

STUB=$(free_port); GATE=$(free_port); NGX=$(free_port)
$BIN stub --listen 127.0.0.1:$STUB --slots 4 --latency fixed:0ms --output-tokens 16 2>/dev/null & PIDS+=($!)
wait_http "http://127.0.0.1:$STUB/health"
cat > "$WORK/gate.toml" <<TOML
[server]
listen = "127.0.0.1:$GATE"
ledger = "memory"
[log]
path = "$WORK/decisions.jsonl"
[[pools]]
name = "default"
slots = 4
max_queued = 100000
upstream = "http://127.0.0.1:$STUB"
[pools.prior]
overhead_ms = 1
decode_ms_per_token = 1000
learn = false
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 2000
[[classes]]
name = "batch"
priority = 10
TOML
$BIN serve --config "$WORK/gate.toml" 2>"$WORK/gate.err" & GPID=$!; PIDS+=($GPID)
cat > "$WORK/nginx.conf" <<NGINX
worker_processes 1;
daemon off;
pid $WORK/nginx.pid;
error_log $WORK/nginx.err;
events { worker_connections 4096; }
http {
  access_log off;
  server {
    listen 127.0.0.1:$NGX;
    location / { default_type application/json; return 429 '{"error":{"code":"rate_limited"}}'; }
  }
}
NGINX
nginx -c "$WORK/nginx.conf" -p "$WORK" 2>/dev/null & PIDS+=($!)
wait_http "http://127.0.0.1:$GATE/healthz"
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$NGX/" && break; sleep 0.1; done

# Hold the four slots.
for i in 1 2 3 4; do
  curl -s -o /dev/null "http://127.0.0.1:$GATE/v1/chat/completions" -H 'x-job-class: batch' \
    -H "x-stub-hold: slot$i" -H 'content-type: application/json' \
    -d '{"model":"stub","messages":[{"role":"user","content":"hold"}],"max_tokens":16}' &
  PIDS+=($!)
done
for _ in $(seq 100); do
  [ "$(curl -s "http://127.0.0.1:$STUB/stub/stats" | python3 -c 'import json,sys
try: print(json.load(sys.stdin)["in_flight"])
except Exception: print(-1)')" = 4 ] && break
  sleep 0.1
done

cat > "$WORK/interactive.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"model":"stub","messages":[{"role":"user","content":"hello there"}],"max_tokens":16}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-Job-Class"] = "interactive"
LUA
flood() { # url -> "rps p50 p99 non2xx total"
  wrk_run "$1" "$WORK/interactive.lua" 64 "$DUR"
}
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
: > "$WORK/flood"
for r in $(seq "$ROUNDS"); do
  echo "$r gate $(flood "http://127.0.0.1:$GATE/v1/chat/completions")" >> "$WORK/flood"
  echo "$r nginx $(flood "http://127.0.0.1:$NGX/v1/chat/completions")" >> "$WORK/flood"
done

# Memory per queued request.
sleep 1
before=$(rss_kb "$GPID")
cat > "$WORK/batch.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"model":"stub","messages":[{"role":"user","content":"queued work"}],"max_tokens":16}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-Job-Class"] = "batch"
LUA
wrk -t2 -c"$QUEUED" -d20s --timeout 30s -s "$WORK/batch.lua" "http://127.0.0.1:$GATE/v1/chat/completions" >/dev/null 2>&1 & WRK=$!; PIDS+=($WRK)
depth=0
for _ in $(seq 150); do
  depth=$(pool_depth)
  [ "$depth" -ge "$QUEUED" ] && break
  sleep 0.1
done
sleep 1
during=$(rss_kb "$GPID")
depth=$(pool_depth)
kill "$WRK" 2>/dev/null || true
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2

python3 - "$WORK/flood" "$before" "$during" "$depth" "${BENCH_RESULTS:-}" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
before, during, depth, out = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
by = {}
for r, t, rps, p50, p99, non2xx, total in rows:
    by.setdefault(t, []).append((float(rps), float(p50), float(p99), int(non2xx or 0), int(total)))
print("| refusing, 64 connections flat out | refusals/s (median) | vs nginx's fixed 429 | p50 ms | p99 ms | refused of sent |")
print("|---|---|---|---|---|---|")
g, n = by["gate"], by["nginx"]
ratio = st.median(a[0] / b[0] for a, b in zip(g, n))
for name, v, rt in (("slackgate: 429 projected_wait_exceeds_slack", g, f"{ratio:.2f}"), ("nginx: `return 429`", n, "1.00")):
    print(f"| {name} | {st.median(x[0] for x in v):.0f} | {rt} | {st.median(x[1] for x in v):.2f} | "
          f"{st.median(x[2] for x in v):.2f} | {sum(x[3] for x in v)} of {sum(x[4] for x in v)} |")
per = (during - before) * 1024 / max(depth, 1)
print()
print(f"memory per queued request: {per/1024:.1f} KiB ({depth} queued on as many connections; "
      f"RSS {before/1024:.1f} MiB idle, {during/1024:.1f} MiB with the queue)")
if out:
    open(out, "w").write(f"refusal {st.median(x[0] for x in g):.1f} {ratio:.2f} {st.median(x[2] for x in g):.3f}\n"
                         f"queued_kib {per/1024:.2f} {depth}\n")
PY
