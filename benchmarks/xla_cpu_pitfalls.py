"""XLA:CPU costs that shaped the sparse codecs, each next to its alternative, same run.

  python -m benchmarks.xla_cpu_pitfalls

Prints milliseconds (median of ``--repeats``, jitted, one CPU device) of:

* ``lax.top_k(x, k)[0][-1]`` (a slice of top_k's output, which XLA rewrites into a
  full sort) against ``jnp.min(lax.top_k(x, k)[0])``, at n = 1M, k = 235;
* counting ``a >= t`` by summing the boolean against summing ``floor(min(a/t, 1))`` in
  float32 (``jaxcomp._src.sparse.passes``) and the same with a lower clip at 0 (which
  loses the vectorised reduction), at n = 16M;
* ``jnp.cumsum`` of a mask and ``jnp.nonzero(mask, size=...)``, at n = 1M;
* the Wangni sparsifier's λ: the bisection of ``UnbiasedSparsifier(method="exact")``
  against ``jnp.sort`` alone (the paper's Algorithm 2 sorts), and the greedy method, at
  n = 1M.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax

import jaxcomp as jc
from benchmarks._timing import median_time
from jaxcomp._src import sparse


def _ms(fn, *args, repeats):
  return 1e3 * median_time(jax.jit(fn), *args, repeats=repeats)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  r = parser.parse_args(argv).repeats
  m1 = jnp.abs(jax.random.normal(jax.random.key(0), (2**20,)))
  m16 = jnp.abs(jax.random.normal(jax.random.key(1), (2**24,)))
  t = jnp.float32(3.2)
  rows = [
      ("top_k(x, 235)[0][-1], n=1M", _ms(lambda a: lax.top_k(a, 235)[0][-1], m1, repeats=r)),
      ("min(top_k(x, 235)[0]), n=1M", _ms(lambda a: jnp.min(lax.top_k(a, 235)[0]), m1,
                                          repeats=r)),
      ("sum(a >= t, int32), n=16M", _ms(lambda a, t: jnp.sum(a >= t, dtype=jnp.int32), m16, t,
                                        repeats=r)),
      ("sum(floor(min(a/t, 1))), n=16M", _ms(lambda a, t: jnp.sum(sparse.passes(a, t)), m16, t,
                                             repeats=r)),
      ("sum(floor(clip(a/t, 0, 1))), n=16M", _ms(
          lambda a, t: jnp.sum(jnp.floor(jnp.clip(a * (1.0 / t), 0.0, 1.0))), m16, t, repeats=r)),
      ("cumsum(a >= t), n=1M", _ms(lambda a, t: jnp.cumsum(a >= t, dtype=jnp.int32), m1, t,
                                   repeats=r)),
      ("nonzero(a >= t, size=2k), n=1M", _ms(
          lambda a, t: jnp.nonzero(a >= t, size=2098, fill_value=a.size)[0], m1, t, repeats=r)),
      ("jnp.sort, n=1M", _ms(jnp.sort, m1, repeats=r)),
      ("UnbiasedSparsifier exact λ (eps=1), n=1M", _ms(
          lambda a: jc.codecs.UnbiasedSparsifier(epsilon=1.0, method="exact").probabilities(a)[1],
          m1, repeats=r)),
      ("UnbiasedSparsifier greedy λ (1%), n=1M", _ms(
          lambda a: jc.codecs.UnbiasedSparsifier(density=0.01).probabilities(a)[1], m1,
          repeats=r)),
  ]
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, median of {r}\n")
  print("| operation | ms |")
  print("|---|---:|")
  for name, ms in rows:
    print(f"| {name} | {ms:.1f} |")


if __name__ == "__main__":
  main()
