#!/usr/bin/env bash
# What the live page's stream costs the gate: one gate (memory ledger, frames once a second),
# in the same sitting, with no stream subscriber and with SUBS of them (scripts/live-
# subscribers.py: a small asyncio client reading /live/stream, not browsers), alternated
# ROUNDS times:
#   - idle (no proxy traffic): the gate's CPU time over SECONDS (utime + stime from
#     /proc/PID/stat), hence the CPU per subscriber;
#   - under load (wrk, POST chat completions as scripts/bench-proxy.sh sends them): req/s and
#     p99, and the gate's CPU per request.
# Everything on 127.0.0.1, bounded in time; only the processes started here are stopped, by PID.
#
#   scripts/bench-live.sh [SECONDS] [CONNECTIONS]      (called by scripts/bench-proxy.sh)
#
# Environment: SUBS=100, ROUNDS=3, SLACKGATE_BIN=PATH (default: cargo build --release here).
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-8}
CONNS=${2:-32}
SUBS=${SUBS:-100}
ROUNDS=${ROUNDS:-3}
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
if [ -n "${SLACKGATE_BIN:-}" ]; then
  BIN=$SLACKGATE_BIN
else
  cargo build --release -q -p slackgate
  BIN=target/release/slackgate
fi
WORK=$(mktemp -d)
PIDS=()
SUB_PID=""
cleanup() {
  if [ -n "$SUB_PID" ]; then kill "$SUB_PID" 2>/dev/null || true; fi
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

. scripts/bench-lib.sh

STUB=$(free_port)
$BIN stub --listen 127.0.0.1:$STUB --slots 1024 --latency fixed:0ms --output-tokens 16 2>/dev/null & PIDS+=($!)
wait_http "http://127.0.0.1:$STUB/health"
P=$(free_port)
A=$(free_port)
TOKEN=bench-live-token
echo "$TOKEN" > "$WORK/token"
cat > "$WORK/gate.toml" <<TOML
[server]
listen = "127.0.0.1:$P"
ledger = "memory"
[log]
path = "$WORK/decisions.jsonl"
[admin]
listen = "127.0.0.1:$A"
token_file = "$WORK/token"
max_connections = $((SUBS + 16))
max_connections_per_addr = $((SUBS + 16))
live_max_subscribers = $((SUBS + 8))
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
$BIN serve --config "$WORK/gate.toml" 2>/dev/null & GATE=$!; PIDS+=($GATE)
wait_http "http://127.0.0.1:$P/healthz"

cat > "$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"model":"stub","messages":[{"role":"user","content":"hello there"}],"max_tokens":16}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-Job-Class"] = "interactive"
LUA

TICK=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$GATE/stat"; }
subscribe() { # n
  python3 scripts/live-subscribers.py "127.0.0.1:$A" "$TOKEN" "$1" > "$WORK/subs.out" & SUB_PID=$!
  # Let every stream open and take its backlog (the frames kept) before measuring.
  sleep 3
}
unsubscribe() {
  if [ -n "$SUB_PID" ]; then kill "$SUB_PID" 2>/dev/null || true; wait "$SUB_PID" 2>/dev/null || true; fi
  SUB_PID=""
  cat "$WORK/subs.out" >&2
}
phase() { # round subs kind
  local c0 c1 line=""
  c0=$(cpu_ticks)
  if [ "$3" = idle ]; then
    sleep "$DUR"
  else
    line=$(wrk_run "http://127.0.0.1:$P/v1/chat/completions" "$WORK/post.lua" "$CONNS" "$DUR")
  fi
  c1=$(cpu_ticks)
  echo "$1 $2 $3 $(( c1 - c0 )) ${line:-0 0 0 0 0}" >> "$WORK/results"
}
echo "bench-live: $SUBS subscribers against none, ${DUR}s phases, $ROUNDS round(s), wrk -t1 -c$CONNS," \
  "$(nproc) cores, $(git rev-parse --short HEAD 2>/dev/null || echo '?'), binary $BIN" >&2
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
: > "$WORK/results"
for r in $(seq "$ROUNDS"); do
  phase "$r" 0 idle
  phase "$r" 0 load
  subscribe "$SUBS"
  phase "$r" "$SUBS" idle
  phase "$r" "$SUBS" load
  unsubscribe
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
python3 - "$WORK/results" "$TICK" "$DUR" "$SUBS" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
tick, dur, subs = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
by = {}
for r, n, kind, ticks, rps, p50, p99, non2xx, reqs in rows:
    by.setdefault((int(n), kind), []).append((int(ticks) / tick, float(rps), float(p99), int(reqs)))
def med(key, i): return st.median(x[i] for x in by[key])
idle0, idleN = med((0, "idle"), 0), med((subs, "idle"), 0)
print(f"| subscribers | idle gate CPU (% of a core) | req/s under load (median) | p99 ms | gate CPU per 1k requests (ms) |")
print("|---|---|---|---|---|")
for n in (0, subs):
    cpu = med((n, "idle"), 0) / dur * 100
    load = by[(n, "load")]
    per_k = st.median(x[0] / x[3] * 1000 * 1000 for x in load if x[3])
    print(f"| {n} | {cpu:.2f} | {med((n, 'load'), 1):.0f} | {med((n, 'load'), 2):.2f} | {per_k:.1f} |")
ratio = st.median(b[1] / a[1] for a, b in zip(by[(0, "load")], by[(subs, "load")]))
print()
print(f"CPU per subscriber (idle gate, frames once a second): {(idleN - idle0) / dur / subs * 1000:.3f} ms"
      f" of CPU per second ({(idleN - idle0) / dur / subs * 100:.4f} % of a core)")
print(f"req/s with {subs} subscribers against none (median of per-round ratios): {ratio:.3f}")
print("per round (req/s, 0 / " + str(subs) + "): " + "; ".join(
    f"{a[1]:.0f} / {b[1]:.0f}" for a, b in zip(by[(0, "load")], by[(subs, "load")])))
PY
