"""On-device Elias encoder vs the fixed-width QSGD encoder, and the host-callback decode.

  python -m benchmarks.studies.elias_device               # n = 2**16 .. 2**22
  python -m benchmarks.studies.elias_device --sizes 16,20

Per n (one bucket, l2, s = √n), jitted on one CPU device: the fixed-width
``QSGD.encode`` (the same run's baseline), ``EliasQSGD.encode`` and ``EliasQSGD.decode``
(a host callback). Results: docs/methods/elias.md.
"""

from __future__ import annotations

import argparse
import math

import jax

from benchmarks._timing import ints
from benchmarks._timing import md_head
from benchmarks._timing import median_time
import jaxcomp as jc


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=ints, default="16,18,20,22", help="log2 of n")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; one bucket, l2, s = sqrt(n)")
  print()
  head = "n | fixed encode (Mval/s) | Elias encode (Mval/s) | Elias/fixed time"
  print(md_head(head + " | Elias decode, host (Mval/s) | bits/value (Elias / fixed)", "r" * 6))
  for e in args.sizes:
    n = 2**e
    s = round(math.sqrt(n))
    elias = jc.codecs.EliasQSGD(s)
    fixed = elias.fallback
    x = jax.random.normal(jax.random.key(e), (n,))
    key = jax.random.key(1)
    t_fixed, t_elias = (
      median_time(jax.jit(lambda v, k, c=c: c.encode(v, key=k)), x, key, repeats=args.repeats)
      for c in (fixed, elias)
    )
    payload = jax.jit(lambda v, k: elias.encode(v, key=k))(x, key)
    t_dec = median_time(jax.jit(elias.decode), payload, repeats=args.repeats)
    used = int(payload.arrays["used_bits"])
    print(
      f"| 2^{e} | {n / t_fixed / 1e6:.1f} | {n / t_elias / 1e6:.1f} |"
      f" {t_elias / t_fixed:.2f}x | {n / t_dec / 1e6:.2f} |"
      f" {used / n:.3f} / {fixed.wire_bits((n,)) / n:.3f} |",
      flush=True,
    )


if __name__ == "__main__":
  main()
