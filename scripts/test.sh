#!/usr/bin/env bash
# The README's test command: set up, then run the whole test suite (slow tests included).
# pytest's exit code 5 (no tests collected) is a failure, like any other non-zero code.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup.sh")" || exit 1
cd "$root"
# Lint and format check first (ruff, configured in pyproject.toml): cheap, and it fails fast.
"$py" -m ruff check . || exit 1
"$py" -m ruff format --check . || exit 1
# One pytest worker per core (pytest-xdist); JAXCOMP_TEST_WORKERS=0 runs in one process.
"$py" -m pytest -q -n "${JAXCOMP_TEST_WORKERS:-auto}" "$@"
code=$?
if [ "$code" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$code"
