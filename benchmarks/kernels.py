"""GB/s of every Pallas kernel against the XLA path and the device's copy, in one run.

    python -m benchmarks.kernels                      # on a CUDA GPU: 1M..256M values
    python -m benchmarks.kernels --sizes 20,24 --k 8  # log2 sizes, K payloads
    python -m benchmarks.kernels --interpret --sizes 12 --repeats 1  # CPU smoke run
    python -m benchmarks.kernels --ragged --out kernels.md  # + n - 1000, table to a file

Per size ``n``: each kernel of :mod:`jaxcomp.kernels` (QSGD 4-bit and OneBit, buckets of
512) and the XLA codec doing the same work, in GB/s of the arrays read and written, next
to the device's copy (``x + 1``) of the same run. ``--ragged`` adds ``n - 1000`` (a ragged
last bucket); ``--out FILE`` rewrites the table there after each size, so a run cut short
keeps what it measured (``scripts/gpu_check.sh``). Without a CUDA GPU the kernels only
run in interpret mode, whose timings mean nothing: the script refuses unless
``--interpret`` is given. Rows and targets: docs/benchmarks.md, "Pallas kernels on GPU".
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from benchmarks._timing import ints
from benchmarks._timing import md_head
from benchmarks._timing import md_row
from benchmarks._timing import median_time
from jaxcomp.kernels import _common
from jaxcomp.kernels import _mosaic
from jaxcomp.kernels import cuda_available
from jaxcomp.kernels import dequantize
from jaxcomp.kernels import quantize
from jaxcomp.kernels import sign_pack
from tests import kernel_references as xla_path  # the XLA codecs, as the kernels are called

_F32 = jnp.float32


def rows_at(n: int, *, k: int, repeats: int, interpret: bool | None) -> list[dict]:
  """Every kernel's row at ``n`` values (QSGD 4-bit and OneBit, buckets of 512): GB/s of
  the kernel and of the XLA path, and of the copy roof measured in the same run."""
  q, b = dict(levels=7, bucket_size=512), dict(bucket_size=512)
  x = jax.random.normal(jax.random.key(1), (n,), _F32)
  e = 0.01 * jax.random.normal(jax.random.key(2), (n,), _F32)
  key = jax.random.key(0)
  t_copy = median_time(jax.jit(lambda x: x + 1.0), x, repeats=repeats)
  words, scales = xla_path.quantize_reference(x, key, **q)
  signs = xla_path.sign_pack_reference(x, **b)
  qbytes, sbytes = words.nbytes + scales.nbytes, sum(a.nbytes for a in signs)
  # (kernel, XLA path, options) of each kernel
  quant = (quantize.quantize, xla_path.quantize_reference, q)
  deq = (dequantize.dequantize_sum, xla_path.dequantize_sum_reference, dict(q, n=n))
  pack = (sign_pack.sign_pack, xla_path.sign_pack_reference, b)
  unpack = (sign_pack.sign_unpack_sum, xla_path.sign_unpack_sum_reference, dict(b, n=n))
  k_codes = (jnp.stack([words] * k), jnp.stack([scales] * k))  # K payloads to sum
  k_signs = tuple(jnp.stack([a] * k) for a in signs)
  cases = [  # name, bytes read + written, kernel, arguments
    ("quantize", 4 * n + qbytes, quant, (x, key)),
    ("quantize+ef", 12 * n + qbytes, quant, (x, key, e)),
    (f"dequantize_sum K={k}", k * qbytes + 4 * n, deq, k_codes),
    ("sign_pack", 4 * n + sbytes, pack, (x,)),
    ("sign_pack+ef", 12 * n + sbytes, pack, (x, e)),
    (f"sign_unpack_sum K={k}", k * sbytes + 4 * n, unpack, k_signs),
  ]
  copy = 8 * n / t_copy / 1e9
  rows = []
  for name, nbytes, (kernel, ref, kw), args in cases:
    pallas = jax.jit(lambda *a: kernel(*a, **kw, interpret=interpret))
    xla = jax.jit(lambda *a: ref(*a, **kw))
    gbs = [nbytes / median_time(fn, *args, repeats=repeats) / 1e9 for fn in (pallas, xla)]
    rows.append(dict(kernel=name, n=n, pallas_gbs=gbs[0], xla_gbs=gbs[1], copy_gbs=copy))
  return rows


def _size(n: int) -> str:
  return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else str(n)


def table(rows: list[dict]) -> str:
  lines = [
    md_head("kernel | n | Pallas GB/s | XLA GB/s | copy GB/s | Pallas / XLA | Pallas / copy")
  ]
  for r in rows:
    pallas = r["pallas_gbs"]
    gbs = (f"{g:.1f}" for g in (pallas, r["xla_gbs"], r["copy_gbs"]))
    ratios = (f"{pallas / r['xla_gbs']:.2f}x", f"{100 * pallas / r['copy_gbs']:.0f}%")
    lines.append(md_row(r["kernel"], _size(r["n"]), *gbs, *ratios))
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", type=ints, default="20,22,24,26,28", help="log2 sizes")
  parser.add_argument("--k", type=int, default=8, help="payloads summed by the decoders")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--interpret", action="store_true", help="a smoke run, not a timing")
  parser.add_argument("--ragged", action="store_true", help="also n - 1000 for each size")
  parser.add_argument("--out", help="also write the table here, rewritten after each size")
  args = parser.parse_args(argv)
  if not cuda_available() and not args.interpret:
    print(
      "no CUDA GPU: the kernels would run in interpret mode, whose timings mean "
      "nothing; pass --interpret to run anyway",
      file=sys.stderr,
    )
    return 2
  sizes = [m for e in args.sizes for m in ((2**e, 2**e - 1000) if args.ragged else (2**e,))]
  device = jax.devices()[0]
  interpret = True if args.interpret else None
  header = (
    f"# device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
    f"interpret={args.interpret}, kernels on: {_backends(interpret)}"
  )
  print(header)
  rows = []
  for n in sizes:
    rows += rows_at(n, k=args.k, repeats=args.repeats, interpret=interpret)
    if args.out:
      with open(args.out, "w") as f:
        f.write(header + "\n\n" + table(rows) + "\n")
  print(table(rows))
  return 0


def _backends(interpret: bool | None) -> str:
  """The backend of each code width measured here (QSGD 4-bit, OneBit 1-bit)."""
  mode = _common.resolve_interpret(interpret)
  return ", ".join(
    f"{what} {_common.pick_backend(_mosaic.misfit(2**20, bits, 512), interpret=mode)}"
    for what, bits in (("quantize", 4), ("sign_pack", 1))
  )


if __name__ == "__main__":
  sys.exit(main())
