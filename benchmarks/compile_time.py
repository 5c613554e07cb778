"""Compile time of one compressed exchange, or of the demo's DGC step, measured in one run.

  python -m benchmarks.compile_time [--rows 640 --cols 128 --repeats 3]
  python -m benchmarks.compile_time --dgc-warmup     # the demo's DGC train step

Median lower and compile seconds of ``jit(shard_map(tx.update))`` (4-bit QSGD) for one
(rows, cols) leaf on 8 CPU devices, two-phase vs allgather. ``--dgc-warmup``: DGC's
warm-up compiles one exchange per stage (a ``lax.switch``): the MNIST-1D demo's train step
(8 CPU devices) with ``warmup_steps=0`` (one stage) and ``100`` (five stages), compiled
alternately ``--repeats`` times each (2 by default). Results: docs/benchmarks.md,
"Compile time".
"""

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from benchmarks._timing import use_cpu_devices
from examples.mnist1d import models
from examples.mnist1d import train
from examples.mnist1d.configs import default
import jaxcomp as jc

AXIS = train.AXIS


def compile_seconds(collective: str, shape, repeats: int) -> tuple[float, float]:
  mesh = jax.make_mesh((8,), (AXIS,))
  params = {"w": jnp.zeros(shape)}
  times = []  # (lower, compile) seconds
  for seed in range(repeats):  # a new seed is a new transform: no compilation cache hit
    tx = jc.per_device_state(jc.qsgd(bits=4, axis_name=AXIS, collective=collective, seed=seed))
    specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=8)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    update = jax.jit(
      jax.shard_map(
        lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s),
        mesh=mesh,
        in_specs=(P(AXIS), specs),
        out_specs=(P(), specs),
      )
    )
    grads = jax.device_put({"w": jnp.ones((8, *shape))}, jax.NamedSharding(mesh, P(AXIS)))
    t0 = time.perf_counter()
    lowered = update.lower(grads, state)
    t1 = time.perf_counter()
    lowered.compile()
    times.append((t1 - t0, time.perf_counter() - t1))
  return tuple(statistics.median(t) for t in zip(*times))


def dgc_compile_seconds(warmup_steps: int, *, model, params, mesh, config) -> float:
  """Seconds to lower and compile the demo's train step, its DGC with ``warmup_steps``."""
  k = mesh.size
  exchange = train.make_exchange("dgc", dataclasses.replace(config, warmup_steps=warmup_steps))
  tx = train.make_tx("dgc", config, exchange)
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=k)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
  per_device = jax.NamedSharding(mesh, P(AXIS))
  b = config.per_device_batch_size
  batch = tuple(
    jax.ShapeDtypeStruct(s, d, sharding=per_device)
    for s, d in (((k, b, 40), jnp.float32), ((k, b), jnp.int32))
  )
  start = time.perf_counter()
  train.make_train_step(model, tx, mesh, specs).lower(params, state, batch).compile()
  return time.perf_counter() - start


def dgc_warmup(repeats: int) -> None:
  """Prints each compile of the demo's DGC step, one and five stages, and their medians."""
  config = default.get_config()
  model = models.create_model(config)
  mesh = jax.make_mesh((8,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 40)))["params"]
  params = jax.device_put(params, jax.NamedSharding(mesh, P()))
  times = {0: [], 100: []}
  for _ in range(repeats):
    for warmup in times:
      t = dgc_compile_seconds(warmup, model=model, params=params, mesh=mesh, config=config)
      times[warmup].append(t)
      print(f"warmup_steps={warmup:>3}: compile {t:.1f} s", flush=True)
  one, five = statistics.median(times[0]), statistics.median(times[100])
  print(f"median: 1 stage {one:.1f} s, 5 stages {five:.1f} s, ratio {five / one:.2f}x")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=640)
  parser.add_argument("--cols", type=int, default=128)
  parser.add_argument("--repeats", type=int, help="compiles of each program (3; DGC: 2)")
  parser.add_argument("--dgc-warmup", action="store_true", help="the demo's DGC step instead")
  args = parser.parse_args()
  use_cpu_devices(8)
  if args.dgc_warmup:
    dgc_warmup(args.repeats or 2)
    return
  shape = (args.rows, args.cols)
  results = {c: compile_seconds(c, shape, args.repeats or 3) for c in ("allgather", "two_phase")}
  for c, (lower, comp) in results.items():
    print(f"{c:<10} lower {lower:.2f} s  compile {comp:.2f} s")
  print(f"two_phase / allgather compile: {results['two_phase'][1] / results['allgather'][1]:.2f}x")


if __name__ == "__main__":
  main()
