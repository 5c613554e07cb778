"""Compile time of the demo's DGC train step with and without the warm-up stages.

  python -m benchmarks.studies.dgc_warmup_compile

DGC's warm-up compiles one exchange per stage (a ``lax.switch``): the MNIST-1D demo's
train step (8 CPU devices) with ``warmup_steps=0`` (one stage) and ``100`` (five stages),
compiled alternately ``--repeats`` times each. Results: docs/benchmarks.md, "Compile time".
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

# pylint: disable=wrong-import-position
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax

from examples.mnist1d import models
from examples.mnist1d import train
from examples.mnist1d.configs import default
import jaxcomp as jc


def compile_seconds(warmup_steps: int, *, model, params, mesh, config) -> float:
  k, clip = mesh.size, mesh.size * config.grad_clip
  exchange = jc.dgc(
    0.001, 0.9, nesterov=True, clip_norm=clip, warmup_steps=warmup_steps, axis_name=train.AXIS
  )
  tx = optax.chain(jc.per_device_state(exchange), train.make_optimizer(config, momentum=False))
  specs = jc.state_specs(tx, params, axis_name=train.AXIS, num_devices=k)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  per_device = jax.NamedSharding(mesh, P(train.AXIS))
  b = config.per_device_batch_size
  batch = tuple(
    jax.ShapeDtypeStruct(s, d, sharding=per_device)
    for s, d in (((k, b, 40), jnp.float32), ((k, b), jnp.int32))
  )
  start = time.perf_counter()
  train.make_train_step(model, tx, mesh, specs).lower(params, state, batch).compile()
  return time.perf_counter() - start


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args(argv)
  config = default.get_config()
  model = models.create_model(config)
  k = jax.device_count()
  mesh = jax.make_mesh((k,), (train.AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 40)))["params"]
  params = jax.device_put(params, jax.NamedSharding(mesh, P()))
  times = {0: [], 100: []}
  for _ in range(args.repeats):
    for warmup in times:
      t = compile_seconds(warmup, model=model, params=params, mesh=mesh, config=config)
      times[warmup].append(t)
      print(f"warmup_steps={warmup:>3}: compile {t:.1f} s", flush=True)
  one, five = statistics.median(times[0]), statistics.median(times[100])
  print(f"median: 1 stage {one:.1f} s, 5 stages {five:.1f} s, ratio {five / one:.2f}x")


if __name__ == "__main__":
  main()
