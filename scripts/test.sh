#!/usr/bin/env bash
# The README's test command: set up, then run the test suite on both supported jax lines:
# Python 3.11 (.venv, jax 0.10.x) runs every test (slow ones included); Python 3.12
# (.venv312, the newest jax, 0.12.x) runs every test function too, but not those marked
# `slow` or `once` and only the first case of a parametrized one (JAXCOMP_SECOND_LINE=1:
# tests/conftest.py says which and why).
# pytest's exit code 5 (no tests collected) is a failure, like any other non-zero code.
#
# Each line compiles into its own persistent XLA compilation cache (a temporary directory,
# removed at the end), shared by the pytest workers and the processes the tests start: many
# tests compile the same programs (a method's step, a trainer's run repeated or resumed).
#
#   JAXCOMP_TEST_WORKERS  pytest-xdist workers (default: one per core; 0: one process)
#   JAXCOMP_TEST_LINES    which lines to run, default "3.11 3.12"
#   JAXCOMP_TEST_TIMEOUT  seconds one line may take, default 2400; a line that runs over
#                         is killed (its pytest and workers) and fails, so a hung run ends
#                         red instead of running into CI's own time limit
# Extra arguments go to both pytest runs.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lines="${JAXCOMP_TEST_LINES:-3.11 3.12}"
limit="${JAXCOMP_TEST_TIMEOUT:-2400}"
case "$limit" in
  '' | *[!0-9]* | 0)
    echo "error: JAXCOMP_TEST_TIMEOUT must be a whole number of seconds > 0, got '$limit'" >&2
    exit 2
    ;;
esac
cd "$root"

run_pytest() {
  local py="$1"
  shift
  "$py" -c 'import sys, jax; print(f"== Python {sys.version.split()[0]}, jax {jax.__version__}")'
  # One pytest worker per core (pytest-xdist); JAXCOMP_TEST_WORKERS=0 runs in one process.
  # --dist loadgroup: tests marked xdist_group("name") run on one worker (a module whose
  # module-scoped fixture is long to build is built once); the others go as with --dist
  # load, to whichever worker is free.
  # timeout(1) signals the whole process group, pytest-xdist's workers included.
  timeout --kill-after=60 "$limit" \
    "$py" -m pytest -q -n "${JAXCOMP_TEST_WORKERS:-auto}" --dist loadgroup "$@"
  local code=$?
  if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
    echo "error: this jax line's tests ran over ${limit} s (JAXCOMP_TEST_TIMEOUT) and were killed" >&2
    return 1
  fi
  if [ "$code" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    return 1
  fi
  return "$code"
}

cache_root="$(mktemp -d)"
trap 'rm -rf "$cache_root"' EXIT
# Every compile is cached (by default only those over a second are).
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

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
  export JAX_COMPILATION_CACHE_DIR="$cache_root/$line"
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
