#!/usr/bin/env bash
# Creates (or reuses) the repository's Python virtualenv at .venv and installs
# tests/python/requirements.txt into it (again only when that file changed since the last
# successful install). Prints the venv's python on stdout; everything else goes to stderr.
# PYTHON picks the interpreter that creates it (python3). Used by scripts/test-python.sh (the
# openai SDK suite) and scripts/test.sh (gguf and numpy for scripts/make-model.py).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
venv="$root/.venv"
req="$root/tests/python/requirements.txt"

if [ ! -x "$venv/bin/python" ]; then
    echo "venv: creating $venv" >&2
    "$python" -m venv "$venv" >&2
fi
stamp="$venv/.slackgate-requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "venv: installing $req" >&2
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
    echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
