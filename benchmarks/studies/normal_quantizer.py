"""MIPD's normal quantizer against uniform quantizers with the same bits.

  python -m benchmarks.studies.normal_quantizer

Mean squared error of ``jc.codecs.NormalQuantizer`` (outliers beyond 3σ exact) next to
``qsgd`` (``QSGD(2**(b-1)-1, norm="max")``, stochastic) and ``minmax`` (``2**b`` levels over
[min, max], nearest) with the same bits, measured in the same run: on N(0, 1) data, then
per compressed kernel of the demo CNN's gradient at init (all entries and the 50%
largest), with the share beyond 3σ and the normal quantizer's real wire bits per value.
Results: docs/methods/mipd.md, "Mean squared errors".
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import md_head
from benchmarks._timing import md_row
from benchmarks.studies import compressed
from benchmarks.studies import init_grads
import jaxcomp as jc


def _uniform_minmax(x: np.ndarray, bits: int) -> np.ndarray:
  lo, hi = x.min(), x.max()
  step = (hi - lo) / (2**bits - 1)
  return lo + np.round((x - lo) / step) * step if step > 0 else x


def normal_bits(x: np.ndarray, bits: int) -> float:
  """Wire bits per value of the normal quantizer with exactly the needed outlier slots."""
  beyond = int(np.sum(np.abs(x - x.mean()) > 3 * x.std()))
  q = jc.codecs.NormalQuantizer(intervals=2**bits, outlier_fraction=max(beyond, 1) / x.size)
  return q.wire_bits(x.shape) / x.size


def mses(x: np.ndarray, bits: int, key) -> tuple[float, float, float]:
  """(normal, qsgd, minmax) mean squared errors on the flat float32 ``x``."""
  xj = jnp.asarray(x)
  q = jc.codecs.NormalQuantizer(intervals=2**bits, outlier_fraction=1.0)
  u = jc.codecs.QSGD(levels=2 ** (bits - 1) - 1, norm="max")
  e_n = float(jnp.mean((q.decode(q.encode(xj)) - xj) ** 2))
  e_q = float(jnp.mean((u.decode(u.encode(xj, key=key)) - xj) ** 2))
  e_m = float(np.mean((_uniform_minmax(x, bits) - x) ** 2))
  return e_n, e_q, e_m


def main() -> None:
  key = jax.random.key(0)
  x = np.asarray(jax.random.normal(key, (1 << 20,)))
  print("N(0, 1), 2^20 values: MSE")
  head = "bits | normal | qsgd (stochastic) | minmax (nearest) | normal/qsgd | normal/minmax"
  print(md_head(head + " | normal bits/value", "r" * 7))
  for bits in (3, 4, 6, 8):
    n, q, m = mses(x, bits, jax.random.key(bits))
    ratios = (f"{r:.2f}" for r in (n / q, n / m, normal_bits(x, bits)))
    print(md_row(bits, *(f"{e:.3g}" for e in (n, q, m)), *ratios))

  grads = init_grads(os.path.join("runs", "mnist1d"))[1]
  print("\nDemo CNN gradients at init (batch 256), 8-bit codes: MSE ratios")
  head = "kernel | n | subset | beyond 3σ | normal/qsgd | normal/minmax | normal bits/value"
  print(md_head(head, "lrlrrrr"))
  for path, g in compressed(grads):
    flat = np.asarray(g, np.float32).ravel()
    top = flat[np.argsort(-np.abs(flat))[: flat.size // 2]]
    for name, v in (("all", flat), ("top 50%", top)):
      beyond = float(np.mean(np.abs(v - v.mean()) > 3 * v.std()))
      n, q, m = mses(v, 8, jax.random.key(1))
      ratios = (f"{r:.2f}" for r in (n / q, n / m, normal_bits(v, 8)))
      print(md_row(path, f"{v.size:,}", name, f"{100 * beyond:.2f}%", *ratios))


if __name__ == "__main__":
  main()
