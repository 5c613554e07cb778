#!/usr/bin/env bash
# Creates .venv (if needed) and installs jaxcomp with its test and example extras.
# Idempotent: re-installs only when pyproject.toml changed. Prints the venv's python.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${JAXCOMP_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv" >&2
fi
stamp="$venv/.jaxcomp-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet -e "$root[test,examples]" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
