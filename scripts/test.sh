#!/usr/bin/env bash
# The README's test command: set up, then run the test suite on both supported jax lines:
# Python 3.11 (.venv, jax 0.10.x) runs every test (slow ones included); Python 3.12
# (.venv312, the newest jax, 0.12.x) runs every test function too, but not those marked
# `slow` or `once` and only the first case of a parametrized one (JAXCOMP_SECOND_LINE=1:
# tests/conftest.py says which and why).
# pytest's exit code 5 (no tests collected) is a failure, like any other non-zero code.
#
#   JAXCOMP_TEST_WORKERS  pytest-xdist workers (default: one per core; 0: one process)
#   JAXCOMP_TEST_LINES    which lines to run, default "3.11 3.12"
# Extra arguments go to both pytest runs.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lines="${JAXCOMP_TEST_LINES:-3.11 3.12}"
cd "$root"

run_pytest() {
  local py="$1"
  shift
  "$py" -c 'import sys, jax; print(f"== Python {sys.version.split()[0]}, jax {jax.__version__}")'
  # One pytest worker per core (pytest-xdist); JAXCOMP_TEST_WORKERS=0 runs in one process.
  # --dist loadgroup: tests marked xdist_group("name") run on one worker (a module whose
  # module-scoped fixture is long to build is built once); the others go as with --dist
  # load, to whichever worker is free.
  "$py" -m pytest -q -n "${JAXCOMP_TEST_WORKERS:-auto}" --dist loadgroup "$@"
  local code=$?
  if [ "$code" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    return 1
  fi
  return "$code"
}

status=0
first=1
for line in $lines; do
  case "$line" in
    3.11) py="$(bash "$root/scripts/setup.sh")" || exit 1 ;;
    3.12) py="$(bash "$root/scripts/setup.sh" 3.12)" || exit 1 ;;
    *)
      echo "error: JAXCOMP_TEST_LINES may list 3.11 and 3.12, got '$line'" >&2
      exit 2
      ;;
  esac
  if [ "$first" -eq 1 ]; then
    # Lint and format check once, first (ruff, pinned and configured in pyproject.toml):
    # cheap, and it fails fast.
    "$py" -m ruff check . || exit 1
    "$py" -m ruff format --check . || exit 1
    JAXCOMP_SECOND_LINE= run_pytest "$py" "$@" || status=1
    first=0
  else
    JAXCOMP_SECOND_LINE=1 run_pytest "$py" "$@" || status=1
  fi
done
exit "$status"
