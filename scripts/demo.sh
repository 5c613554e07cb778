#!/usr/bin/env bash
# The README's main command: set up, then train MNIST-1D on 8 devices with dense and
# compressed gradient exchanges, print the comparison table and write the plot.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup.sh")"
cd "$root"
exec "$py" -m examples.mnist1d.main "$@"
