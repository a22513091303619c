#!/usr/bin/env bash
# The performance regression guard (CI runs it after the tests): a short run of ratios, no
# absolute times, compared with the committed baseline in perf/baseline.txt.
#
#   - proxy/<target>_vs_nginx: the gate's throughput against nginx (with its JSON access log)
#     in the same sitting (scripts/bench-proxy.sh, 3 rounds of 3 s, alternated);
#   - decision/<case>: a decision case's speed against a fixed reference workload run
#     interleaved with it (cargo bench -p slackgate-core --bench guard).
#
# A figure under GUARD_FLOOR (0.8) x its baseline fails; the whole run is repeated once before
# failing, so a noisy minute on a shared machine does not block a landing. Higher is faster
# for every figure.
#
#   scripts/perf-guard.sh                    # measure and compare (exit 1 on a regression)
#   scripts/perf-guard.sh --write-baseline   # measure three times, write the medians
#   GUARD_FEATURES=perf-slowdown scripts/perf-guard.sh   # a deliberately slowed build: fails
set -euo pipefail
cd "$(dirname "$0")/.."
FLOOR=${GUARD_FLOOR:-0.8}
BASELINE=perf/baseline.txt
FEATURES=${GUARD_FEATURES:-}
started=$(date +%s)
feat=()
if [ -n "$FEATURES" ]; then feat=(--features "$FEATURES"); fi

echo "perf-guard: building release${FEATURES:+ with --features $FEATURES}" >&2
cargo build --release --locked -q -p slackgate "${feat[@]}"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
BIN="$WORK/slackgate"
cp target/release/slackgate "$BIN"
core_feat=()
if [ -n "$FEATURES" ]; then core_feat=(--features "$FEATURES"); fi
# Build the decision bench now, so its compile time is not inside a measurement.
cargo bench --locked -q -p slackgate-core --bench guard "${core_feat[@]}" --no-run >/dev/null 2>&1

measure() { # out-file
  local out=$1 proxy="$WORK/proxy"
  ROUNDS=3 TARGETS="nginx sqlite memory" SLACKGATE_BIN="$BIN" BENCH_RESULTS="$proxy" LIVE=0 \
    scripts/bench-proxy.sh 3 32 >/dev/null 2>"$WORK/proxy.err" || { cat "$WORK/proxy.err" >&2; return 1; }
  : > "$out"
  awk '$1=="sqlite" || $1=="memory" {print "proxy/" $1 "_vs_nginx", $4}' "$proxy" >> "$out"
  cargo bench --locked -q -p slackgate-core --bench guard "${core_feat[@]}" 2>/dev/null \
    | awk '$1=="guard" {print $2, $3}' >> "$out"
  echo "load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
}

if [ "${1:-}" = --write-baseline ]; then
  for i in 1 2 3; do measure "$WORK/m$i"; done
  mkdir -p perf
  {
    echo "# The regression guard's baseline (scripts/perf-guard.sh): medians of three runs, higher is"
    echo "# faster. Measured $(date -u +%Y-%m-%d) at $(git rev-parse --short HEAD) on $(nproc) cores,"
    echo "# load average $(cut -d' ' -f1-3 /proc/loadavg) after the runs. Re-measure (--write-baseline)"
    echo "# when a change makes a path faster on purpose, and say so in BENCHMARKS.md."
    python3 - "$WORK"/m1 "$WORK"/m2 "$WORK"/m3 <<'PY'
import sys, statistics as st
runs = [dict(l.split() for l in open(f) if l.strip()) for f in sys.argv[1:]]
for k in runs[0]:
    print(k, f"{st.median(float(r[k]) for r in runs):.4f}")
PY
  } > "$BASELINE"
  cat "$BASELINE"
  exit 0
fi

[ -f "$BASELINE" ] || { echo "perf-guard: no $BASELINE (run with --write-baseline)" >&2; exit 2; }
compare() { # measured-file -> prints a table, exits 1 if any figure is under the floor
  python3 - "$BASELINE" "$1" "$FLOOR" <<'PY'
import sys
base = dict(l.split()[:2] for l in open(sys.argv[1]) if l.strip() and not l.startswith("#"))
got = dict(l.split()[:2] for l in open(sys.argv[2]) if l.strip())
floor = float(sys.argv[3])
bad = []
print(f"{'figure':40} {'baseline':>9} {'now':>9} {'ratio':>7}")
for k, b in base.items():
    if k not in got:
        print(f"{k:40} {float(b):9.3f} {'missing':>9}"); bad.append(k); continue
    r = float(got[k]) / float(b)
    flag = "  <- under the floor" if r < floor else ""
    print(f"{k:40} {float(b):9.3f} {float(got[k]):9.3f} {r:7.2f}{flag}")
    if r < floor: bad.append(k)
sys.exit(1 if bad else 0)
PY
}
measure "$WORK/run1"
if compare "$WORK/run1"; then
  echo "perf-guard: ok (floor ${FLOOR}x of the baseline; $(( $(date +%s) - started )) s)"
  exit 0
fi
echo "perf-guard: under the floor once; measuring again before failing" >&2
measure "$WORK/run2"
if compare "$WORK/run2"; then
  echo "perf-guard: ok on the rerun (floor ${FLOOR}x of the baseline; $(( $(date +%s) - started )) s)"
  exit 0
fi
echo "perf-guard: FAILED: under ${FLOOR}x of the baseline twice ($(( $(date +%s) - started )) s)" >&2
exit 1
