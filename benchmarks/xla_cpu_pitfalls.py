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
  n = 1M;
* QSGD's per-bucket scale and NaN check as three library reductions and as one variadic
  reduction, at n = 16M;
* OneBit's bucket statistics in one reduction per bucket and in two levels, at n = 4M;
* ``x + 1`` into a new buffer, in place, and into a new buffer under glibc tunables that
  reuse large blocks (``benchmarks._timing.REUSE_MALLOC``, in a child process), n = 16M,
  and the minor page faults per call in child processes with and without the tunables;
* QSGD's decode of two gathered payloads followed by an optimizer that reads the mean
  three times, with the decode fused into the readers (XLA's choice) and materialized
  once (``collectives._decode_means``), at n = 1.77M.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

import jaxcomp as jc
from benchmarks import _timing
from benchmarks._timing import median_time
from jaxcomp._src import bitpack
from jaxcomp._src import codecs
from jaxcomp._src import collectives
from jaxcomp._src import sparse


def _ms(fn, *args, repeats):
  return 1e3 * median_time(jax.jit(fn), *args, repeats=repeats)


def _donated_ms(x, *, repeats: int) -> float:
  f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
  y = f(x + 0.0)
  y.block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    y = f(y)
    y.block_until_ready()
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


_NEW_BUFFER = """
import resource, statistics, time, jax, jax.numpy as jnp
x = jax.random.normal(jax.random.key(2), (2**24,))
f = jax.jit(lambda a: a + 1.0)
for _ in range(3):  # compile, and let the heap settle
  f(x).block_until_ready()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
times = []
for _ in range({repeats}):
  start = time.perf_counter()
  f(x).block_until_ready()
  times.append(time.perf_counter() - start)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(1e3 * statistics.median(times), faults / {repeats})
"""


def _new_buffer_child(*, repeats: int, reuse: bool) -> tuple[float, float]:
  """``x + 1`` into a new 64 MB buffer in a child process, with glibc's default malloc
  or with ``REUSE_MALLOC``: (median ms, minor page faults per call, over the same
  ``max(repeats, 10)`` calls); NaNs off glibc."""
  if platform.libc_ver()[0] != "glibc":
    return float("nan"), float("nan")
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  env["JAX_PLATFORMS"] = "cpu"
  if reuse:
    env["GLIBC_TUNABLES"] = _timing.REUSE_MALLOC
  out = subprocess.run([sys.executable, "-c", _NEW_BUFFER.format(repeats=max(repeats, 10))], env=env,
                       check=True, capture_output=True, text=True).stdout
  ms, faults = out.split()[-2:]
  return float(ms), float(faults)


def _decode_update(materialize: bool):
  """QSGD 4-bit decode_sum of 2 gathered payloads of a 128x13824 leaf, then clipping,
  momentum and an update that all read the mean: fused (XLA's choice) or with the
  mean materialized by ``collectives._decode_means``' ``lax.cond``."""
  codec = jc.codecs.QSGD(7, 512, "max")
  x = jax.random.normal(jax.random.key(3), (128, 13824))
  payload = codec.encode(x, key=jax.random.key(4))
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), payload)

  def step(st, w, m):
    if materialize:
      d = collectives._decode_means([codec], [st], 2)[0]  # pylint: disable=protected-access
    else:
      d = codec.decode_sum(st) / 2
    norm = jnp.sqrt(jnp.sum(d * d))
    g = d * jnp.where(norm < 1.0, 1.0, 1.0 / norm) + 1e-4 * w
    m = 0.9 * m + g
    return w - 0.01 * (g + 0.9 * m), m

  return step, (stacked, jnp.ones(x.shape), jnp.ones(x.shape))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  r = parser.parse_args(argv).repeats
  m1 = jnp.abs(jax.random.normal(jax.random.key(0), (2**20,)))
  m16 = jnp.abs(jax.random.normal(jax.random.key(1), (2**24,)))
  s16 = jax.random.normal(jax.random.key(2), (2**24,))
  t = jnp.float32(3.2)
  s4 = jax.random.normal(jax.random.key(5), (2**22,))
  onebit_args = (s4.reshape(-1, 1024), bitpack.pack_bits((s4 < 0).astype(jnp.uint32), 1))
  default, reuse = (_new_buffer_child(repeats=r, reuse=b) for b in (False, True))
  fused, decode_args = _decode_update(False)
  materialized, _ = _decode_update(True)
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
      # The quantizers' per-bucket reductions (buckets of 512, n=16M): XLA:CPU hands a
      # plain reduction of an input to a library kernel, one with a prologue to its loop
      # emitter.
      ("max(x) per bucket of 512, n=16M", _ms(
          lambda a: jnp.max(a.reshape(-1, 512), axis=1), s16, repeats=r)),
      ("max(abs(x)) per bucket of 512, n=16M", _ms(
          lambda a: jnp.max(jnp.abs(a.reshape(-1, 512)), axis=1), s16, repeats=r)),
      ("max(max x, -min x) per bucket of 512, n=16M", _ms(
          lambda a: jnp.maximum(jnp.max(a.reshape(-1, 512), axis=1),
                                -jnp.min(a.reshape(-1, 512), axis=1)), s16, repeats=r)),
      # QSGD's scale and NaN check: max, min and a sum as library reductions (three
      # passes; the library max skips NaNs, hence the sum), or max and min in one
      # NaN-propagating variadic reduction (codecs._row_max_min).
      ("max, min and sum per bucket of 512 (three reductions), n=16M", _ms(
          lambda a: (jnp.max(a.reshape(-1, 512), axis=1), jnp.min(a.reshape(-1, 512), axis=1),
                     jnp.sum(a.reshape(-1, 512), axis=1)), s16, repeats=r)),
      ("max and min per bucket of 512, one variadic reduction, n=16M", _ms(
          lambda a: codecs._row_max_min(a.reshape(-1, 512)), s16, repeats=r)),  # pylint: disable=protected-access
      ("sum(x*x) per bucket of 512, n=16M", _ms(
          lambda a: jnp.sum(jnp.square(a.reshape(-1, 512)), axis=1), s16, repeats=r)),
      # OneBit's bucket statistics (buckets of 1024, n=4M, the packed signs given): one
      # variadic reduction of whole buckets, or two levels (rows of 32, then per bucket).
      ("OneBit bucket sums, one reduction per bucket of 1024, n=4M", _ms(
          lambda v, w: codecs._onebit_sums(v, w, two_level=False), *onebit_args,  # pylint: disable=protected-access
          repeats=r)),
      ("OneBit bucket sums, rows of 32 then per bucket, n=4M", _ms(
          lambda v, w: codecs._onebit_sums(v, w, two_level=True), *onebit_args,  # pylint: disable=protected-access
          repeats=r)),
      # Writing a fresh 64 MB output (every decode does) vs the same loop in place.
      ("x + 1 into a new buffer, n=16M", _ms(lambda a: a + 1.0, s16, repeats=r)),
      ("x + 1 in place (donated), n=16M", _donated_ms(s16, repeats=r)),
      # The new buffer's cost is glibc's: a block above its mmap threshold is mmapped per
      # call and unmapped when freed. With REUSE_MALLOC (a child process) it is reused.
      ("x + 1 into a new buffer, GLIBC_TUNABLES=REUSE_MALLOC, n=16M", reuse[0]),
      # A decoded mean that the optimizer reads three times: XLA:CPU fuses the decode
      # into each reader unless it is materialized (jaxcomp does, on CPU).
      ("QSGD4 decode of 2 payloads + clip/momentum/update, fused, n=1.77M",
       _ms(fused, *decode_args, repeats=r)),
      ("the same, decode materialized (lax.cond), n=1.77M",
       _ms(materialized, *decode_args, repeats=r)),
      ("UnbiasedSparsifier greedy λ (1%), n=1M", _ms(
          lambda a: jc.codecs.UnbiasedSparsifier(density=0.01).probabilities(a)[1], m1,
          repeats=r)),
  ]
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, malloc: "
        f"{_timing.malloc_label()}, median of {r}\n")
  print("| operation | ms |")
  print("|---|---:|")
  for name, ms in rows:
    print(f"| {name} | {ms:.1f} |")
  print(f"\nMinor page faults per call of x + 1 into a new 64 MB buffer (child processes; "
        f"16,384 pages of 4 KiB): glibc default {default[1]:,.0f} ({default[0]:.1f} ms), "
        f"GLIBC_TUNABLES=REUSE_MALLOC {reuse[1]:,.0f} ({reuse[0]:.1f} ms).")


if __name__ == "__main__":
  main()
