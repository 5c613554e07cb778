"""MIPD's bytes per step against the device count, for its two exchanges.

  python -m benchmarks.studies.mipd_wire
  python -m benchmarks.studies.mipd_wire --devices 8,64

For the demo's CNN and MLPs of 786K (as ``tests/test_mipd.py::WIRE_PARAMS``) and 3.1M
parameters: ``jc.wire_report``'s bytes per device per step of ``jc.mipd(0.5)`` per
collective and their ratios to a dense ``pmean`` (traced over an abstract mesh: no
devices needed). Results: docs/methods/mipd.md.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks._timing import ints
from benchmarks._timing import md_head
from examples.mnist1d import models
from examples.mnist1d.configs import default
import jaxcomp as jc


def models_to_report() -> dict:
  """{name: abstract params} of the three models."""
  model = models.create_model(default.get_config())
  demo = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 40)))["params"])
  mlp = lambda w: {
    k: jax.ShapeDtypeStruct(s, jnp.float32)
    for k, s in zip("wvub", ((w, w), (w // 2, w), (w // 2, w), (w,)))
  }
  return {"demo CNN": demo, "786K": mlp(512), "3.1M": mlp(1024)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", type=ints, default="2,4,8,16,32,64", help="device counts K")
  args = parser.parse_args(argv)
  head = "model | K | allgather bytes | allgather ratio | two_phase bytes | two_phase ratio"
  print(md_head(head + " | auto ratio"))
  for name, params in models_to_report().items():
    for k in args.devices:
      r = {
        c: jc.wire_report(
          jc.mipd(0.5, axis_name="b", collective=c), params, axis_name="b", num_devices=k
        )
        for c in ("allgather", "two_phase", "auto")
      }
      print(
        f"| {name} | {k} | {r['allgather'].bytes_received:,.0f} |"
        f" {r['allgather'].ratio:.2f}x | {r['two_phase'].bytes_received:,.0f} |"
        f" {r['two_phase'].ratio:.2f}x | {r['auto'].ratio:.2f}x |"
      )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
