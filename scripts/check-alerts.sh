#!/usr/bin/env bash
# Validates the shipped Prometheus alert rules and runs their unit tests:
#   promtool check rules deploy/prometheus/alerts.yml
#   promtool test rules  tests/prometheus/alerts_test.yml
# promtool comes from Debian's `prometheus` package: installed with apt-get when missing and
# running as root, otherwise this fails and says what to install. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

rules="deploy/prometheus/alerts.yml"
tests="tests/prometheus/alerts_test.yml"

if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "check-alerts.sh: installing Debian's prometheus package (for promtool)" >&2
    apt-get update -qq && apt-get install -y -qq prometheus >/dev/null
  fi
fi
if ! command -v promtool >/dev/null 2>&1; then
  echo "check-alerts.sh: promtool not found and cannot install it (need root and apt-get):" >&2
  echo "  apt-get install prometheus   # Debian/Ubuntu; or put promtool on PATH" >&2
  exit 1
fi

echo "== promtool check rules $rules"
promtool check rules "$rules"

echo "== promtool test rules $tests"
promtool test rules "$tests"

alerts=$(grep -c '^ *- alert:' "$rules")
cases=$(grep -c '^ *alertname:' "$tests")
echo "check-alerts.sh: ok: $alerts alerts valid, $cases alert test cases pass ($(promtool --version 2>&1 | head -n1))"
