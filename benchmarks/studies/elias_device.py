"""On-device Elias encoder vs the fixed-width QSGD encoder, and the host-callback decode.

  python -m benchmarks.studies.elias_device               # n = 2**16 .. 2**22
  python -m benchmarks.studies.elias_device --sizes 16,20

For each n (one bucket, l2 norm, s = √n, the paper's setting) it times, jitted on one
CPU device (median of ``--repeats`` after a warm-up): the fixed-width ``QSGD.encode``
(the baseline of the same run), ``EliasQSGD.encode`` (quantization + Elias coding into
the buffer) and ``EliasQSGD.decode`` (host callback), and prints values/s and ratios.
"""

from __future__ import annotations

import argparse
import math

import jax

from benchmarks._timing import median_time
import jaxcomp as jc


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="16,18,20,22", help="log2 of n, comma-separated")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; one bucket, l2, s = sqrt(n)")
  print()
  print(
    "| n | fixed encode (Mval/s) | Elias encode (Mval/s) | Elias/fixed time |"
    " Elias decode, host (Mval/s) | bits/value (Elias / fixed) |"
  )
  print("|---:|---:|---:|---:|---:|---:|")
  for e in (int(s) for s in args.sizes.split(",")):
    n = 2**e
    s = round(math.sqrt(n))
    elias = jc.codecs.EliasQSGD(s)
    fixed = elias.fallback
    x = jax.random.normal(jax.random.key(e), (n,))
    key = jax.random.key(1)
    enc_fixed = jax.jit(lambda v, k: fixed.encode(v, key=k))
    enc_elias = jax.jit(lambda v, k: elias.encode(v, key=k))
    dec_elias = jax.jit(elias.decode)
    t_fixed = median_time(enc_fixed, x, key, repeats=args.repeats)
    t_elias = median_time(enc_elias, x, key, repeats=args.repeats)
    payload = enc_elias(x, key)
    t_dec = median_time(dec_elias, payload, repeats=args.repeats)
    used = int(payload.arrays["used_bits"])
    print(
      f"| 2^{e} | {n / t_fixed / 1e6:.1f} | {n / t_elias / 1e6:.1f} |"
      f" {t_elias / t_fixed:.2f}x | {n / t_dec / 1e6:.2f} |"
      f" {used / n:.3f} / {fixed.wire_bits((n,)) / n:.3f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
