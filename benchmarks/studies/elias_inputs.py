"""Length of QSGD's Elias string on inputs of different shapes, against 2.8n + 32.

  python -m benchmarks.studies.elias_inputs                  # n = 4096, s = 64, 20 draws
  python -m benchmarks.studies.elias_inputs --n 1024 --draws 4

Per input (sign vector, alternating magnitudes, uniform, Gaussian, Laplace, Student-t
1.5, one-hot): mean and largest bits per value over ``--draws`` quantizations (l2, one
bucket), the share over Corollary 3.3's 2.8n + 32, and ``elias.dense_bound(n, s) / n``.
Results: docs/methods/elias.md.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import md_head
import jaxcomp as jc


def inputs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
  """The named test vectors of length ``n`` (even)."""
  rng = np.random.default_rng(seed)
  signs = rng.choice([-1.0, 1.0], n)
  return {
    "equal magnitudes (sign vector)": signs,
    "alternating magnitudes 2, 1": signs * np.tile([2.0, 1.0], n // 2),
    "uniform": rng.uniform(-1, 1, n),
    "Gaussian": rng.standard_normal(n),
    "Laplace": rng.laplace(size=n),
    "Student-t, 1.5 d.o.f.": rng.standard_t(1.5, n),
    "one-hot": np.eye(n)[7],
  }


def table(n: int, s: int, draws: int) -> str:
  """The Markdown table of bits per value, one row per input, and the bound's line."""
  codec = jc.codecs.QSGD(s, bucket_size=None, norm="l2")
  encode = jax.jit(jax.vmap(lambda x, k: codec.encode(x, key=k), in_axes=(None, 0)))
  rows = [
    md_head(f"input (n = {n}, s = {s}) | mean bits / n | max bits / n | strings over 2.8n + 32")
  ]
  for name, x in inputs(n).items():
    payloads = encode(jnp.asarray(x, jnp.float32), jax.random.split(jax.random.key(1), draws))
    bits = np.array(
      [
        jc.elias.stream_bits(codec, jax.tree.map(lambda a, i=i: a[i], payloads))
        for i in range(draws)
      ]
    )
    rows.append(
      f"| {name} | {bits.mean() / n:.3f} | {bits.max() / n:.3f} | "
      f"{np.mean(bits > 2.8 * n + 32):.0%} |"
    )
  rows += ["", f"dense_bound(n, s) / n = {jc.elias.dense_bound(n, s) / n:.3f}"]
  return "\n".join(rows)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=4096, help="values per vector (even)")
  parser.add_argument("--s", type=int, default=64, help="quantization levels")
  parser.add_argument("--draws", type=int, default=20, help="quantizations per input")
  args = parser.parse_args(argv)
  if args.n < 2 or args.n % 2:
    parser.error(f"--n must be even and at least 2, got {args.n}")
  print(table(args.n, args.s, args.draws))


if __name__ == "__main__":
  main()
