"""QSGD's Elias string: its length against Theorem 3.2 and the fixed width, and its speed.

  python -m benchmarks.studies.elias                    # n = 2^10..2^20, the demo CNN, timings
  python -m benchmarks.studies.elias --log2n 10,14 --keys 2 --no-cnn
  python -m benchmarks.studies.elias --inputs           # n = 4096, s = 64, 20 draws
  python -m benchmarks.studies.elias --device           # n = 2^16..2^22

By default, bits per coordinate of the Elias string (mean over ``--keys``
quantizations), of Theorem 3.2's bound (o(1) dropped) and of the fixed-width payload, on
Gaussian vectors and on the demo CNN's gradient at init; the length's spread at s = √n;
the host throughput of ``qsgd_to_bytes`` / ``qsgd_from_bytes``. ``--inputs``: bits per
value of each of :func:`inputs` against Corollary 3.3's 2.8n + 32. ``--device``: the
on-device ``EliasQSGD`` encode and its host decode against the fixed-width encode. The
tables: docs/methods/elias.md.
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
from benchmarks._timing import md_row
from benchmarks._timing import median_time
from benchmarks.studies import compressed
from benchmarks.studies import init_grads
import jaxcomp as jc
from jaxcomp import elias

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

  def row(label, n, bits, bound, fixed):
    return md_row(label, n, f"{bits / n:.3f}", bound, f"{fixed / n:.3f}", f"{bits / fixed:.3f}")

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
      lines.append(row(f"{label} {tuple(g.shape)}", n, bits, shown, fixed))
    n, bits, bound, fixed = tot
    shown = "–" if fixed_codec is not None and fixed_codec.norm != "l2" else f"{bound / n:.3f}"
    lines.append(row("**all compressed leaves**", int(n), bits, shown, fixed))
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
    speed = lambda t: (f"{n / t:,.0f}", f"{len(data) / 1e6 / t:.2f}, {4 * n / 1e6 / t:.1f}")
    buckets = "one bucket" if codec.bucket_size is None else f"buckets of {codec.bucket_size}"
    label = f"s={codec.levels}, {codec.norm}, {buckets}"
    lines.append(md_row(label, f"{8 * (len(data) - 4) / n:.3f}", *speed(enc), *speed(dec)))
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
    cells = (f"{v:.3f}" for v in (bits.mean(), bits.std(), bits.max()))
    lines.append(md_row(f"2^{e}", *cells, f"{over:.2f}"))
  return "\n".join(lines)


def inputs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
  """The named test vectors of ``--inputs``, of length ``n`` (even)."""
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


def inputs_table(n: int, s: int, draws: int) -> str:
  """Bits per value, one row per input of :func:`inputs`, and the dense bound's line."""
  codec = C.QSGD(s, bucket_size=None, norm="l2")
  keys = jax.random.split(jax.random.key(1), draws)
  head = f"input (n = {n}, s = {s}) | mean bits / n | max bits / n | strings over 2.8n + 32"
  rows = [md_head(head)]
  for name, x in inputs(n).items():
    bits = np.array(_bits(codec, x.astype(np.float32), keys))
    over = np.mean(bits > 2.8 * n + 32)
    rows.append(md_row(name, f"{bits.mean() / n:.3f}", f"{bits.max() / n:.3f}", f"{over:.0%}"))
  rows += ["", f"dense_bound(n, s) / n = {elias.dense_bound(n, s) / n:.3f}"]
  return "\n".join(rows)


def device_table(log2n: list[int], repeats: int) -> None:
  """Prints the speed of the on-device encoder and the host decode against fixed width."""
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; one bucket, l2, s = sqrt(n)\n")
  head = "n | fixed encode (Mval/s) | Elias encode (Mval/s) | Elias/fixed time"
  print(md_head(head + " | Elias decode, host (Mval/s) | bits/value (Elias / fixed)", "r" * 6))
  for e in log2n:
    n = 2**e
    codec = C.EliasQSGD(round(math.sqrt(n)))
    x, key = jax.random.normal(jax.random.key(e), (n,)), jax.random.key(1)
    t_fixed, t_elias = (
      median_time(jax.jit(lambda v, k, c=c: c.encode(v, key=k)), x, key, repeats=repeats)
      for c in (codec.fallback, codec)
    )
    payload = jax.jit(lambda v, k: codec.encode(v, key=k))(x, key)
    t_dec = median_time(jax.jit(codec.decode), payload, repeats=repeats)
    used = int(payload.arrays["used_bits"])
    speeds = (f"{n / t_fixed / 1e6:.1f}", f"{n / t_elias / 1e6:.1f}", f"{t_elias / t_fixed:.2f}x")
    bits = f"{used / n:.3f} / {codec.fallback.wire_bits((n,)) / n:.3f}"
    print(md_row(f"2^{e}", *speeds, f"{n / t_dec / 1e6:.2f}", bits), flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  part = parser.add_mutually_exclusive_group()
  what = "instead of the string's length"
  part.add_argument("--inputs", action="store_true", help=f"the inputs' table, {what}")
  part.add_argument("--device", action="store_true", help=f"the device encoder, {what}")
  parser.add_argument(
    "--log2n", type=ints, help="exponents of n (10,12,...,20; with --device 16,18,20,22)"
  )
  parser.add_argument("--keys", type=int, default=3, help="quantizations averaged per row")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
  parser.add_argument("--workdir", default="/tmp/elias_data", help="MNIST-1D cache")
  parser.add_argument("--no-cnn", action="store_true", help="skip the CNN gradients")
  parser.add_argument("--draws", type=int, default=20, help="draws of the spread and inputs")
  parser.add_argument("--n", type=int, default=4096, help="--inputs: values per vector (even)")
  parser.add_argument("--s", type=int, default=64, help="--inputs: quantization levels")
  args = parser.parse_args(argv)
  if args.inputs:
    if args.n < 2 or args.n % 2:
      parser.error(f"--n must be even and at least 2, got {args.n}")
    print(inputs_table(args.n, args.s, args.draws))
    return
  if args.device:
    device_table(args.log2n or [16, 18, 20, 22], args.repeats)
    return
  log2n = args.log2n or [10, 12, 14, 16, 18, 20]
  print(
    f"jax {jax.__version__}, {jax.devices()[0].platform}; bits/coord = bits / n; "
    f"fixed = codec.bits per value + 32 per bucket; Theorem 3.2 without its o(1)\n"
  )
  print("### Gaussian vectors, one l2 bucket\n")
  print(gaussian_table(log2n, args.keys))
  if not args.no_cnn:  # (the data set's line first)
    grads = {p: np.asarray(g, np.float32) for p, g in compressed(init_grads(args.workdir)[1])}
    print("\n### Demo CNN (MNIST-1D) gradient at init, batch 256\n")
    print(cnn_tables(grads, args.keys))
  print("\n### Length spread at s = sqrt(n)\n")
  print(spread_table([10, 12, 16], args.draws))
  print("\n### Host throughput (qsgd_to_bytes / qsgd_from_bytes)\n")
  print(throughput_table(max(log2n), args.repeats))


if __name__ == "__main__":
  main()
