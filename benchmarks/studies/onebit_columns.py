"""Bytes per step of 1-bit SGD with the paper's per-column means, leaf by leaf.

  python -m benchmarks.studies.onebit_columns
  python -m benchmarks.studies.onebit_columns --devices 8,16 --shapes 1024x3,4096

Per leaf shape and device count K: the column segments ``r`` of its two-phase chunks,
the chunk shape, and ``jc.wire_report``'s bytes per device per step of
``jc.onebit_sgd(per_column=True)`` per collective, with ratios to a dense all-reduce
(traced over an abstract mesh: no devices needed). Results: docs/methods/onebit_sgd.md.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks._timing import ints
from benchmarks._timing import md_head
from benchmarks._timing import md_row
import jaxcomp as jc

SHAPES = "1024x3,1024x7,1024x10,4096,1000x3,256x64,96"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", type=ints, default="8", help="comma-separated device counts K")
  parser.add_argument("--shapes", default=SHAPES, help="comma-separated leaf shapes, AxB")
  args = parser.parse_args(argv)
  codec = jc.codecs.OneBit(per_column=True)
  print(md_head("leaf | K | r | chunk | allgather | two_phase | auto", "lrrlrrr"))
  for shape in (tuple(map(int, s.split("x"))) for s in args.shapes.split(",")):
    params = {"w": jax.ShapeDtypeStruct(shape, jnp.float32)}
    for k in args.devices:
      cells = []
      for c in ("allgather", "two_phase", "auto"):
        tx = jc.onebit_sgd(per_column=True, axis_name="b", collective=c, filter=lambda p, x: True)
        r = jc.wire_report(tx, params, axis_name="b", num_devices=k)
        cells.append(f"{r.bytes_received:,.0f} B ({r.ratio:.1f}x)")
      leaf, chunk = ("x".join(map(str, s)) for s in (shape, codec.chunk_shape(shape, k)))
      print(md_row(leaf, k, codec.column_segments(shape, k), chunk, *cells))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
