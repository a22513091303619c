#!/usr/bin/env bash
# LiteLLM in front of the gate: a real LiteLLM proxy forwarding to a real gate in front of the
# stub (tests/litellm/litellm_hop.py): the class and deadline headers reach the gate, a
# refusal reaches the client as a 429 with the gate's Retry-After (under LiteLLM's
# `llm_provider-` names) and is decided once, a stream passes through whole.
#
#   scripts/test-litellm.sh
#
# LiteLLM lives in its own virtualenv, .venv-litellm at the repository root, created and
# filled from tests/litellm/requirements.txt on first use (about 3 minutes on 2 cores; again
# only when that file changes). The run itself takes about 15 s, most of it LiteLLM starting.
# Builds target/release/slackgate (a no-op when up to date) unless SLACKGATE_BIN is set.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$(date +%s)

venv="$root/.venv-litellm"
req="$root/tests/litellm/requirements.txt"
if [ ! -x "$venv/bin/python" ]; then
  echo "test-litellm: creating $venv" >&2
  "${PYTHON:-python3}" -m venv "$venv"
fi
stamp="$venv/.slackgate-requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "test-litellm: installing $req (LiteLLM's proxy: a few minutes the first time)" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
  echo "$want" > "$stamp"
fi
echo "test-litellm: LiteLLM $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))') ready after $(( $(date +%s) - started )) s"

if [ -z "${SLACKGATE_BIN:-}" ]; then
  cargo build --release -p slackgate --locked --quiet
  target_dir="${CARGO_TARGET_DIR:-target}"
  case "$target_dir" in /*) ;; *) target_dir="$root/$target_dir" ;; esac
  export SLACKGATE_BIN="$target_dir/release/slackgate"
fi
# Bounded: LiteLLM's start is waited for 90 s at most, each request 30 s; the whole run 5 min.
timeout 300 "$venv/bin/python" tests/litellm/litellm_hop.py
echo "test-litellm: took $(( $(date +%s) - started )) s"
