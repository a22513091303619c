#!/usr/bin/env bash
# Render time of the /metrics page: an old build of the renderer against the working tree's,
# run alternately in one sitting (the machine's speed drifts; the ratio of neighbours does not).
#
#   scripts/bench-metrics-page.sh [OLD_REV] [ROUNDS]
#
# OLD_REV (default: the commit before the renderer moved to prometheus-client) is checked out
# in a temporary git worktree; both builds run `cargo bench --bench metrics_page` (the golden
# test's state, crates/gateway/benches/metrics_page.rs), ROUNDS times each (default 5),
# old then new. Prints every run, then per size the medians and new / old.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:-6b7a48f}
ROUNDS=${2:-5}
WORK=$(mktemp -d)
cleanup() { git worktree remove --force "$WORK/old" >/dev/null 2>&1 || true; rm -rf "$WORK"; }
trap cleanup EXIT

# The bench binary of the tree in $1, copied to $2.
build() {
  local exe
  exe=$(cd "$1" && cargo bench --locked -q -p slackgate-gateway --bench metrics_page --no-run \
    --message-format=json 2>/dev/null | python3 -c '
import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "metrics_page" and m.get("executable"):
        print(m["executable"])')
  cp "$exe" "$2"
}

git worktree add -q --detach "$WORK/old" "$OLD"
echo "bench-metrics-page: building $OLD and the working tree" >&2
build "$WORK/old" "$WORK/bench-old"
build . "$WORK/bench-new"

for r in $(seq "$ROUNDS"); do
  for which in old new; do
    "$WORK/bench-$which" | sed "s/^/$which round$r /" | tee -a "$WORK/runs"
  done
done

python3 - "$WORK/runs" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    which, _, _, size, us, lines = line.split()
    runs.setdefault(size, {}).setdefault(which, []).append((float(us), int(lines)))
for size, by in runs.items():
    old = statistics.median(u for u, _ in by["old"])
    new = statistics.median(u for u, _ in by["new"])
    print(f"{size}: old {old:.1f} us/page ({by['old'][0][1]} lines), "
          f"new {new:.1f} us/page ({by['new'][0][1]} lines), new/old {new / old:.2f}")
EOF
