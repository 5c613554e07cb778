r"""Runs the MNIST-1D demo with flax.nnx: dense vs compressed gradient exchange.

The flax.nnx twin of ``examples.mnist1d.main``: the same configs and flags, the same
results table. From the repository root::

  python -m examples.mnist1d_nnx.main --quick              # seconds, for a smoke check
  python -m examples.mnist1d_nnx.main --methods dense,onebit,qsgd4 --steps 500

On a CPU-only machine JAX is given 8 CPU devices, so the data-parallel exchange runs
for real between 8 devices. The process exits with code 1 when a method diverged (went
non-finite), unless ``--allow-diverged``.
"""

from examples import common

# Before JAX initialises its backends (before anything touches devices).
if common.cpu_platform_selected():
  common.use_cpu_devices(8)

# pylint: disable=wrong-import-position
import sys

from examples.mnist1d import main as linen_main
from examples.mnist1d_nnx import train


def main(argv=None) -> int:
  """Parses the linen demo's flags (no checkpoints here), runs
  :func:`train.train_and_evaluate` and returns the exit code (1 when a method diverged,
  without ``--allow-diverged``)."""
  parser = linen_main.build_parser(
    description=__doc__.splitlines()[0], workdir="runs/mnist1d_nnx", checkpoints=False
  )
  args = parser.parse_args(argv)
  results = train.train_and_evaluate(linen_main.get_config(args), args.workdir)
  return common.diverged_exit_code(results, allow=args.allow_diverged)


if __name__ == "__main__":
  sys.exit(main())
