r"""Runs the MNIST-1D demo: dense vs QSGD vs 1-bit SGD gradient exchange.

From the repository root::

  python -m examples.mnist1d.main                      # default config, all methods
  python -m examples.mnist1d.main --quick              # seconds, for a smoke check
  python -m examples.mnist1d.main --methods dense,onebit --steps 500
  python -m examples.mnist1d.main --checkpoint-every 100  # resumes if interrupted
  python -m examples.mnist1d.main --config path/to/my_config.py  # any get_config() file

The process exits with code 1 when a method diverged (its loss or parameters went
non-finite: its row says ``diverged at step N``), unless ``--allow-diverged``.

On a CPU-only machine JAX is given 8 CPU devices, so the data-parallel exchange runs
for real between 8 devices.
"""

from examples import common

# Before JAX initialises its backends (before anything touches devices).
if common.cpu_platform_selected():
  common.use_cpu_devices(8)

# pylint: disable=wrong-import-position
import argparse
import dataclasses
import sys

from examples.mnist1d import configs
from examples.mnist1d import train


def build_parser(
  *,
  description: str = __doc__.splitlines()[0],
  workdir: str = "runs/mnist1d",
  checkpoints: bool = True,
) -> argparse.ArgumentParser:
  """The command-line flags (the NNX trainer reuses them, without checkpoints)."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument(
    "--workdir",
    default=workdir,
    help="output directory (results.md/json, accuracy.png, data cache)",
  )
  parser.add_argument(
    "--config",
    default="default",
    help=f"one of {','.join(configs.names())} (examples/mnist1d/"
    "configs), or the path of a .py file providing get_config()",
  )
  parser.add_argument("--quick", action="store_true", help="shorthand for --config quick")
  parser.add_argument("--steps", type=int, default=None, help="override num_steps")
  parser.add_argument("--batch", type=int, default=None, help="override per_device_batch_size")
  parser.add_argument(
    "--seed",
    type=int,
    default=None,
    help="override the init/shuffling seed (the data set stays fixed)",
  )
  parser.add_argument(
    "--methods", default=None, help=f"comma-separated subset of {','.join(train.ALL_METHODS)}"
  )
  common.add_common_flags(parser)
  if checkpoints:
    parser.add_argument(
      "--checkpoint-every",
      type=int,
      default=None,
      metavar="N",
      help="save each method's params and optimizer state every N steps"
      " in WORKDIR/checkpoints/METHOD and resume from there (0: off, the"
      " default)",
    )
  return parser


def parse_args(argv=None) -> argparse.Namespace:
  """Command-line flags."""
  return build_parser().parse_args(argv)


def get_config(args: argparse.Namespace):
  """The named config with the command-line overrides applied."""
  name = "quick" if args.quick else args.config
  config = configs.load(name).get_config()
  overrides = common.flag_overrides(
    args,
    (
      ("steps", "num_steps", 1),
      ("batch", "per_device_batch_size", 1),
      ("seed", "seed", None),
      ("checkpoint_every", "checkpoint_every", 0),  # absent: a parser without checkpoints
    ),
  )
  if args.methods is not None:
    overrides["methods"] = common.parse_methods(args.methods, train.ALL_METHODS)
  overrides.update(common.parse_sets(config, args.set))
  return dataclasses.replace(config, **overrides)


def main(argv=None) -> int:
  """Parses the flags and runs :func:`train.train_and_evaluate`; returns the exit code,
  1 when a method diverged (without ``--allow-diverged``)."""
  args = parse_args(argv)
  results = train.train_and_evaluate(get_config(args), args.workdir)
  return common.diverged_exit_code(results, allow=args.allow_diverged)


if __name__ == "__main__":
  sys.exit(main())
