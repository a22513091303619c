#!/usr/bin/env bash
# Starts or stops a real llama.cpp `llama-server` on 127.0.0.1 for the real-server tests and
# measurements.
#
#   scripts/real-server.sh start    # prints the server's URL (http://127.0.0.1:PORT)
#   scripts/real-server.sh stop     # stops the server that `start` started, by its PID
#
# `start` builds the server (scripts/llama-server.sh, cached), writes the random-weight model
# (scripts/make-model.py in .venv, cached), picks a free port and runs
#   llama-server -m MODEL -t 1 --parallel 4 --metrics -c 10240 --host 127.0.0.1 --port PORT
# i.e. 4 slots of 2560 tokens each (prompts up to ~2000 tokens plus their output). `-t 1`
# because on these 2-core machines the default 2 threads slow down about 100x as soon as
# anything else wants a core. It waits (at most SLACKGATE_LLAMA_START_S, default 120 s) for
# /health to answer 200, then records the PID and URL in the state file and prints the URL.
# If a server from an earlier `start` is still alive, its URL is printed and nothing starts.
#
# Environment: SLACKGATE_LLAMA_STATE (state file; default target/real-server.state in this
# checkout, so checkouts do not share servers), SLACKGATE_LLAMA_PARALLEL (slots, 4),
# SLACKGATE_LLAMA_CTX (total context, 10240), SLACKGATE_CACHE (where the build and the model
# are cached). The server's own log goes beside the state file (real-server.log).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
state="${SLACKGATE_LLAMA_STATE:-$root/target/real-server.state}"
log="$(dirname "$state")/real-server.log"
parallel="${SLACKGATE_LLAMA_PARALLEL:-4}"
ctx="${SLACKGATE_LLAMA_CTX:-10240}"
start_s="${SLACKGATE_LLAMA_START_S:-120}"

# The PID in the state file, if that process is still alive.
live_pid() {
    [ -f "$state" ] || return 1
    local pid
    pid="$(sed -n 's/^pid=//p' "$state")"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

health() {
    curl -fsS -m 2 -o /dev/null "$1/health" 2>/dev/null
}

start() {
    if pid="$(live_pid)"; then
        url="$(sed -n 's/^url=//p' "$state")"
        if health "$url"; then
            echo "real-server: already running (pid $pid) at $url" >&2
            echo "$url"
            return 0
        fi
    fi
    mkdir -p "$(dirname "$state")"
    local bin model python
    bin="$("$root/scripts/llama-server.sh")"
    python="$("$root/scripts/venv.sh")"
    model="$("$python" "$root/scripts/make-model.py")"

    # A port the kernel just handed out and released; another process could take it before
    # llama-server binds it, so a failed start is tried again on a new port.
    local attempt port pid url waited
    for attempt in 1 2 3; do
        port="$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
        url="http://127.0.0.1:$port"
        echo "real-server: starting $bin on $url (attempt $attempt, log $log)" >&2
        "$bin" -m "$model" -t 1 --parallel "$parallel" --metrics -c "$ctx" \
            --host 127.0.0.1 --port "$port" >"$log" 2>&1 </dev/null &
        pid=$!
        printf 'pid=%s\nurl=%s\n' "$pid" "$url" >"$state"
        waited=0
        while [ "$waited" -lt $((start_s * 5)) ]; do
            if ! kill -0 "$pid" 2>/dev/null; then
                echo "real-server: llama-server exited during start; its log:" >&2
                tail -n 20 "$log" >&2
                break
            fi
            if health "$url"; then
                echo "real-server: ready in $((waited / 5)) s (pid $pid)" >&2
                echo "$url"
                return 0
            fi
            sleep 0.2
            waited=$((waited + 1))
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "real-server: no healthy /health within ${start_s} s; stopping pid $pid" >&2
            kill "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
            rm -f "$state"
            return 1
        fi
        rm -f "$state"
    done
    echo "real-server: could not start llama-server" >&2
    return 1
}

stop() {
    local pid
    if pid="$(live_pid)"; then
        kill "$pid" 2>/dev/null || true
        # Bounded: a server that ignores SIGTERM for 10 s is killed.
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        if kill -0 "$pid" 2>/dev/null; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
        echo "real-server: stopped pid $pid" >&2
    fi
    rm -f "$state"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *)
        echo "usage: scripts/real-server.sh start|stop" >&2
        exit 2
        ;;
esac
