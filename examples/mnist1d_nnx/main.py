r"""Runs the MNIST-1D demo with flax.nnx: dense vs compressed gradient exchange.

The flax.nnx twin of ``examples.mnist1d.main``: the same configs and flags, the same
results table. From the repository root::

  python -m examples.mnist1d_nnx.main --quick              # seconds, for a smoke check
  python -m examples.mnist1d_nnx.main --methods dense,onebit,qsgd4 --steps 500

On a CPU-only machine JAX is given 8 CPU devices, so the data-parallel exchange runs
for real between 8 devices.
"""

import os

import jax

# Must run before JAX initialises its backends; only shapes the CPU backend.
if os.environ.get("JAX_PLATFORMS", "cpu").lower() in ("", "cpu"):
  try:
    jax.config.update("jax_num_cpu_devices", 8)
  except RuntimeError:  # backends already up (imported late): keep their devices
    pass

# pylint: disable=wrong-import-position
import argparse
import dataclasses
import importlib

from examples.mnist1d_nnx import train


def parse_args(argv=None) -> argparse.Namespace:
  """Command-line flags: those of ``examples.mnist1d.main`` that this trainer uses."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="runs/mnist1d_nnx",
                      help="output directory (results.md/json, accuracy.png, data cache)")
  parser.add_argument("--config", default="default",
                      help="module in examples/mnist1d/configs providing get_config()")
  parser.add_argument("--quick", action="store_true", help="shorthand for --config quick")
  parser.add_argument("--steps", type=int, default=None, help="override num_steps")
  parser.add_argument("--batch", type=int, default=None,
                      help="override per_device_batch_size")
  parser.add_argument("--seed", type=int, default=None,
                      help="override the init/shuffling seed (the data set stays fixed)")
  parser.add_argument("--methods", default=None,
                      help=f"comma-separated subset of {','.join(train.ALL_METHODS)}")
  return parser.parse_args(argv)


def get_config(args: argparse.Namespace):
  """The named config of ``examples/mnist1d/configs`` with the overrides applied.

  Not ``examples.mnist1d.main.get_config``: that one follows the linen trainer's
  flags, which include features (checkpointing) this trainer does not have.
  """
  name = "quick" if args.quick else args.config
  config = importlib.import_module(f"examples.mnist1d.configs.{name}").get_config()
  overrides = {}
  for flag, field in (("steps", "num_steps"), ("batch", "per_device_batch_size")):
    value = getattr(args, flag)
    if value is not None:
      if value < 1:
        raise ValueError(f"--{flag} must be positive, got {value}")
      overrides[field] = value
  if args.seed is not None:
    overrides["seed"] = args.seed
  if args.methods is not None:
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = [m for m in methods if m not in train.ALL_METHODS]
    if unknown or not methods:
      raise ValueError(f"--methods: unknown {unknown}; choose from {','.join(train.ALL_METHODS)}")
    overrides["methods"] = methods
  return dataclasses.replace(config, **overrides)


def main(argv=None) -> None:
  """Parses the flags and runs :func:`train.train_and_evaluate`."""
  args = parse_args(argv)
  train.train_and_evaluate(get_config(args), args.workdir)


if __name__ == "__main__":
  main()
