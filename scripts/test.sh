#!/usr/bin/env bash
# Runs every test slackgate has: the Rust workspace (unit, property and integration tests over
# real sockets), then the Python suite that drives the gate with the official openai SDK and
# curl. Installs what the Python suite needs into .venv on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v curl >/dev/null 2>&1; then
  echo "test.sh: installing curl (needed by the streaming test)" >&2
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq curl >/dev/null
  else
    echo "test.sh: curl is missing and I am not root: install curl" >&2
    exit 1
  fi
fi

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  echo "test.sh: installing Debian's prometheus package (promtool lints /metrics and the alert" \
    "rules; the prometheus server scrapes a live gate in crates/gateway/tests/prometheus_scrape.rs)" >&2
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq prometheus >/dev/null
  else
    echo "test.sh: promtool/prometheus missing and I am not root: apt-get install prometheus" >&2
    exit 1
  fi
fi

# The real production trace the simulator's tests replay lives beside the repository, not in
# it (users bring their own). Point at it when this checkout is elsewhere; tests that need it
# fail loudly when it cannot be found.
if [ -z "${SLACKGATE_TRACES:-}" ]; then
  for d in "$PWD/../shared/traces" /work/shared/traces; do
    if [ -f "$d/azure_llm_2023_code.csv" ]; then
      export SLACKGATE_TRACES="$(cd "$d" && pwd)"
      break
    fi
  done
fi
echo "test.sh: traces from ${SLACKGATE_TRACES:-<relative to scenarios/>}" >&2

echo "== cargo test --workspace"
cargo test --workspace --locked

echo "== alert rules: promtool check rules + test rules"
scripts/check-alerts.sh

echo "== python: openai SDK and curl against a live gate"
scripts/test-python.sh
