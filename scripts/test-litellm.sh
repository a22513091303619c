#!/usr/bin/env bash
# LiteLLM in front of the gate: a real LiteLLM proxy forwarding to a real gate in front of the
# stub (tests/litellm/litellm_hop.py): the class and deadline headers reach the gate, a
# refusal reaches the client as a 429 with the gate's Retry-After (under LiteLLM's
# `llm_provider-` names) and is decided once, a stream passes through whole.
#
#   scripts/test-litellm.sh
#
# LiteLLM lives in its own virtualenv (about 750 MB), kept outside the checkout like the
# llama-server build: ${SLACKGATE_CACHE:-$HOME/.cache/slackgate}/litellm-venv-<hash of
# tests/litellm/requirements.txt>, so a fresh clone on the same machine (CI) reuses it.
# Creating it takes 1.5 minutes with pip's cache warm, about 3-4 cold; the run itself about
# 15 s, most of it LiteLLM starting.
# Builds target/release/slackgate (a no-op when up to date) unless SLACKGATE_BIN is set.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$(date +%s)

req="$root/tests/litellm/requirements.txt"
want="$(sha256sum "$req" | cut -d' ' -f1)"
cache="${SLACKGATE_CACHE:-$HOME/.cache/slackgate}"
venv="$cache/litellm-venv-${want:0:16}"
stamp="$venv/.slackgate-requirements.sha256"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "test-litellm: installing $req into $venv (LiteLLM's proxy: 1.5-4 minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
  # Written last: an interrupted install is redone, not trusted.
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
