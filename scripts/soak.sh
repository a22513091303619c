#!/usr/bin/env bash
# Soak test (not in CI): the gate with its SQLite ledger in front of the stub, at twice the
# stub's capacity, for MINUTES. Every minute it prints the gate's resident memory, open file
# descriptors, ledger file size (database + WAL), tokens and holds still held, and the load's
# tallies; at the end it stops the load, waits for the gate to drain and prints the growth
# figures issue 17 asks for (RSS after the first 5 minutes, held back to 0, ledger size).
#
#   scripts/soak.sh MINUTES [RATE]
#
# The stub has 4 slots of 16 tokens x 10 ms (160 ms a request: 25 requests/s); the load is
# open-loop at RATE requests/s (default 50, twice that), each on a new connection; one in
# three carries its own idempotency key, one in ten is a reservation-API reserve + commit,
# and the rest let the gate generate keys. The ledger keeps settled keys 60 s
# (`ledger.retention_ms`) and prunes every 10 s, so its size levels off after a minute or two.
# SLACKGATE_BIN picks the binary (default: target/release/slackgate, built if absent).
# Everything listens on 127.0.0.1; every process it starts is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:?usage: scripts/soak.sh MINUTES [RATE]}
RATE=${2:-50}
BIN=${SLACKGATE_BIN:-target/release/slackgate}
if [ ! -x "$BIN" ]; then
  nice -n 19 cargo build --release -q -p slackgate
fi
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
wait_http() { for _ in $(seq 100); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "not up: $1" >&2; return 1; }

STUB=$(free_port)
GATE=$(free_port)
"$BIN" stub --listen "127.0.0.1:$STUB" --slots 4 --latency tokens:prefill_us=0,decode_us=10000 \
  --output-tokens 16 2>"$WORK/stub.err" &
PIDS+=($!)
cat >"$WORK/gate.toml" <<TOML
default_class = "interactive"
[server]
listen = "127.0.0.1:$GATE"
ledger = "$WORK/ledger.db"
ledger_prune_interval_ms = 10000
config_poll_ms = 0
[log]
path = "$WORK/decisions.jsonl"
max_bytes = 67108864
[ledger]
retention_ms = 60000
[[pools]]
name = "default"
slots = 4
upstream = "http://127.0.0.1:$STUB"
[pools.prior]
overhead_ms = 5
prefill_ms_per_token = 0
decode_ms_per_token = 10
[[classes]]
name = "interactive"
priority = 100
deadline_ms = 2000
[[classes]]
name = "batch"
priority = 10
deadline_ms = 20000
TOML
"$BIN" serve --config "$WORK/gate.toml" 2>"$WORK/gate.err" &
GATE_PID=$!
PIDS+=($GATE_PID)
wait_http "http://127.0.0.1:$GATE/healthz"

# The load: open loop at RATE/s for MINUTES, tallies by status into $WORK/tally.json.
cat >"$WORK/load.py" <<'PY'
import asyncio, json, sys, time, random
port, rate, seconds, out = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
tally = {}
async def request(path, body, headers):
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        data = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nhost: gate\r\ncontent-type: application/json\r\n" \
               f"content-length: {len(data)}\r\nconnection: close\r\n"
        for k, v in headers.items():
            head += f"{k}: {v}\r\n"
        w.write(head.encode() + b"\r\n" + data)
        await w.drain()
        resp = await asyncio.wait_for(r.read(), 60)
        w.close()
        status = resp.split(b" ", 2)[1].decode() if resp.startswith(b"HTTP/") else "bad"
        return status, resp.split(b"\r\n\r\n", 1)[-1]
    except Exception as e:
        return type(e).__name__, b""
def count(k):
    tally[k] = tally.get(k, 0) + 1
async def one(i):
    roll = i % 10
    if roll == 9:
        key = f"soak-r-{i}"
        s, _ = await request("/admission/v1/reserve", {"idempotency_key": key, "tokens": 200, "slack_ms": 5000}, {})
        count("reserve_" + s)
        if s == "202":
            await asyncio.sleep(0.05)
            s, _ = await request("/admission/v1/commit", {"idempotency_key": key, "tokens_spent": 150}, {})
            count("commit_" + s)
        return
    headers = {"authorization": f"Bearer sk-tenant-{i % 7}"}
    if roll % 3 == 0:
        headers["idempotency-key"] = f"soak-{i}"
    if roll in (1, 4):
        headers["x-job-class"] = "batch"
    body = {"model": "stub", "messages": [{"role": "user", "content": "hello " * random.randint(1, 50)}], "max_tokens": 16}
    s, _ = await request("/v1/chat/completions", body, headers)
    count(s)
async def main():
    start = time.monotonic()
    tasks = set()
    i = 0
    while time.monotonic() - start < seconds:
        due = start + i / rate
        now = time.monotonic()
        if due > now:
            await asyncio.sleep(due - now)
        t = asyncio.create_task(one(i))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        i += 1
        if i % int(rate) == 0:
            with open(out, "w") as f:
                json.dump(tally, f)
    await asyncio.gather(*tasks)
    with open(out, "w") as f:
        json.dump(tally, f)
asyncio.run(main())
PY
python3 "$WORK/load.py" "$GATE" "$RATE" "$((MINUTES * 60))" "$WORK/tally.json" &
LOAD_PID=$!
PIDS+=($LOAD_PID)

metric() { curl -sf "http://127.0.0.1:$GATE/metrics" | awk -v m="$1" '$1 == m { print $2; exit }'; }
rss_kb() { awk '/^VmRSS/ { print $2 }' "/proc/$GATE_PID/status"; }
fds() { ls "/proc/$GATE_PID/fd" | wc -l; }
ledger_bytes() { cat "$WORK"/ledger.db* 2>/dev/null | wc -c; }
db_bytes() { stat -c %s "$WORK/ledger.db" 2>/dev/null || echo 0; }
wal_bytes() { stat -c %s "$WORK/ledger.db-wal" 2>/dev/null || echo 0; }
sample() {
  printf '%-6s %10s %6s %12s %10s %10s %12s %6s %9s  %s\n' "$1" "$(rss_kb)" "$(fds)" "$(ledger_bytes)" \
    "$(db_bytes)" "$(wal_bytes)" \
    "$(metric slackgate_ledger_tokens_held)" "$(metric slackgate_ledger_holds)" \
    "$(metric slackgate_ledger_store_rows_pruned_total)" "$(cat "$WORK/tally.json" 2>/dev/null || echo '{}')"
}

echo "soak: $MINUTES min at $RATE req/s (stub capacity 25 req/s), gate pid $GATE_PID, binary $BIN"
printf '%-6s %10s %6s %12s %10s %10s %12s %6s %9s  %s\n' minute rss_kb fds ledger_bytes db_bytes wal_bytes \
  tokens_held holds pruned load
sample 0
RSS=()
LEDGER=()
for m in $(seq 1 "$MINUTES"); do
  sleep 60
  sample "$m"
  RSS+=("$(rss_kb)")
  LEDGER+=("$(ledger_bytes)")
done
wait "$LOAD_PID" 2>/dev/null || true
# Drain: nothing should stay held once the load stops (reservations commit, proxied holds
# settle with their responses).
for _ in $(seq 100); do
  [ "$(metric slackgate_ledger_tokens_held)" = "0" ] && break
  sleep 0.2
done
sample end
# One more pruning round, for the ledger's final size.
sleep 11
sample pruned
if [ "$MINUTES" -gt 5 ]; then
  python3 - "${RSS[4]}" "${RSS[-1]}" <<'PY'
import sys
a, b = int(sys.argv[1]), int(sys.argv[2])
print(f"RSS growth after minute 5: {a} kB -> {b} kB ({(b - a) / a * 100:+.2f}%)")
PY
  python3 - "${LEDGER[@]:4}" <<'PY'
import sys
sizes = [int(x) for x in sys.argv[1:]]
print(f"ledger (db + WAL) from minute 5: {sizes[0]} -> {sizes[-1]} bytes, largest {max(sizes)}, "
      f"smallest {min(sizes)} ({(sizes[-1] - sizes[0]) / sizes[0] * 100:+.2f}%)")
PY
fi
echo "held at the end: tokens $(metric slackgate_ledger_tokens_held), holds $(metric slackgate_ledger_holds); decision log lines dropped: $(metric slackgate_log_dropped_total)"
echo "connections closed by limits: $(curl -sf "http://127.0.0.1:$GATE/metrics" | awk '/^slackgate_connections_closed_total\{listener="proxy"/ { s += $2 } END { print s + 0 }')"
