# Shell helpers the benchmark scripts share (sourced, not run).

# A free loopback port.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }

# Wait up to 20 s for URL to answer 2xx.
wait_http() { for _ in $(seq 200); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done; echo "not up: $1" >&2; return 1; }

# A wrk latency ("812.00us", "1.65ms", "1.20s") in milliseconds.
ms() {
  python3 -c "import sys; v=sys.argv[1]; u=v.lstrip('0123456789.'); x=float(v[:len(v)-len(u)]); print(round(x*{'us':0.001,'ms':1,'s':1000,'m':60000}[u],3))" "$1"
}

# One wrk run: "req/s p50-ms p99-ms non-2xx requests" for LUA against URL, with CONNECTIONS
# and SECONDS.
wrk_run() { # url lua connections seconds
  local out
  out=$(wrk -t1 -c"$3" -d"${4}s" --latency -s "$2" "$1")
  echo "$(awk '/Requests\/sec/ {print $2}' <<<"$out") $(ms "$(awk '$1=="50%" {print $2}' <<<"$out")") $(ms "$(awk '$1=="99%" {print $2}' <<<"$out")") $(awk '/Non-2xx/ {print $5}' <<<"$out" | grep . || echo 0) $(awk '/requests in/ {print $1}' <<<"$out")"
}
