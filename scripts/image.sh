#!/usr/bin/env bash
# Builds the slackgate container image (deploy/Containerfile, final stage FROM scratch) from
# the release binary built on this host, then runs the image's own files and checks them:
# the stub and the gate, each in a container of the image (`buildah run --isolation chroot`,
# as podman run does not work on these machines), /healthz and /readyz answered, a chat
# completion passed through the gate to the stub, the ledger written as the non-root user in
# the image's /var/lib/slackgate. Every wait is bounded; the containers it made are removed
# however it ends (the image stays, tagged $SLACKGATE_IMAGE, slackgate:dev by default).
#
#   scripts/image.sh            build and test (installs Debian's buildah when missing, as root)
#
# Storage: buildah's vfs driver (no overlay mounts needed). About 20 s on 2 cores once the
# release binary is built (scripts/test.sh builds it before calling this).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$(date +%s)
image="${SLACKGATE_IMAGE:-localhost/slackgate:dev}"

if ! command -v buildah >/dev/null 2>&1; then
  echo "image.sh: installing Debian's buildah package" >&2
  if [ "$(id -u)" = 0 ]; then
    # The package brings /etc/containers/policy.json; never write one before it (dpkg would
    # stop to ask about the conffile).
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah >/dev/null
  else
    echo "image.sh: buildah is missing and I am not root: apt-get install buildah" >&2
    exit 1
  fi
fi
bh() { buildah --storage-driver vfs "$@"; }

# The release binary: cargo rebuilds only what changed (a no-op after scripts/test-python.sh).
cargo build --release --locked --quiet -p slackgate
target_dir="${CARGO_TARGET_DIR:-target}"
case "$target_dir" in /*) ;; *) target_dir="$root/$target_dir" ;; esac
bin="$target_dir/release/slackgate"

work="$(mktemp -d "${TMPDIR:-/tmp}/slackgate-image.XXXXXX")"
containers=()
pids=()
cleanup() {
  status=$?
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  for c in "${containers[@]}"; do
    bh umount "$c" >/dev/null 2>&1 || true
    bh rm "$c" >/dev/null 2>&1 || true
  done
  if [ "$status" != 0 ]; then
    for f in "$work"/*.log; do
      [ -f "$f" ] && { echo "--- $f"; tail -20 "$f"; }
    done
  fi
  rm -rf "$work"
  echo "image.sh: took $(( $(date +%s) - started )) s"
  exit "$status"
}
trap cleanup EXIT

echo "image.sh: staging $bin and what it links (ldd)"
scripts/image-rootfs.sh "$bin" "$work/context/image"
# The staged directory stands in for the builder stage: nothing is pulled or compiled. The
# image this tag named before is removed afterwards (vfs keeps a full copy of each).
previous=$(bh images --quiet --no-trunc "$image" 2>/dev/null | head -1 || true)
bh bud --quiet --build-context "builder=$work/context" -f deploy/Containerfile -t "$image" \
  "$work/context" >/dev/null
current=$(bh images --quiet --no-trunc "$image" | head -1)
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
  bh rmi "$previous" >/dev/null 2>&1 || true
fi
size=$(bh images --format '{{.Size}}' "$image" | head -1)
echo "image.sh: built $image ($size)"

fail() { echo "image.sh: FAILED: $*" >&2; exit 1; }
user=$(bh inspect --type image --format '{{.OCIv1.Config.User}}' "$image")
[ "$user" = "65532:65532" ] || fail "image user is '$user', not 65532:65532"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
stub_port=$(free_port)
gate_port=$(free_port)

# Two containers of the same image: the fake model and the gate in front of it.
stub_c=$(bh from --quiet --name "slackgate-image-stub-$$" "$image"); containers+=("$stub_c")
gate_c=$(bh from --quiet --name "slackgate-image-gate-$$" "$image"); containers+=("$gate_c")
# buildah itself in the background (not through `bh`, a function: $! would be a subshell,
# and a signal to it would not reach buildah or what it runs).
buildah --storage-driver vfs run --isolation chroot "$stub_c" -- /usr/local/bin/slackgate stub \
  --listen "127.0.0.1:$stub_port" --slots 2 --latency fixed:5ms >"$work/stub.log" 2>&1 &
pids+=($!)
buildah --storage-driver vfs run --isolation chroot "$gate_c" -- /usr/local/bin/slackgate serve \
  --listen "127.0.0.1:$gate_port" --upstream "http://127.0.0.1:$stub_port" --slots 2 \
  --log "/var/lib/slackgate/decisions.jsonl" >"$work/gate.log" 2>&1 &
pids+=($!)

gate="http://127.0.0.1:$gate_port"
for _ in $(seq 1 150); do
  curl -fsS --max-time 1 "$gate/healthz" >/dev/null 2>&1 && break
  sleep 0.2
done
health=$(curl -sS --max-time 5 -w ' %{http_code}' "$gate/healthz") || fail "/healthz: no answer"
[ "$health" = "ok
 200" ] || fail "/healthz answered: $health"
ready=$(curl -sS --max-time 5 -w ' %{http_code}' "$gate/readyz") || fail "/readyz: no answer"
case "$ready" in "ready: single gate"*200) ;; *) fail "/readyz answered: $ready" ;; esac
echo "image.sh: /healthz 200 ok, /readyz 200 ready: single gate"

answer=$(curl -sS --max-time 10 -w '\n%{http_code}' "$gate/v1/chat/completions" \
  -H 'content-type: application/json' -H 'x-job-class: interactive' -H 'x-deadline-ms: 5000' \
  -d '{"model":"demo","messages":[{"role":"user","content":"hi"}],"max_tokens":4}') \
  || fail "chat completion: no answer"
code=$(printf '%s' "$answer" | tail -1)
[ "$code" = 200 ] || fail "chat completion answered $code: $answer"
printf '%s' "$answer" | grep -q '"id":"chatcmpl-stub-' || fail "not the stub's answer: $answer"
echo "image.sh: POST /v1/chat/completions through the gate to the stub: 200 ($(printf '%s' "$answer" | head -1 | cut -c1-80)...)"

# Stop the gate as Kubernetes would, with SIGTERM to the gate itself: `buildah run` answers
# its own SIGTERM by killing the process (SIGKILL), so the signal goes to the slackgate
# process it started (found by walking down from its PID), which drains and stops.
gate_pid=""
walk="${pids[1]}"
for _ in 1 2 3 4 5 6; do
  walk=$(ps -o pid= --ppid "$walk" | head -1 | tr -d ' ')
  [ -n "$walk" ] || break
  if [ "$(ps -o comm= -p "$walk")" = slackgate ]; then gate_pid="$walk"; break; fi
done
[ -n "$gate_pid" ] || fail "cannot find the gate's process under buildah run (PID ${pids[1]})"
kill -TERM "$gate_pid"
for _ in $(seq 1 100); do kill -0 "${pids[1]}" 2>/dev/null || break; sleep 0.1; done
kill -0 "${pids[1]}" 2>/dev/null && fail "the gate did not stop within 10 s of SIGTERM"
grep -q 'slackgate: stopped' "$work/gate.log" || fail "the gate did not drain and stop cleanly"
mnt=$(bh mount "$gate_c")
owner=$(stat -c '%u' "$mnt/var/lib/slackgate/slackgate-ledger.db") \
  || fail "no SQLite ledger in /var/lib/slackgate"
[ "$owner" = 65532 ] || fail "the ledger belongs to uid $owner, not 65532"
grep -q '"action":"admit"' "$mnt/var/lib/slackgate/decisions.jsonl" || fail "no admit line logged"
files=$(cd "$mnt" && find . -type f | sort | tr '\n' ' ')
# The stub's container ends with its buildah (SIGTERM: buildah kills what it runs).
kill -TERM "${pids[0]}"
for _ in $(seq 1 50); do kill -0 "${pids[0]}" 2>/dev/null || break; sleep 0.1; done
if curl -s --max-time 1 -o /dev/null "http://127.0.0.1:$stub_port/v1/models"; then
  fail "the stub still answers after its buildah run ended"
fi
echo "image.sh: the gate stopped on SIGTERM; ledger and decision log written as uid 65532"
echo "image.sh: files in the image after the run: $files"
