r"""Trains a byte-level transformer LM: dense vs compressed gradient exchange.

From the repository root::

  python -m examples.lm.main --config tiny                 # seconds, a smoke check
  python -m examples.lm.main --config small --methods dense,powersgd,onebit_adam
  python -m examples.lm.main --checkpoint-every 200        # resumes if interrupted

As several processes under ``jax.distributed`` (gloo on CPU), each feeding its own
devices' rows of the batch; run the same command in every process::

  python -m examples.lm.main --config small --coordinator HOST:PORT \
      --num-processes 2 --process-id I --devices-per-process 1 \
      [--checkpoint-every N] [--fault-timeout SECONDS]

With ``--checkpoint-every`` every process writes its own devices' shards, and running
the same commands again after a crash resumes from the latest complete checkpoint with
the same final bits (``params_sha256`` in ``results.json``). A process that dies or is
cut off fails the others within ``--fault-timeout`` seconds (30); a process that sees
an error exits at once with its traceback.

Alone on a CPU-only machine JAX is given 8 CPU devices, so the data-parallel exchange
runs for real between 8 devices. Results (table, JSON, plot) go to ``--workdir``. The
process exits with code 1 when a method diverged (its loss or parameters went
non-finite: its row says ``diverged at update N``), unless ``--allow-diverged``.
"""

import argparse
import dataclasses
import sys

import jax

from examples import common


def build_parser() -> argparse.ArgumentParser:
  """The command-line flags."""
  from examples.lm import configs  # pylint: disable=import-outside-toplevel
  from examples.lm import sharded  # pylint: disable=import-outside-toplevel
  from examples.lm.configs import default  # pylint: disable=import-outside-toplevel

  methods = ",".join(default.Config.methods)
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", default="runs/lm", help="output directory (and checkpoints)")
  p.add_argument(
    "--config",
    default="default",
    help=f"one of {','.join(configs.names())} (examples/lm/configs) or a .py file"
    " providing get_config()",
  )
  p.add_argument(
    "--methods",
    default=None,
    help=f"comma-separated subset of {methods}, or the sharded methods"
    f" {','.join(sharded.METHODS)} (ZeRO-2, per-layer FSDP)",
  )
  p.add_argument("--steps", type=int, default=None, help="override num_steps (updates)")
  p.add_argument("--batch", type=int, default=None, help="override per_device_batch_size")
  p.add_argument("--accumulation", type=int, default=None, help="mini-steps per update")
  p.add_argument("--learning-rate", type=float, default=None, help="override the peak rate")
  p.add_argument("--seed", type=int, default=None, help="override the init/batch seed")
  p.add_argument("--eval-every", type=int, default=None, help="updates between evaluations")
  p.add_argument(
    "--target-loss",
    type=float,
    default=None,
    help="stop a method once its validation loss is <= this (time-to-loss runs)",
  )
  p.add_argument(
    "--checkpoint-every",
    type=int,
    default=None,
    metavar="N",
    help="save every N updates in WORKDIR/checkpoints/METHOD and resume from there (0: off)",
  )
  p.add_argument(
    "--stop-at",
    type=int,
    default=None,
    metavar="N",
    help="stop every method after update N of the --steps schedule",
  )
  common.add_common_flags(p)
  group = p.add_argument_group("multi-process (jax.distributed)")
  group.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's service")
  group.add_argument("--num-processes", type=int, default=1)
  group.add_argument("--process-id", type=int, default=0)
  group.add_argument(
    "--devices-per-process",
    type=int,
    default=None,
    help="CPU devices per process (default: 8 alone, 1 under --coordinator)",
  )
  common.add_fault_timeout_flag(group, "process")
  return p


def get_config(args: argparse.Namespace):
  """The named config with the command-line overrides applied (checked)."""
  from examples.lm import configs  # pylint: disable=import-outside-toplevel
  from examples.lm import train  # pylint: disable=import-outside-toplevel

  config = configs.load(args.config).get_config()
  overrides = common.flag_overrides(
    args,
    (
      ("steps", "num_steps", 1),
      ("batch", "per_device_batch_size", 1),
      ("accumulation", "accumulation_steps", 1),
      ("eval_every", "eval_every", 1),
      ("checkpoint_every", "checkpoint_every", 0),
      ("seed", "seed", None),
      ("learning_rate", "learning_rate", None),
      ("target_loss", "target_loss", 0),
    ),
  )
  if args.methods is not None:
    overrides["methods"] = common.parse_methods(args.methods, train.ALL_METHODS)
  overrides.update(parse_sets(config, args.set))
  return dataclasses.replace(config, **overrides)


parse_sets = common.parse_sets  # --set FIELD=VALUE, for both trainers


def init_devices(args: argparse.Namespace) -> None:
  """Shapes the CPU backend (device count, gloo) and joins ``jax.distributed`` if asked,
  with ``--fault-timeout`` bounding how long a lost peer goes unnoticed
  (``examples.common.init_distributed``).

  Must run before JAX initialises its backends; on a GPU host the CPU settings are
  inert and the GPUs are the devices.
  """
  devices = args.devices_per_process or (1 if args.coordinator else 8)
  if args.coordinator:
    if args.fault_timeout < 0:
      raise ValueError(f"--fault-timeout must be >= 0, got {args.fault_timeout}")
    common.init_distributed(
      args.coordinator,
      args.num_processes,
      args.process_id,
      devices_per_process=devices,
      fault_timeout=args.fault_timeout or None,
    )
  else:
    common.use_cpu_devices(devices)


def main(argv=None) -> int:
  """Parses the flags, sets up the devices and runs :func:`train.train_and_evaluate`;
  returns the exit code: 1 when a method diverged (without ``--allow-diverged``)."""
  args = build_parser().parse_args(argv)
  config = get_config(args)
  if args.stop_at is not None and args.stop_at < 1:
    raise ValueError(f"--stop-at must be >= 1, got {args.stop_at}")
  if not args.coordinator:
    init_devices(args)
    from examples.lm import train  # pylint: disable=import-outside-toplevel

    results = train.train_and_evaluate(config, args.workdir, stop_at=args.stop_at)
    return common.diverged_exit_code(results, allow=args.allow_diverged, unit="update")
  # One of several processes: on an error, leave at once (the others learn it from the
  # exit, or within --fault-timeout), not after jax.distributed's shutdown barrier.
  with common.exit_at_once_on_error():
    init_devices(args)
    from examples.lm import train  # pylint: disable=import-outside-toplevel

    results = train.train_and_evaluate(config, args.workdir, stop_at=args.stop_at)
  jax.distributed.shutdown()  # a barrier: no process leaves while others still run
  # Every process saw the same divergence (global checks): each exits alike.
  return common.diverged_exit_code(results, allow=args.allow_diverged, unit="update")


if __name__ == "__main__":
  sys.exit(main())
