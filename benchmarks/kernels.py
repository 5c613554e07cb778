"""GB/s of every kernel against the XLA path and the device's copy, in one run.

    python -m benchmarks.kernels                      # on a CUDA GPU: 1M..256M values
    python -m benchmarks.kernels --sizes 20,24 --k 8  # log2 sizes, K payloads
    python -m benchmarks.kernels --interpret --sizes 12 --repeats 1  # CPU smoke run

Rows, per size ``n`` (float32 input, QSGD 4-bit / bucket 512, OneBit bucket 512):

* ``copy``: ``x + 1`` into a new array, bytes read + written: the device's roof for a
  pass that reads and writes (measured here; the issue estimates about 3 TB/s on an H100).
* ``quantize`` and ``quantize+ef`` (fused error feedback): the Pallas kernel and the
  XLA codec; bytes = input (and residual) read + payload (and residual) written.
* ``dequantize_sum`` (K payloads) and OneBit's ``sign_pack`` / ``sign_unpack_sum``.

Every ratio is against numbers measured in the same run (these machines are noisy).
Without a CUDA GPU the kernels only run in interpret mode, whose timings mean nothing;
the script then refuses unless ``--interpret`` is given (to check that it runs).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from jaxcomp.kernels import _common
from jaxcomp.kernels import dequantize
from jaxcomp.kernels import quantize
from jaxcomp.kernels import sign_pack

_F32 = jnp.float32


def run(sizes, *, k: int, repeats: int, interpret: bool | None) -> list[dict]:
  """Every kernel's rows for every size, plus the copy roof measured in the same run."""
  rows = []
  for n in sizes:
    x = jax.random.normal(jax.random.key(1), (n,), _F32)
    t_copy = _common.median_time(jax.jit(lambda x: x + 1.0), x, repeats=repeats)
    common = dict(sizes=(n,), repeats=repeats, interpret=interpret)
    found = (quantize.benchmark(**common) + dequantize.benchmark(k=k, **common)
             + sign_pack.benchmark(k=k, **common))
    for row in found:
      row["copy_gbs"] = 8 * n / t_copy / 1e9
    rows += found
  return rows


def table(rows: list[dict]) -> str:
  lines = ["| kernel | n | Pallas GB/s | XLA GB/s | copy GB/s | Pallas / XLA | Pallas / copy |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(
        f"| {r['kernel']} | 2^{r['n'].bit_length() - 1} | {r['pallas_gbs']:.1f} | "
        f"{r['xla_gbs']:.1f} | {r['copy_gbs']:.1f} | {r['pallas_gbs'] / r['xla_gbs']:.2f}x | "
        f"{100 * r['pallas_gbs'] / r['copy_gbs']:.0f}% |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", default="20,22,24,26,28",
                      help="comma-separated log2 sizes (default 2^20..2^28)")
  parser.add_argument("--k", type=int, default=8, help="payloads summed by the decoders")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--interpret", action="store_true",
                      help="run the kernels in interpret mode (a smoke run, not a timing)")
  args = parser.parse_args(argv)
  if not _common.cuda_available() and not args.interpret:
    print("no CUDA GPU: the kernels would run in interpret mode, whose timings mean "
          "nothing; pass --interpret to run anyway", file=sys.stderr)
    return 2
  sizes = [2 ** int(s) for s in args.sizes.split(",")]
  device = jax.devices()[0]
  print(f"# device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"interpret={args.interpret}")
  rows = run(sizes, k=args.k, repeats=args.repeats,
             interpret=True if args.interpret else None)
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
