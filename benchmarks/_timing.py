"""Shared timing helper of the benchmark scripts."""

import statistics
import time

import jax


def median_time(fn, *args, repeats: int) -> float:
  """Median wall time of ``fn(*args)`` over ``repeats`` runs, after one warm-up run."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)
