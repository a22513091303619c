#!/usr/bin/env bash
# End-to-end overhead of the gate, side by side in one sitting: the same load (wrk, POST chat
# completions, keep-alive) against the stub directly, through nginx (a plain reverse proxy,
# buffering off, writing a JSON access log of one line per request, as the gate writes its
# decision log) and through slackgate: with its default durable SQLite ledger, with
# `ledger = "memory"`, and (when redis-server is installed) as a cluster follower forwarding
# to its leader on a shared Redis. Every request through slackgate is admitted, dispatched,
# logged and holds its tokens in the ledger.
#
# Everything on 127.0.0.1, bounded in time. The targets run in turn, ROUNDS times (alternated,
# so a noisy minute hits every target alike); the table gives each target's median and its
# throughput against direct and against nginx as the median of the per-round ratios. On this
# shared 2-core machine wrk, the proxy and the stub compete for cores: compare the ratios, not
# the absolutes.
#
#   scripts/bench-proxy.sh [SECONDS] [CONNECTIONS]
#
# Environment:
#   ROUNDS=3            rounds of every target (default 1)
#   SLACKGATE_BIN=PATH  a prebuilt slackgate binary (default: cargo build --release here)
#   STUB_BIN=PATH       the binary whose `stub` is the upstream (default: SLACKGATE_BIN); fixed
#                       when comparing binaries of several commits
#   TARGETS="direct nginx sqlite memory follower"   which targets (this default order; also
#                       sqlite_full: the SQLite ledger with server.ledger_synchronous = "full")
#   BENCH_RESULTS=FILE  also write one line per target: `name rps_median vs_direct vs_nginx p99_ms`
#   LIVE=0              skip scripts/bench-live.sh, run at the end: the live page's stream with
#                       SUBS=100 subscribers against none, same sitting, and the CPU per subscriber
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-8}
CONNS=${2:-32}
ROUNDS=${ROUNDS:-1}
TARGETS=${TARGETS:-direct nginx sqlite memory follower}
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
command -v nginx >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null; }
if [ -n "${SLACKGATE_BIN:-}" ]; then
  BIN=$SLACKGATE_BIN
else
  cargo build --release -q -p slackgate
  BIN=target/release/slackgate
fi
if [[ " $TARGETS " == *" follower "* ]] && ! command -v redis-server >/dev/null; then
  echo "bench-proxy: no redis-server: the cluster follower is left out" >&2
  TARGETS=${TARGETS/follower/}
fi
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

. scripts/bench-lib.sh

STUB=$(free_port)
${STUB_BIN:-$BIN} stub --listen 127.0.0.1:$STUB --slots 1024 --latency fixed:0ms --output-tokens 16 2>/dev/null & PIDS+=($!)
wait_http "http://127.0.0.1:$STUB/health"

# One gate config; `max_in_flight` (the old name of `slots`, still read) so that binaries of
# older commits run the same file (the bisection in BENCHMARKS.md).
gate_config() { # port ledger log [extra]
  cat <<TOML
[server]
listen = "127.0.0.1:$1"
ledger = "$2"
[log]
path = "$3"
[[pools]]
name = "default"
max_in_flight = 1024
upstream = "http://127.0.0.1:$STUB"
[pools.prior]
overhead_ms = 1
decode_ms_per_token = 0.01
[[classes]]
name = "interactive"
deadline_ms = 30000
${4:-}
TOML
}

declare -A URL
URL[direct]="http://127.0.0.1:$STUB"
for t in $TARGETS; do
  case $t in
    direct) ;;
    nginx)
      NGX=$(free_port)
      cat > "$WORK/nginx.conf" <<NGINX
worker_processes 1;
daemon off;
pid $WORK/nginx.pid;
error_log $WORK/nginx.err;
events { worker_connections 4096; }
http {
  log_format json escape=json '{"time":"\$time_iso8601","remote":"\$remote_addr","method":"\$request_method","uri":"\$request_uri","status":\$status,"bytes":\$body_bytes_sent,"request_time":\$request_time,"upstream_time":"\$upstream_response_time"}';
  access_log $WORK/nginx-access.jsonl json;
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
      URL[nginx]="http://127.0.0.1:$NGX"; wait_http "${URL[nginx]}/health" ;;
    sqlite)
      P=$(free_port); gate_config "$P" "$WORK/ledger.db" "$WORK/decisions.jsonl" > "$WORK/gate.toml"
      $BIN serve --config "$WORK/gate.toml" 2>/dev/null & PIDS+=($!)
      URL[sqlite]="http://127.0.0.1:$P"; wait_http "${URL[sqlite]}/healthz" ;;
    sqlite_full)
      # The SQLite ledger syncing the log at every commit (survives power loss too).
      P=$(free_port); gate_config "$P" "$WORK/ledger-full.db" "$WORK/decisions-full.jsonl" > "$WORK/gate-full.toml"
      sed -i 's|^ledger = .*|&\nledger_synchronous = "full"|' "$WORK/gate-full.toml"
      $BIN serve --config "$WORK/gate-full.toml" 2>/dev/null & PIDS+=($!)
      URL[sqlite_full]="http://127.0.0.1:$P"; wait_http "${URL[sqlite_full]}/healthz" ;;
    memory)
      P=$(free_port); gate_config "$P" memory "$WORK/decisions-mem.jsonl" > "$WORK/gate-mem.toml"
      $BIN serve --config "$WORK/gate-mem.toml" 2>/dev/null & PIDS+=($!)
      URL[memory]="http://127.0.0.1:$P"; wait_http "${URL[memory]}/healthz" ;;
    follower)
      RP=$(free_port)
      redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
        >"$WORK/redis.log" 2>&1 & PIDS+=($!)
      for _ in $(seq 100); do redis-cli -p "$RP" ping >/dev/null 2>&1 && break; sleep 0.1; done
      for role in leader follower; do
        P=$(free_port)
        gate_config "$P" memory "$WORK/decisions-$role.jsonl" "[cluster]
redis = \"redis://127.0.0.1:$RP\"
name = \"bench\"
replica_id = \"$role\"
advertise = \"http://127.0.0.1:$P\"" > "$WORK/gate-$role.toml"
        $BIN serve --config "$WORK/gate-$role.toml" 2>/dev/null & PIDS+=($!)
        URL[$role]="http://127.0.0.1:$P"; wait_http "${URL[$role]}/healthz"
        if [ "$role" = leader ]; then
          for _ in $(seq 200); do
            curl -s "${URL[leader]}/stats" | grep -q '"role": *"leader"' && break; sleep 0.1
          done
        fi
      done ;;
    *) echo "bench-proxy: unknown target $t" >&2; exit 2 ;;
  esac
done

cat > "$WORK/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"model":"stub","messages":[{"role":"user","content":"hello there"}],"max_tokens":16}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["X-Job-Class"] = "interactive"
LUA

run() { # name url -> "rps p50ms p99ms non2xx"
  wrk_run "$2/v1/chat/completions" "$WORK/post.lua" "$CONNS" "$DUR" | cut -d' ' -f1-4
}
echo "wrk -t1 -c$CONNS -d${DUR}s, POST /v1/chat/completions, stub latency 0 ms, $(nproc) cores," \
  "$ROUNDS round(s), $(git rev-parse --short HEAD 2>/dev/null || echo '?'), binary $BIN" >&2
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
RES="$WORK/results"
: > "$RES"
for r in $(seq "$ROUNDS"); do
  for t in $TARGETS; do
    echo "$r $t $(run "$t" "${URL[$t]}")" >> "$RES"
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
python3 - "$RES" "$TARGETS" "${BENCH_RESULTS:-}" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
targets = sys.argv[2].split()
out = sys.argv[3]
by = {}
for r, t, rps, p50, p99, n in rows:
    by.setdefault(t, {})[int(r)] = (float(rps), float(p50), float(p99), int(n))
names = {"direct": "direct", "nginx": "nginx (JSON access log)", "sqlite": "slackgate (SQLite ledger)",
         "sqlite_full": "slackgate (SQLite ledger, synchronous = full)",
         "memory": "slackgate (memory ledger)", "follower": "slackgate cluster follower (memory, Redis)"}
def ratio(t, base):
    if base not in by: return None
    return st.median(by[t][r][0] / by[base][r][0] for r in by[t] if r in by[base])
print("| target | req/s (median) | vs direct | vs nginx | p50 ms | p99 ms | non-2xx |")
print("|---|---|---|---|---|---|---|")
lines = []
for t in targets:
    v = list(by[t].values())
    rps = st.median(x[0] for x in v); p50 = st.median(x[1] for x in v); p99 = st.median(x[2] for x in v)
    n = sum(x[3] for x in v)
    vd, vn = ratio(t, "direct"), ratio(t, "nginx")
    f = lambda x: "" if x is None else f"{x:.2f}"
    print(f"| {names[t]} | {rps:.0f} | {f(vd)} | {f(vn)} | {p50:.2f} | {p99:.2f} | {n} |")
    lines.append(f"{t} {rps:.1f} {f(vd) or '-'} {f(vn) or '-'} {p99:.3f}")
if len(next(iter(by.values()))) > 1:
    print()
    print("per round (req/s): " + "; ".join(
        f"{t} " + " / ".join(f"{by[t][r][0]:.0f}" for r in sorted(by[t])) for t in targets))
if out:
    open(out, "w").write("\n".join(lines) + "\n")
PY
if [ -f "$WORK/decisions.jsonl" ]; then
  echo
  echo "slackgate (SQLite) wrote $(wc -l < "$WORK/decisions.jsonl") decision-log lines (admit + dispatch + complete" \
    "per request); nginx wrote $(wc -l < "$WORK/nginx-access.jsonl" 2>/dev/null || echo 0) access-log lines."
fi

# The live page's stream (/live/stream on the admin listener): 100 subscribers against none.
if [ "${LIVE:-1}" = 1 ]; then
  echo
  SLACKGATE_BIN=$BIN ROUNDS=$ROUNDS scripts/bench-live.sh "$DUR" "$CONNS"
fi
