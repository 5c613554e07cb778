"""Length of QSGD's Elias string vs the Theorem 3.2 bound and the fixed-width payload.

  python -m benchmarks.studies.elias_bits                    # n = 2^10..2^20, the demo CNN, timings
  python -m benchmarks.studies.elias_bits --log2n 10,14 --keys 2 --no-cnn

Three Markdown tables:

1. Gaussian vectors, one bucket, l2 norm (the paper's setting), for n = 2^10..2^20 and
   s = 1, 3, 7, 15, sqrt(n): bits per coordinate of the Elias string (mean over
   ``--keys`` quantizations; :func:`jaxcomp._src.codecs.elias.stream_bits`), of Theorem 3.2's
   bound (o(1) dropped), and of the fixed-width payload (``codec.bits`` per value and 32
   per bucket), and at s = sqrt(n) whether the mean is below Corollary 3.3's 2.8n + 32.
2. The gradient of the demo's CNN (examples/mnist1d, default config) at initialisation on
   a batch of 256, for the leaves jaxcomp compresses by default and overall, under four
   codecs: the paper's dense regime (l2, one bucket per leaf, s = round(sqrt(n))), l2 with
   s = 7, and the demo's qsgd4 (max norm, buckets of 512, s = 7) and qsgd2 (max, 128,
   s = 1). Theorem 3.2 needs the l2 norm; with the max norm it does not apply.
3. Host throughput of :func:`qsgd_to_bytes` and :func:`qsgd_from_bytes` at n = 2^20 (the
   payload's unpacking and packing included): values/s, and MB/s of the string and of the
   float32 input it stands for (median of ``--repeats`` runs).
"""

from __future__ import annotations

import argparse
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import median_time
import jaxcomp as jc
from jaxcomp._src.codecs import elias

C = jc.codecs


def _encoder(codec):
  return jax.jit(jax.vmap(lambda x, k: codec.encode(x, key=k), in_axes=(None, 0)))


def _rows(payloads, count):
  return [jax.tree.map(lambda a, i=i: a[i], payloads) for i in range(count)]


def _mean_bits(codec, x, keys) -> float:
  payloads = _encoder(codec)(jnp.asarray(x), keys)
  return statistics.mean(elias.stream_bits(codec, p) for p in _rows(payloads, len(keys)))


def _bound_bits(codec, n: int) -> float | None:
  """Theorem 3.2 summed over the buckets (l2 norm only)."""
  if codec.norm != "l2":
    return None
  b = n if codec.bucket_size is None else min(codec.bucket_size, n)
  full, rest = divmod(n, b)
  total = full * elias.theorem_3_2_bound(b, codec.levels)
  return total + (elias.theorem_3_2_bound(rest, codec.levels) if rest else 0.0)


def gaussian_table(log2n: list[int], num_keys: int) -> str:
  keys = jax.random.split(jax.random.key(0), num_keys)
  lines = [
    "| n | s | Elias bits/coord | Theorem 3.2 bits/coord | fixed bits/coord "
    "| Elias / fixed | ≤ 2.8n + 32 |",
    "|---:|---:|---:|---:|---:|---:|:---:|",
  ]
  for e in log2n:
    n = 2**e
    x = np.random.default_rng(e).standard_normal(n).astype(np.float32)
    root = round(math.sqrt(n))
    for s in sorted({1, 3, 7, 15, root}):
      codec = C.QSGD(s, bucket_size=None, norm="l2")
      bits = _mean_bits(codec, x, keys)
      fixed = codec.wire_bits((n,))
      dense = ("yes" if bits <= 2.8 * n + 32 else "**no**") if s == root else ""
      label = f"{s} (√n)" if s == root else str(s)
      lines.append(
        f"| 2^{e} | {label} | {bits / n:.3f} | "
        f"{elias.theorem_3_2_bound(n, s) / n:.3f} | {fixed / n:.3f} | "
        f"{bits / fixed:.3f} | {dense} |"
      )
  return "\n".join(lines)


def cnn_gradients(workdir: str, batch: int = 256):
  """{leaf path: gradient} of the demo CNN at init, for the leaves compressed by default."""
  # pylint: disable=import-outside-toplevel  (flax and mnist1d only for this table)
  from examples.mnist1d import input_pipeline
  from examples.mnist1d import models
  from examples.mnist1d import train
  from examples.mnist1d.configs import default

  config = default.get_config()
  data = input_pipeline.load_dataset(config, workdir)
  model = models.create_model(config)
  x, y = jnp.asarray(data["x"][:batch]), jnp.asarray(data["y"][:batch])
  params = jax.jit(model.init)(jax.random.key(config.seed), x[:1])["params"]
  grads = jax.jit(jax.grad(lambda p: train.cross_entropy(model, p, x, y)))(params)
  leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
  return {
    jax.tree_util.keystr(path): np.asarray(g, np.float32)
    for path, g in leaves
    if jc.default_filter(path, g)
  }


CNN_CODECS = {
  "paper dense: l2, one bucket, s = round(√n)": None,
  "l2, one bucket, s = 7": C.QSGD(7, bucket_size=None, norm="l2"),
  "demo qsgd4: max, buckets of 512, s = 7": C.QSGD(7, bucket_size=512, norm="max"),
  "demo qsgd2: max, buckets of 128, s = 1": C.QSGD(1, bucket_size=128, norm="max"),
}


def cnn_tables(grads: dict[str, np.ndarray], num_keys: int) -> str:
  keys = jax.random.split(jax.random.key(1), num_keys)
  out = []
  for name, fixed_codec in CNN_CODECS.items():
    lines = [
      f"**{name}**",
      "",
      "| leaf | n | Elias bits/coord | Theorem 3.2 bits/coord | fixed bits/coord | Elias / fixed |",
      "|---|---:|---:|---:|---:|---:|",
    ]
    tot = {"n": 0, "elias": 0.0, "bound": 0.0, "fixed": 0}
    for path, g in grads.items():
      n = g.size
      codec = fixed_codec or C.QSGD(round(math.sqrt(n)), bucket_size=None, norm="l2")
      bits = _mean_bits(codec, g.reshape(-1), keys)
      fixed = codec.wire_bits((n,))
      bound = _bound_bits(codec, n)
      tot["n"] += n
      tot["elias"] += bits
      tot["fixed"] += fixed
      tot["bound"] += bound or 0.0
      shown = "–" if bound is None else f"{bound / n:.3f}"
      label = path + (f" (s={codec.levels})" if fixed_codec is None else "")
      lines.append(
        f"| {label} {tuple(g.shape)} | {n} | {bits / n:.3f} | {shown} | "
        f"{fixed / n:.3f} | {bits / fixed:.3f} |"
      )
    n = tot["n"]
    shown = (
      "–" if fixed_codec is not None and fixed_codec.norm != "l2" else (f"{tot['bound'] / n:.3f}")
    )
    lines.append(
      f"| **all compressed leaves** | {n} | {tot['elias'] / n:.3f} | {shown} | "
      f"{tot['fixed'] / n:.3f} | {tot['elias'] / tot['fixed']:.3f} |"
    )
    out.append("\n".join(lines))
  return "\n\n".join(out)


def throughput_table(log2n: int, repeats: int) -> str:
  n = 2**log2n
  x = jnp.asarray(np.random.default_rng(0).standard_normal(n).astype(np.float32))
  configs = [
    C.QSGD(round(math.sqrt(n)), bucket_size=None, norm="l2"),
    C.QSGD(7, bucket_size=None, norm="l2"),
    C.QSGD(7, bucket_size=512, norm="max"),
    C.QSGD(1, bucket_size=128, norm="max"),
  ]
  lines = [
    f"n = 2^{log2n}, median of {repeats} runs",
    "",
    "| codec | bits/coord | encode values/s | encode MB/s (string, float32 input) "
    "| decode values/s | decode MB/s (string, float32 input) |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for codec in configs:
    payload = jax.jit(lambda v, k, c=codec: c.encode(v, key=k))(x, jax.random.key(0))
    payload = jax.tree.map(np.asarray, payload)
    data = elias.qsgd_to_bytes(codec, payload)
    back = elias.qsgd_from_bytes(codec, data, (n,))
    assert np.array_equal(np.asarray(codec.decode(back)), np.asarray(codec.decode(payload)))
    enc = median_time(lambda c=codec, p=payload: elias.qsgd_to_bytes(c, p), repeats=repeats)
    dec = median_time(lambda c=codec, d=data: elias.qsgd_from_bytes(c, d, (n,)), repeats=repeats)
    mb = len(data) / 1e6
    name = (
      f"s={codec.levels}, {codec.norm}, "
      f"{'one bucket' if codec.bucket_size is None else f'buckets of {codec.bucket_size}'}"
    )
    lines.append(
      f"| {name} | {8 * (len(data) - 4) / n:.3f} | {n / enc:,.0f} | "
      f"{mb / enc:.2f}, {4 * n / 1e6 / enc:.1f} | {n / dec:,.0f} | "
      f"{mb / dec:.2f}, {4 * n / 1e6 / dec:.1f} |"
    )
  return "\n".join(lines)


def spread_table(log2n: list[int], draws: int) -> str:
  """Mean and spread of the string length at s = sqrt(n) over ``draws`` quantizations."""
  lines = [
    f"s = round(sqrt(n)), l2, one bucket; {draws} draws of the quantization",
    "",
    "| n | mean bits/coord | std bits/coord | max bits/coord | share > 2.8n + 32 |",
    "|---:|---:|---:|---:|---:|",
  ]
  for e in log2n:
    n = 2**e
    codec = C.QSGD(round(math.sqrt(n)), bucket_size=None, norm="l2")
    x = np.random.default_rng(e).standard_normal(n).astype(np.float32)
    payloads = _encoder(codec)(jnp.asarray(x), jax.random.split(jax.random.key(1), draws))
    bits = np.array([elias.stream_bits(codec, p) for p in _rows(payloads, draws)]) / n
    over = np.mean(bits * n > 2.8 * n + 32)
    lines.append(
      f"| 2^{e} | {bits.mean():.3f} | {bits.std():.3f} | {bits.max():.3f} | {over:.2f} |"
    )
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--log2n",
    default="10,12,14,16,18,20",
    help="comma-separated exponents of n for the Gaussian table",
  )
  parser.add_argument("--keys", type=int, default=3, help="quantizations averaged per row")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
  parser.add_argument("--workdir", default="/tmp/elias_data", help="MNIST-1D cache")
  parser.add_argument("--no-cnn", action="store_true", help="skip the CNN gradients")
  parser.add_argument("--draws", type=int, default=20, help="draws of the spread table")
  args = parser.parse_args()
  log2n = [int(e) for e in args.log2n.split(",")]

  print(
    f"jax {jax.__version__}, {jax.devices()[0].platform}; bits/coord = bits / n; "
    f"fixed = codec.bits per value + 32 per bucket; Theorem 3.2 without its o(1)\n"
  )
  print("### Gaussian vectors, one l2 bucket\n")
  print(gaussian_table(log2n, args.keys))
  if not args.no_cnn:
    print("\n### Demo CNN (MNIST-1D) gradient at init, batch 256\n")
    print(cnn_tables(cnn_gradients(args.workdir), args.keys))
  print("\n### Length spread at s = sqrt(n)\n")
  print(spread_table([10, 12, 16], args.draws))
  print("\n### Host throughput (qsgd_to_bytes / qsgd_from_bytes)\n")
  print(throughput_table(max(log2n), args.repeats))


if __name__ == "__main__":
  main()
