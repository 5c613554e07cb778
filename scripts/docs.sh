#!/usr/bin/env bash
# Builds the docs site into docs/_build/html with warnings as errors (Sphinx, offline).
# Set-up is scripts/setup.sh's: the project venv with the test extra, which includes the
# docs extra (Sphinx, myst-parser, sphinx-book-theme, the offline MathJax, matplotlib for
# the figures), so the venv the tests run in can build the docs too. Extra arguments go
# to sphinx-build (e.g. -E to rebuild everything).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup.sh")"
cd "$root"
"$py" -m sphinx -W --keep-going -b html docs docs/_build/html "$@"
echo "docs: file://$root/docs/_build/html/index.html" >&2
