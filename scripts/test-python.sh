#!/usr/bin/env bash
# End-to-end tests with the official OpenAI Python SDK (and curl) against a real gate.
#
#   scripts/test-python.sh [extra pytest args]
#
# Creates (or reuses) a virtualenv at .venv in the repository root (scripts/venv.sh), installs
# tests/python/requirements.txt there, builds target/release/slackgate (a no-op when it is up to
# date), then runs `python -m pytest tests/python -q`. Set SLACKGATE_BIN to test
# another binary (the build step is then skipped). PYTHON picks the interpreter (python3).
# Exits non-zero when anything fails.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

venv_python="$(scripts/venv.sh)"

if [ -z "${SLACKGATE_BIN:-}" ]; then
    # cargo decides what (if anything) to rebuild, and waits if another build holds the lock.
    echo "test-python: cargo build --release -p slackgate"
    cargo build --release -p slackgate --locked --quiet
    # Where cargo put it: CARGO_TARGET_DIR when set (relative to the checkout), else target/.
    target_dir="${CARGO_TARGET_DIR:-target}"
    case "$target_dir" in /*) ;; *) target_dir="$root/$target_dir" ;; esac
    export SLACKGATE_BIN="$target_dir/release/slackgate"
fi

echo "test-python: $("$venv_python" -c 'import openai, sys; print(f"python {sys.version.split()[0]}, openai {openai.__version__}")'), binary $SLACKGATE_BIN"
exec "$venv_python" -m pytest tests/python -q -p no:cacheprovider "$@"
