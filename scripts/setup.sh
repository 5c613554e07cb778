#!/usr/bin/env bash
# Creates a venv (if needed) and installs jaxcomp with its test and example extras.
# Idempotent: re-installs only when pyproject.toml changed. Prints the venv's python.
#
#   bash scripts/setup.sh        .venv: Python 3.11+ ($PYTHON, default python3), the
#                                jax line it resolves (0.10.x on Python 3.11)
#   bash scripts/setup.sh 3.12   .venv312: Python 3.12, the newest jax (0.12.x), the second
#                                line scripts/test.sh runs. The interpreter: $JAXCOMP_PYTHON312,
#                                else a working python3.12 on PATH, else pyenv's 3.12
# JAXCOMP_VENV / JAXCOMP_VENV312 override where the venvs go.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
line="${1:-default}"

find_python312() {
  local candidate
  if [ -n "${JAXCOMP_PYTHON312:-}" ]; then
    echo "$JAXCOMP_PYTHON312"
    return
  fi
  # A pyenv shim named python3.12 exists even where it cannot run: try it.
  if command -v python3.12 > /dev/null && python3.12 -c "" 2> /dev/null; then
    command -v python3.12
    return
  fi
  if command -v pyenv > /dev/null && candidate="$(pyenv prefix 3.12 2> /dev/null)"; then
    if [ -x "$candidate/bin/python3" ]; then
      echo "$candidate/bin/python3"
      return
    fi
  fi
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3; do
    if [ -x "$candidate" ]; then
      echo "$candidate"
      return
    fi
  done
  echo "error: no Python 3.12 interpreter found (tried \$JAXCOMP_PYTHON312, python3.12 on" \
    "PATH, pyenv prefix 3.12, ~/.pyenv/versions/3.12*); install one or set" \
    "JAXCOMP_PYTHON312=/path/to/python3.12" >&2
  return 1
}

case "$line" in
  default)
    venv="${JAXCOMP_VENV:-$root/.venv}"
    python="${PYTHON:-python3}"
    ;;
  3.12)
    venv="${JAXCOMP_VENV312:-$root/.venv312}"
    python="$(find_python312)"
    version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    if [ "$version" != "3.12" ]; then
      echo "error: $python is Python $version, not 3.12" >&2
      exit 1
    fi
    ;;
  *)
    echo "usage: bash scripts/setup.sh [3.12]" >&2
    exit 2
    ;;
esac

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
