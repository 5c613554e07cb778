r"""The demo's train step with QSGD on the native CPU kernels against the XLA path.

Trains the MNIST-1D demo's jitted step (8 CPU devices) with ``jc.qsgd(...,
implementation="native")`` and ``"xla"`` from the same parameters on the same batches,
compares the parameters every ``--every`` steps, and counts the divisions over bucket
values XLA compiled into the encode (none: every path multiplies by the per-bucket
reciprocal). Why it matters: docs/guides/kernels.md, "Bit for bit in training too".

  python -m benchmarks.studies.native_vs_xla                  # QSGD 4-bit, 400 steps
  python -m benchmarks.studies.native_vs_xla --bits 2 --bucket 128 --steps 200
"""

from __future__ import annotations

import argparse
import re

import jax
from jax.sharding import PartitionSpec as P
import numpy as np

from benchmarks._timing import use_cpu_devices
from examples.mnist1d import input_pipeline
from examples.mnist1d import train
from examples.mnist1d.configs import default
import jaxcomp as jc
from jaxcomp.kernels import cpu


def run(impl: str, args, config, mesh, data, model, init_params):
  """(parameters after each checked step, the compiled step's HLO text)."""
  k = mesh.size
  exchange = jc.qsgd(
    bits=args.bits, bucket_size=args.bucket, axis_name=train.AXIS, implementation=impl
  )
  tx = train.make_tx("qsgd4", config, exchange)
  specs = jc.state_specs(tx, init_params, axis_name=train.AXIS, num_devices=k)
  params = jax.device_put(init_params, jax.NamedSharding(mesh, P()))
  opt = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  step = train.compile_train_step(model, tx, mesh, specs, params, opt, config, data)
  b = config.per_device_batch_size
  batches = input_pipeline.train_batches(
    data["x"], data["y"], num_devices=k, per_device_batch_size=b, seed=config.seed
  )
  checked = {}
  for i in range(1, args.steps + 1):
    batch = jax.device_put(next(batches), jax.NamedSharding(mesh, P(train.AXIS)))
    params, opt, _ = step(params, opt, batch)
    if i % args.every == 0 or i == args.steps:
      checked[i] = [np.asarray(a) for a in jax.tree.leaves(jax.device_get(params))]
  return checked, step.as_text()


def encode_divisions(hlo: str, bucket: int) -> int:
  """The number of float32 divisions over arrays of bucket values in the encode (whose
  last dimension is the bucket size; the per-bucket reciprocals are not counted)."""
  shapes = re.findall(r"= f32\[([\d,]+)\]\{[0-9,]*\} divide\(.*jaxcomp_encode", hlo)
  return sum(1 for dims in shapes if int(dims.split(",")[-1]) == bucket)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--bits", type=int, default=4)
  parser.add_argument("--bucket", type=int, default=512)
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--every", type=int, default=10)
  parser.add_argument("--workdir", default="/tmp/jaxcomp_native_vs_xla")
  args = parser.parse_args(argv)
  use_cpu_devices(8)
  cpu.require()
  config = default.get_config()
  mesh, data, model, init_params = train.setup(config, args.workdir)
  native, _ = run("native", args, config, mesh, data, model, init_params)
  xla, hlo = run("xla", args, config, mesh, data, model, init_params)
  print(
    f"XLA's compiled step: {encode_divisions(hlo, args.bucket)} divisions over arrays "
    f"of bucket values in jaxcomp_encode"
  )
  total = sum(a.size for a in next(iter(native.values())))
  for i in sorted(native):
    differ = sum(int(np.sum(a != b)) for a, b in zip(native[i], xla[i]))
    if differ:
      print(
        f"first difference at a checked step: step {i}, {differ} of {total} values "
        f"(identical at step {i - args.every})"
        if i > args.every
        else f"first difference at step {i}: {differ} of {total} values"
      )
      return
  print(f"identical through step {args.steps} ({total} values)")


if __name__ == "__main__":
  main()
