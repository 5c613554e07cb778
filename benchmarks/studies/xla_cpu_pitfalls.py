"""XLA:CPU costs that shaped the sparse codecs, each next to its alternative, same run.

  python -m benchmarks.studies.xla_cpu_pitfalls

Prints milliseconds (median of ``--repeats``, jitted, one CPU device) of:

* ``lax.top_k(x, k)[0][-1]`` (a slice of top_k's output, which XLA rewrites into a
  full sort) against ``jnp.min(lax.top_k(x, k)[0])``, at n = 1M, k = 235;
* counting ``a >= t`` by summing the boolean against summing ``floor(min(a/t, 1))`` in
  float32 (``jaxcomp._src.codecs.sparse.passes``) and the same with a lower clip at 0 (which
  loses the vectorised reduction), at n = 16M;
* ``jnp.cumsum`` of a mask and ``jnp.nonzero(mask, size=...)``, at n = 1M, against
  ``sparse.compact`` (popcounts of the packed mask and a binary search; no cumsum over
  n) and ``sparse.first_trues`` (the cumsum cut ``mask & (cumsum(mask) <= c)``);
* MIPD's ``top_mask`` (k = 1% of n = 1M): a bisection of 31 counting passes with ties
  cut by a cumsum (the earlier code, kept here) against the 4-way search of
  ``mipd.top_mask`` (3 thresholds per variadic reduction, 16 passes);
* the Wangni sparsifier's λ: the bisection of ``UnbiasedSparsifier(method="exact")``
  against ``jnp.sort`` alone (the paper's Algorithm 2 sorts), and the greedy method, at
  n = 1M, with its rounds' two sums as ``jnp.sum`` calls over all values (the earlier
  code, kept here) and as one variadic reduction over rows of 16 (the library's);
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
from jax import lax
import jax.numpy as jnp

from benchmarks import _timing
from benchmarks._timing import median_time
import jaxcomp as jc
from jaxcomp._src.codecs import sparse
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.methods import mipd
from jaxcomp._src.plumbing import arith
from jaxcomp._src.plumbing import bitpack


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
  out = subprocess.run(
    [sys.executable, "-c", _NEW_BUFFER.format(repeats=max(repeats, 10))],
    env=env,
    check=True,
    capture_output=True,
    text=True,
  ).stdout
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


def _bisection_top_mask(x, k):
  """MIPD's top_mask as it was: 31 bisection passes, ties cut by a cumsum over n."""
  bits = lax.bitcast_convert_type(jnp.abs(x), jnp.int32)

  def body(_, carry):
    lo, hi = carry
    mid = lo + (hi - lo) // 2
    ok = jnp.sum((bits >= mid).astype(jnp.int32)) >= k
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = lax.fori_loop(0, 31, body, (jnp.int32(0), jnp.int32(2**31 - 1)))
  above, tie = bits > lo, bits == lo
  need = k - jnp.sum(above.astype(jnp.int32))
  return above | (tie & (jnp.cumsum(tie.astype(jnp.int32)) <= need))


def _greedy_lambda_two_sums(a, density=0.01, rounds=4):
  """The greedy λ as it was: each round's two sums as jnp.sum calls over all of a."""
  target = jnp.float32(density * a.shape[0])
  lam = target / jnp.sum(a)
  for _ in range(rounds):
    sat = jnp.floor(jnp.minimum(a * lam, 1.0))
    n_sat, rest = jnp.sum(sat), jnp.sum(a - sat * a)
    ok = (target - n_sat > 0) & (rest > 0)
    lam = jnp.where(ok, jnp.maximum((target - n_sat) / jnp.where(ok, rest, 1.0), lam), lam)
  return lam


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
    ("min(top_k(x, 235)[0]), n=1M", _ms(lambda a: jnp.min(lax.top_k(a, 235)[0]), m1, repeats=r)),
    (
      "sum(a >= t, int32), n=16M",
      _ms(lambda a, t: jnp.sum(a >= t, dtype=jnp.int32), m16, t, repeats=r),
    ),
    (
      "sum(floor(min(a/t, 1))), n=16M",
      _ms(lambda a, t: jnp.sum(sparse.passes(a, t)), m16, t, repeats=r),
    ),
    (
      "sum(floor(clip(a/t, 0, 1))), n=16M",
      _ms(lambda a, t: jnp.sum(jnp.floor(jnp.clip(a * (1.0 / t), 0.0, 1.0))), m16, t, repeats=r),
    ),
    ("sum(a) (a read, for scale), n=1M", _ms(jnp.sum, m1, repeats=r)),
    (
      "cumsum(a >= t), n=1M",
      _ms(lambda a, t: jnp.cumsum(a >= t, dtype=jnp.int32), m1, t, repeats=r),
    ),
    (
      "nonzero(a >= t, size=2k), n=1M",
      _ms(lambda a, t: jnp.nonzero(a >= t, size=2098, fill_value=a.size)[0], m1, t, repeats=r),
    ),
    (
      "sparse.compact(a >= t, 2k) (popcounts, binary search), n=1M",
      _ms(lambda a, t: sparse.compact(a >= t, 2098), m1, t, repeats=r),
    ),
    (
      "sparse.compact(a >= 0.5, n/2) (popcounts, scatter of the set bits), n=1M",
      _ms(lambda a: sparse.compact(a >= 0.5, 2**19), m1, repeats=r),
    ),
    (
      "a >= t & (cumsum(a >= t) <= 1000), n=1M",
      _ms(lambda a, t: (a >= t) & (jnp.cumsum(a >= t, dtype=jnp.int32) <= 1000), m1, t, repeats=r),
    ),
    (
      "sparse.first_trues(a >= t, 1000), n=1M",
      _ms(lambda a, t: sparse.first_trues(a >= t, 1000), m1, t, repeats=r),
    ),
    (
      "MIPD top_mask k=1%, bisection + cumsum ties (before), n=1M",
      _ms(lambda a: _bisection_top_mask(a, jnp.int32(10486)), m1, repeats=r),
    ),
    (
      "MIPD top_mask k=1%, 4-way search + first_trues, n=1M",
      _ms(lambda a: mipd.top_mask(a, jnp.int32(10486)), m1, repeats=r),
    ),
    ("jnp.sort, n=1M", _ms(jnp.sort, m1, repeats=r)),
    (
      "UnbiasedSparsifier exact λ (eps=1), n=1M",
      _ms(
        lambda a: jc.codecs.UnbiasedSparsifier(epsilon=1.0, method="exact").probabilities(a)[1],
        m1,
        repeats=r,
      ),
    ),
    # The quantizers' per-bucket reductions (buckets of 512, n=16M): XLA:CPU hands a
    # plain reduction of an input to a library kernel, one with a prologue to its loop
    # emitter.
    (
      "max(x) per bucket of 512, n=16M",
      _ms(lambda a: jnp.max(a.reshape(-1, 512), axis=1), s16, repeats=r),
    ),
    (
      "max(abs(x)) per bucket of 512, n=16M",
      _ms(lambda a: jnp.max(jnp.abs(a.reshape(-1, 512)), axis=1), s16, repeats=r),
    ),
    (
      "max(max x, -min x) per bucket of 512, n=16M",
      _ms(
        lambda a: jnp.maximum(
          jnp.max(a.reshape(-1, 512), axis=1), -jnp.min(a.reshape(-1, 512), axis=1)
        ),
        s16,
        repeats=r,
      ),
    ),
    # QSGD's scale and NaN check: max, min and a sum as library reductions (three
    # passes; the library max skips NaNs, hence the sum), or max and min in one
    # NaN-propagating variadic reduction (arith.row_max_min).
    (
      "max, min and sum per bucket of 512 (three reductions), n=16M",
      _ms(
        lambda a: (
          jnp.max(a.reshape(-1, 512), axis=1),
          jnp.min(a.reshape(-1, 512), axis=1),
          jnp.sum(a.reshape(-1, 512), axis=1),
        ),
        s16,
        repeats=r,
      ),
    ),
    (
      "max and min per bucket of 512, one variadic reduction, n=16M",
      _ms(lambda a: arith.row_max_min(a.reshape(-1, 512)), s16, repeats=r),
    ),  # pylint: disable=protected-access
    (
      "sum(x*x) per bucket of 512, n=16M",
      _ms(lambda a: jnp.sum(jnp.square(a.reshape(-1, 512)), axis=1), s16, repeats=r),
    ),
    # OneBit's bucket statistics (buckets of 1024, n=4M, the packed signs given): one
    # variadic reduction of whole buckets, or two levels (rows of 32, then per bucket).
    (
      "OneBit bucket sums, one reduction per bucket of 1024, n=4M",
      _ms(
        lambda v, w: arith.onebit_sums(v, w, two_level=False),
        *onebit_args,  # pylint: disable=protected-access
        repeats=r,
      ),
    ),
    (
      "OneBit bucket sums, rows of 32 then per bucket, n=4M",
      _ms(
        lambda v, w: arith.onebit_sums(v, w, two_level=True),
        *onebit_args,  # pylint: disable=protected-access
        repeats=r,
      ),
    ),
    # Writing a fresh 64 MB output (every decode does) vs the same loop in place.
    ("x + 1 into a new buffer, n=16M", _ms(lambda a: a + 1.0, s16, repeats=r)),
    ("x + 1 in place (donated), n=16M", _donated_ms(s16, repeats=r)),
    # The new buffer's cost is glibc's: a block above its mmap threshold is mmapped per
    # call and unmapped when freed. With REUSE_MALLOC (a child process) it is reused.
    ("x + 1 into a new buffer, GLIBC_TUNABLES=REUSE_MALLOC, n=16M", reuse[0]),
    # A decoded mean that the optimizer reads three times: XLA:CPU fuses the decode
    # into each reader unless it is materialized (jaxcomp does, on CPU).
    (
      "QSGD4 decode of 2 payloads + clip/momentum/update, fused, n=1.77M",
      _ms(fused, *decode_args, repeats=r),
    ),
    (
      "the same, decode materialized (lax.cond), n=1.77M",
      _ms(materialized, *decode_args, repeats=r),
    ),
    (
      "UnbiasedSparsifier greedy λ (1%), n=1M",
      _ms(lambda a: jc.codecs.UnbiasedSparsifier(density=0.01).probabilities(a)[1], m1, repeats=r),
    ),
    (
      "greedy λ rounds alone (1%), one variadic reduction of rows of 16, n=1M",
      _ms(
        lambda a: jc.codecs.UnbiasedSparsifier(density=0.01)._lambda_normalized(  # pylint: disable=protected-access
          a / jnp.max(a)
        ),
        m1,
        repeats=r,
      ),
    ),
    (
      "greedy λ rounds alone (1%), two jnp.sum per round (before), n=1M",
      _ms(lambda a: _greedy_lambda_two_sums(a / jnp.max(a)), m1, repeats=r),
    ),
  ]
  print(
    f"jax {jax.__version__}, {jax.devices()[0].device_kind}, malloc: "
    f"{_timing.malloc_label()}, median of {r}\n"
  )
  print("| operation | ms |")
  print("|---|---:|")
  for name, ms in rows:
    print(f"| {name} | {ms:.1f} |")
  print(
    f"\nMinor page faults per call of x + 1 into a new 64 MB buffer (child processes; "
    f"16,384 pages of 4 KiB): glibc default {default[1]:,.0f} ({default[0]:.1f} ms), "
    f"GLIBC_TUNABLES=REUSE_MALLOC {reuse[1]:,.0f} ({reuse[0]:.1f} ms)."
  )


if __name__ == "__main__":
  main()
