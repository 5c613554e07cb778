"""Compile time of one compressed exchange: two-phase vs allgather, measured in one run.

  python -m benchmarks.compile_time [--rows 640 --cols 128 --repeats 3]

Median lower and compile seconds of ``jit(shard_map(tx.update))`` (4-bit QSGD) for one
(rows, cols) leaf on 8 CPU devices. Results: docs/benchmarks.md, "Compile time".
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

AXIS = "batch"


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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=640)
  parser.add_argument("--cols", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  shape = (args.rows, args.cols)
  results = {c: compile_seconds(c, shape, args.repeats) for c in ("allgather", "two_phase")}
  for c, (lower, comp) in results.items():
    print(f"{c:<10} lower {lower:.2f} s  compile {comp:.2f} s")
  print(f"two_phase / allgather compile: {results['two_phase'][1] / results['allgather'][1]:.2f}x")


if __name__ == "__main__":
  main()
