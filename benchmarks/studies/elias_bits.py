"""Length of QSGD's Elias string vs the Theorem 3.2 bound and the fixed-width payload.

  python -m benchmarks.studies.elias_bits                    # n = 2^10..2^20, the demo CNN, timings
  python -m benchmarks.studies.elias_bits --log2n 10,14 --keys 2 --no-cnn

Prints bits per coordinate of the Elias string (:func:`jaxcomp._src.codecs.elias.stream_bits`,
mean over ``--keys`` quantizations), of Theorem 3.2's bound (o(1) dropped) and of the
fixed-width payload: on Gaussian vectors (one l2 bucket, s = 1, 3, 7, 15, √n), on the
demo CNN's gradient at init under four codecs, the length's spread at s = √n, and the
host throughput of ``qsgd_to_bytes`` / ``qsgd_from_bytes``. The tables:
docs/methods/elias.md, "Bits per coordinate and throughput".
"""

from __future__ import annotations

import argparse
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import ints
from benchmarks._timing import md_head
from benchmarks._timing import median_time
from benchmarks.studies import compressed
from benchmarks.studies import init_grads
import jaxcomp as jc
from jaxcomp._src.codecs import elias

C = jc.codecs


def _dense(n: int):
  """The paper's dense regime: one l2 bucket, s = round(√n)."""
  return C.QSGD(round(math.sqrt(n)), bucket_size=None, norm="l2")


def _bits(codec, x, keys) -> list[int]:
  """The Elias string's length of each of ``len(keys)`` quantizations of ``x``."""
  encode = jax.jit(jax.vmap(lambda x, k: codec.encode(x, key=k), in_axes=(None, 0)))
  payloads = encode(jnp.asarray(x), keys)
  rows = [jax.tree.map(lambda a, i=i: a[i], payloads) for i in range(len(keys))]
  return [elias.stream_bits(codec, p) for p in rows]


def _bound_bits(codec, n: int) -> float | None:
  """Theorem 3.2 summed over the buckets (l2 norm only)."""
  if codec.norm != "l2":
    return None
  b = n if codec.bucket_size is None else min(codec.bucket_size, n)
  full, rest = divmod(n, b)
  total = full * elias.theorem_3_2_bound(b, codec.levels)
  return total + (elias.theorem_3_2_bound(rest, codec.levels) if rest else 0.0)


def _gaussian(e: int) -> np.ndarray:
  return np.random.default_rng(e).standard_normal(2**e).astype(np.float32)


def gaussian_table(log2n: list[int], num_keys: int) -> str:
  keys = jax.random.split(jax.random.key(0), num_keys)
  head = "n | s | Elias bits/coord | Theorem 3.2 bits/coord | fixed bits/coord | Elias / fixed"
  lines = [md_head(head + " | ≤ 2.8n + 32", align="rrrrrrc")]
  for e in log2n:
    n, root = 2**e, round(math.sqrt(2**e))
    for s in sorted({1, 3, 7, 15, root}):
      codec = C.QSGD(s, bucket_size=None, norm="l2")
      bits = statistics.mean(_bits(codec, _gaussian(e), keys))
      fixed = codec.wire_bits((n,))
      dense = ("yes" if bits <= 2.8 * n + 32 else "**no**") if s == root else ""
      label = f"{s} (√n)" if s == root else str(s)
      lines.append(
        f"| 2^{e} | {label} | {bits / n:.3f} | "
        f"{elias.theorem_3_2_bound(n, s) / n:.3f} | {fixed / n:.3f} | "
        f"{bits / fixed:.3f} | {dense} |"
      )
  return "\n".join(lines)


CNN_CODECS = {
  "paper dense: l2, one bucket, s = round(√n)": None,
  "l2, one bucket, s = 7": C.QSGD(7, bucket_size=None, norm="l2"),
  "demo qsgd4: max, buckets of 512, s = 7": C.QSGD(7, bucket_size=512, norm="max"),
  "demo qsgd2: max, buckets of 128, s = 1": C.QSGD(1, bucket_size=128, norm="max"),
}


def cnn_tables(grads: dict[str, np.ndarray], num_keys: int) -> str:
  """One table per codec of :data:`CNN_CODECS`, one row per leaf and one for all."""
  keys = jax.random.split(jax.random.key(1), num_keys)
  out = []
  for name, fixed_codec in CNN_CODECS.items():
    head = "leaf | n | Elias bits/coord | Theorem 3.2 bits/coord | fixed bits/coord"
    lines = [f"**{name}**", "", md_head(head + " | Elias / fixed")]
    tot = np.zeros(4)  # n, Elias bits, bound bits, fixed bits
    for path, g in grads.items():
      n = g.size
      codec = fixed_codec or _dense(n)
      bits = statistics.mean(_bits(codec, g.reshape(-1), keys))
      fixed, bound = codec.wire_bits((n,)), _bound_bits(codec, n)
      tot += (n, bits, bound or 0.0, fixed)
      shown = "–" if bound is None else f"{bound / n:.3f}"
      label = path + (f" (s={codec.levels})" if fixed_codec is None else "")
      lines.append(
        f"| {label} {tuple(g.shape)} | {n} | {bits / n:.3f} | {shown} | "
        f"{fixed / n:.3f} | {bits / fixed:.3f} |"
      )
    n, bits, bound, fixed = tot
    shown = "–" if fixed_codec is not None and fixed_codec.norm != "l2" else f"{bound / n:.3f}"
    lines.append(
      f"| **all compressed leaves** | {int(n)} | {bits / n:.3f} | {shown} | "
      f"{fixed / n:.3f} | {bits / fixed:.3f} |"
    )
    out.append("\n".join(lines))
  return "\n\n".join(out)


def throughput_table(log2n: int, repeats: int) -> str:
  n = 2**log2n
  x = jnp.asarray(np.random.default_rng(0).standard_normal(n).astype(np.float32))
  head = "codec | bits/coord | encode values/s | encode MB/s (string, float32 input)"
  lines = [
    f"n = 2^{log2n}, median of {repeats} runs",
    "",
    md_head(head + " | decode values/s | decode MB/s (string, float32 input)"),
  ]
  for codec in (_dense(n), *list(CNN_CODECS.values())[1:]):
    payload = jax.jit(lambda v, k, c=codec: c.encode(v, key=k))(x, jax.random.key(0))
    payload = jax.tree.map(np.asarray, payload)
    data = elias.qsgd_to_bytes(codec, payload)
    back = elias.qsgd_from_bytes(codec, data, (n,))
    assert np.array_equal(np.asarray(codec.decode(back)), np.asarray(codec.decode(payload)))
    enc = median_time(lambda c=codec, p=payload: elias.qsgd_to_bytes(c, p), repeats=repeats)
    dec = median_time(lambda c=codec, d=data: elias.qsgd_from_bytes(c, d, (n,)), repeats=repeats)
    mb = len(data) / 1e6
    buckets = "one bucket" if codec.bucket_size is None else f"buckets of {codec.bucket_size}"
    lines.append(
      f"| s={codec.levels}, {codec.norm}, {buckets} | {8 * (len(data) - 4) / n:.3f} | "
      f"{n / enc:,.0f} | {mb / enc:.2f}, {4 * n / 1e6 / enc:.1f} | {n / dec:,.0f} | "
      f"{mb / dec:.2f}, {4 * n / 1e6 / dec:.1f} |"
    )
  return "\n".join(lines)


def spread_table(log2n: list[int], draws: int) -> str:
  """Mean and spread of the string length at s = sqrt(n) over ``draws`` quantizations."""
  lines = [
    f"s = round(sqrt(n)), l2, one bucket; {draws} draws of the quantization",
    "",
    md_head("n | mean bits/coord | std bits/coord | max bits/coord | share > 2.8n + 32", "r" * 5),
  ]
  for e in log2n:
    n = 2**e
    keys = jax.random.split(jax.random.key(1), draws)
    bits = np.array(_bits(_dense(n), _gaussian(e), keys)) / n
    over = np.mean(bits * n > 2.8 * n + 32)
    lines.append(
      f"| 2^{e} | {bits.mean():.3f} | {bits.std():.3f} | {bits.max():.3f} | {over:.2f} |"
    )
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--log2n", type=ints, default="10,12,14,16,18,20", help="exponents of n, Gaussian table"
  )
  parser.add_argument("--keys", type=int, default=3, help="quantizations averaged per row")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
  parser.add_argument("--workdir", default="/tmp/elias_data", help="MNIST-1D cache")
  parser.add_argument("--no-cnn", action="store_true", help="skip the CNN gradients")
  parser.add_argument("--draws", type=int, default=20, help="draws of the spread table")
  args = parser.parse_args()
  print(
    f"jax {jax.__version__}, {jax.devices()[0].platform}; bits/coord = bits / n; "
    f"fixed = codec.bits per value + 32 per bucket; Theorem 3.2 without its o(1)\n"
  )
  print("### Gaussian vectors, one l2 bucket\n")
  print(gaussian_table(args.log2n, args.keys))
  if not args.no_cnn:  # (the data set's line first)
    grads = {p: np.asarray(g, np.float32) for p, g in compressed(init_grads(args.workdir)[1])}
    print("\n### Demo CNN (MNIST-1D) gradient at init, batch 256\n")
    print(cnn_tables(grads, args.keys))
  print("\n### Length spread at s = sqrt(n)\n")
  print(spread_table([10, 12, 16], args.draws))
  print("\n### Host throughput (qsgd_to_bytes / qsgd_from_bytes)\n")
  print(throughput_table(max(args.log2n), args.repeats))


if __name__ == "__main__":
  main()
