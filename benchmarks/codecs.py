r"""Throughput of every codec's encode, decode and encode+decode on this machine.

Each row is timed next to the *read roof*, ``jnp.sum(x)`` over the same float32 array in
the same run, and a copy (``x + 1``); GB/s counts the 4n input bytes. Rows named
``*_xla`` pin the XLA path; the others run what a codec runs by default (on a CPU the
native kernels of :mod:`jaxcomp.kernels.cpu` for QSGD and OneBit). ``--error`` prints
each of :data:`ERROR_CODECS`' error instead. Tables and what they show:
docs/benchmarks.md ("Codec throughput on CPU", "FP8 codecs"); ``--rounds`` and
``--reuse-malloc``: docs/guides/kernels.md ("Large outputs on XLA:CPU").

  python -m benchmarks.codecs                       # 1M..64M, every codec
  python -m benchmarks.codecs --sizes 22,24 --codecs qsgd4,onebit --repeats 5 --rng
  python -m benchmarks.codecs --sizes 22 --codecs qsgd4,onebit --ops   # what limits them
  python -m benchmarks.codecs --codecs identity,qsgd4,onebit --rounds 7 --reuse-malloc
  python -m benchmarks.codecs --error --sizes 20   # FP8 vs int8 blocks vs QSGD: error
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _timing
from benchmarks._timing import ints
from benchmarks._timing import md_head
from benchmarks._timing import md_row
from benchmarks._timing import median_time
import jaxcomp as jc
from jaxcomp._src.plumbing import rng
from jaxcomp.kernels import cpu as cpu_kernels

C = jc.codecs

#: name -> (codec, largest log2 size it is run at: slow codecs stop early).
CODECS = {
  "identity": (C.Identity(), 26),
  "bf16": (C.Cast(jnp.bfloat16), 26),
  "fp16": (C.Cast(jnp.float16), 26),
  "qsgd8": (C.QSGD(127, 512, "max"), 26),
  "qsgd8_xla": (C.QSGD(127, 512, "max", implementation="xla"), 26),
  "qsgd4": (C.QSGD(7, 512, "max"), 26),
  "qsgd4_xla": (C.QSGD(7, 512, "max", implementation="xla"), 26),
  "qsgd2": (C.QSGD(1, 128, "max"), 26),
  "qsgd2_xla": (C.QSGD(1, 128, "max", implementation="xla"), 26),
  "qsgd4_l2": (C.QSGD(7, 512, "l2"), 26),
  "onebit": (C.OneBit(1024), 26),
  "onebit_xla": (C.OneBit(1024, implementation="xla"), 26),
  "normal8": (C.NormalQuantizer(256), 24),
  "topk0.1%": (C.TopK(0.001), 24),
  "randomk1%": (C.RandomK(0.01), 24),
  "wangni5%": (C.UnbiasedSparsifier(density=0.05), 24),
  "elias_qsgd4": (C.EliasQSGD(7, 512, "max"), 22),
  "int8": (C.BlockInt8(), 26),
  "fp8": (C.Float8(), 26),
  "fp8_sr": (C.Float8(rounding="stochastic"), 26),
}

#: name -> codec, for ``--error``: FP8 (block 32 and per tensor, nearest and stochastic)
#: against int8 blocks and 4-bit QSGD.
ERROR_CODECS = {
  **{
    f"fp8_{fmt}{'_tensor' if block is None else ''}{'_sr' if sr else ''}": C.Float8(
      fmt, block, "stochastic" if sr else "nearest"
    )
    for fmt in ("e4m3", "e5m2")
    for block in (32, None)
    for sr in (False, True)
  },
  "int8_256": C.BlockInt8(256),
  "int8_32": C.BlockInt8(32),
  "qsgd4": C.QSGD(7, 512, "max"),
}


def error_table(p: int) -> None:
  """Prints each of :data:`ERROR_CODECS`' errors on 2^p values of three distributions."""
  n = 2**p
  head = "values | codec | bits/value | relative RMS error | max error / max value"
  print(md_head(head + " | median relative error", align="llrrrr"))
  for dist in ("gaussian", "student_t3", "log_uniform"):
    kx, ks = jax.random.split(jax.random.key(p))
    x = jax.random.t(kx, 3.0, (n,)) if dist == "student_t3" else jax.random.normal(kx, (n,))
    if dist == "log_uniform":  # magnitudes spread evenly over 6 decades, value by value
      x = x * jnp.exp(jax.random.uniform(ks, (n,), minval=-7.0, maxval=7.0))
    x64 = np.asarray(x, np.float64)
    for name, codec in ERROR_CODECS.items():
      y = np.asarray(jax.jit(lambda x, c=codec: c.decode(c.encode(x, key=jax.random.key(1))))(x))
      err = np.abs(y.astype(np.float64) - x64)
      rms = np.linalg.norm(err) / np.linalg.norm(x64)
      rel = np.median(err[x64 != 0] / np.abs(x64[x64 != 0]))
      errors = (f"{e:.2e}" for e in (rms, err.max() / np.abs(x64).max(), rel))
      print(md_row(dist, name, f"{codec.wire_bits((n,)) / n:.3f}", *errors), flush=True)


def rng_times(n: int, repeats: int) -> tuple[float, float, float, float]:
  """Seconds to draw n random values, threefry (jax.random) vs jaxcomp's hash: summed
  as uniforms (a reduction with a prologue: XLA:CPU's slow path), then written as one
  byte each (an elementwise pass, which is what the hash costs inside QSGD's encode)."""
  draws = (
    lambda k: jnp.sum(jax.random.uniform(k, (n,), jnp.float32)),
    lambda k: jnp.sum(rng.uniform(k, (n,))),
    lambda k: jax.random.bits(k, (n,), jnp.uint32).astype(jnp.uint8),
    lambda k: rng.bits24(k, (n,)).astype(jnp.uint8),
  )
  return tuple(median_time(jax.jit(f), jax.random.key(0), repeats=repeats) for f in draws)


READ = jax.jit(jnp.sum)


def time_codec(
  codec, x: jax.Array, key: jax.Array, repeats: int, rounds: int = 1
) -> tuple[float, float, float, list[float]]:
  """Median seconds of (encode, decode, encode+decode), each jitted on its own, and
  ``rounds`` shares of the read roof: read time over encode+decode time, the two timed
  back to back in each round (so that a slow spell of a shared host hits both)."""
  encode = jax.jit(lambda a, k: codec.encode(a, key=k))
  decode = jax.jit(codec.decode)
  both = jax.jit(lambda a, k: codec.decode(codec.encode(a, key=k)))
  calls = ((encode, x, key), (decode, encode(x, key)), (both, x, key))
  times = tuple(median_time(*call, repeats=repeats) for call in calls)
  shares = []
  for _ in range(rounds - 1):
    read = median_time(READ, x, repeats=repeats)
    shares.append(read / median_time(both, x, key, repeats=repeats))
  return (*times, shares)


def share_cell(shares: list[float]) -> str:
  """The "% read roof" cell: one share, or the median and range of several."""
  pct = sorted(100 * s for s in shares)
  if len(pct) == 1:
    return f"{pct[0]:.0f}"
  return f"{statistics.median(pct):.0f} ({pct[0]:.0f}–{pct[-1]:.0f})"


def top_ops(codec, x: jax.Array, key: jax.Array) -> tuple[float, list[tuple[str, float]]]:
  """(median seconds, five costliest ops as (name, seconds)) of decode(encode(x))."""
  both = jax.jit(lambda a, k: codec.decode(codec.encode(a, key=k))).lower(x, key).compile()

  def run():
    jax.block_until_ready(both(x, key))

  run()
  prof = jc.profile_phases(run, both, calls=10)
  ops = sorted((op for p in prof.top_ops.values() for op in p), key=lambda o: -o[1])
  return prof.step_s, ops[:5]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=ints, default="20,22,24,26", help="log2 of n")
  parser.add_argument(
    "--codecs", default=",".join(CODECS), help="subset of " + ",".join(CODECS).replace("%", "%%")
  )
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument(
    "--rounds", type=int, default=1, help="share of the read roof: median (range) of R timings"
  )
  parser.add_argument("--rng", action="store_true", help="also time threefry vs the hash")
  parser.add_argument("--ops", action="store_true", help="also list each codec's costliest ops")
  parser.add_argument("--error", action="store_true", help="print the error table instead")
  parser.add_argument(
    "--reuse-malloc", action="store_true", help="restart with GLIBC_TUNABLES reusing buffers"
  )
  args = parser.parse_args(argv)
  if args.repeats < 1 or args.rounds < 1:
    parser.error("--repeats and --rounds must be at least 1")
  if args.error:
    error_table(args.sizes[0])
    return
  if args.reuse_malloc:
    _timing.reexec_with_reused_malloc()
  names = args.codecs.split(",")
  unknown = sorted(set(names) - set(CODECS))
  if unknown:
    parser.error(f"unknown codecs {unknown}; expected a subset of {list(CODECS)}")

  native = "on" if cpu_kernels.use_by_default() else "off"
  print(
    f"jax {jax.__version__}, {jax.devices()[0].platform}, "
    f"{jax.local_device_count()} device(s) visible, malloc: {_timing.malloc_label()}, "
    f"native CPU kernels: {native}; median of {args.repeats}"
    + (f"; % read roof: median (range) of {args.rounds} rounds" if args.rounds > 1 else "")
  )
  head = "n | codec | encode (GB/s) | decode (GB/s) | enc+dec (GB/s) | enc+dec (Mval/s)"
  print(md_head(head + " | % read roof | bits/value", align="rlrrrrrr"))
  profiled = []
  for p in args.sizes:
    n = 2**p
    x = jax.random.normal(jax.random.key(p), (n,), jnp.float32)
    key = jax.random.key(1)
    gb = 4 * n / 1e9
    read = median_time(READ, x, repeats=args.repeats)
    copy = median_time(jax.jit(lambda a: a + 1.0), x, repeats=args.repeats)
    for what, t in (("read roof: sum(x)", read), ("copy: x + 1", copy)):
      cells = (f"{gb / t:.2f}", "", "", f"{n / t / 1e6:.0f}", f"{100 * read / t:.0f}", "")
      print(md_row(f"2^{p}", f"*{what}*", *cells))
    if args.rng:
      kinds = ("sum of uniforms", "random bits to uint8")
      for i, t in enumerate(rng_times(n, args.repeats)):
        share = f"{100 * read / t:.0f}" if i >= 2 else ""
        what = f"{kinds[i // 2]}: {('threefry', 'jaxcomp hash')[i % 2]}"
        print(md_row(f"2^{p}", f"*{what}*", "", "", "", f"{n / t / 1e6:.0f}", share, ""))
    for name in names:
      codec, max_p = CODECS[name]
      if p > max_p:
        continue
      enc, dec, both, shares = time_codec(codec, x, key, args.repeats, args.rounds)
      bits = codec.wire_bits((n,)) / n
      speeds = (f"{gb / t:.2f}" for t in (enc, dec, both))
      cells = (f"{n / both / 1e6:.0f}", share_cell([read / both, *shares]), f"{bits:.3f}")
      print(md_row(f"2^{p}", name, *speeds, *cells), flush=True)
      if args.ops:
        step, ops = top_ops(codec, x, key)
        profiled.append((p, name, step, read, ops))
  for p, name, step, read, ops in profiled:
    print(
      f"\n2^{p} {name}: decode(encode(x)) {1e3 * step:.2f} ms under the profiler, read "
      f"roof {1e3 * read:.2f} ms; costliest ops: "
      + ", ".join(f"{op} {1e3 * t:.2f} ms" for op, t in ops)
    )


if __name__ == "__main__":
  main()
