"""MIPD's two-phase capacities against a training run's counts, and its bytes per step.

  python -m benchmarks.studies.mipd                # the demo: 600 steps, seed 0
  python -m benchmarks.studies.mipd --steps 50 --seed 1
  python -m benchmarks.studies.mipd --wire --devices 8,64

By default, trains the demo's CNN (examples/mnist1d, 8 CPU devices) with ``jc.mipd(0.5,
collective="two_phase")`` and at every step computes, with MIPD's own steps on the real
update's inputs inside the same ``shard_map`` (the real update runs unchanged), what its
static payloads must hold: per half-update group, the mean and largest count against
each capacity and the steps above it (docs/methods/mipd.md, "The capacity diagnostic").
``--wire``: for the demo's CNN and MLPs of 786K (as ``tests/test_mipd.py::WIRE_PARAMS``)
and 3.1M parameters, ``jc.wire_report``'s bytes per device per step of ``jc.mipd(0.5)``
per collective and their ratios to a dense ``pmean``, traced over an abstract mesh of
each ``--devices`` count (docs/methods/mipd.md, "Bytes on the wire").
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks._timing import ints
from benchmarks._timing import md_head
from benchmarks._timing import md_row
from benchmarks._timing import use_cpu_devices
from examples.mnist1d import models
from examples.mnist1d import train
from examples.mnist1d.configs import default
import jaxcomp as jc
from jaxcomp._src.codecs import normal
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import mipd_exchange
from jaxcomp._src.methods import mipd as mipd_lib

AXIS = train.AXIS
DROP_RATE = 0.5
COLLECTIVES = ("allgather", "two_phase", "auto")


def _layout(leaves):
  """MIPD's default layout of ``leaves``: (selected positions, halves, groups)."""
  d = jc.mipd.__kwdefaults__
  q = normal.NormalQuantizer(d["intervals"], d["sigmas"], d["outlier_fraction"])
  sel = [i for i, (p, x) in enumerate(leaves) if jc.default_filter(p, x)]
  sizes = [int(np.prod(leaves[i][1].shape)) for i in sel]
  halves = mipd_lib.balanced_halves(sizes)
  group = mipd_lib._Group  # pylint: disable=protected-access
  groups = [
    group([sizes[j] for j in h], DROP_RATE, q, d["outlier_fraction"], min_keep=d["min_keep"])
    for h in halves
  ]
  return sel, halves, groups, q


def _counts(group, members, gs, preds, pnorms, quantizer):
  """(kept per owner, push outliers per owner, pull outliers per owner, capacities)."""
  k = collectives.axis_size(AXIS)
  g_m, p_m = [gs[j] for j in members], [preds[j] for j in members]
  errs = jnp.stack([jnp.sqrt(jnp.sum(jnp.square(g - p))) for g, p in zip(g_m, p_m)])
  beta = jc.mipd.__kwdefaults__["beta"]
  rates = mipd_lib.drop_rates(jnp.stack([pnorms[j] for j in members]), errs, beta)
  drops = mipd_lib.allocate_drops(rates, group.caps, group.drops)
  keep = jnp.asarray(group.sizes, jnp.int32) - drops
  coded = group.code(*group.select(g_m, keep))
  owners = mipd_exchange._Owners(group, k, quantizer, 2)  # pylint: disable=protected-access
  mask, outl = owners.rows(coded.mask, False), owners.rows(coded.outl, False)
  kept = jnp.sum(mask, axis=1, dtype=jnp.int32)
  push_out = jnp.sum(outl, axis=1, dtype=jnp.int32)
  # The owners' sums and counts, as the push delivers them, then the pulled vectors.
  rows = (owners.rows(coded.flat, 0.0), mask, owners.rows(coded.codes, 0), outl)
  payload, _ = jax.vmap(lambda *r: owners.row.pack(*r, coded.stats, coded.finite))(*rows)
  got = collectives.all_to_all_tree(payload, AXIS)
  total, count = owners.row.sum_and_count(got)
  p_flat = jnp.concatenate([p.reshape(-1) for p in p_m])
  mine = jnp.asarray(owners.index)[jax.lax.axis_index(AXIS)]
  pred = jnp.concatenate([p_flat, jnp.zeros((1,), jnp.float32)])[mine]
  fmt, pull_out = owners.pull, []
  for v in ((total + (k - count) * pred) / k, total / k):  # compensated mean, received
    segs = [v[int(lo) : int(hi)] for lo, hi in zip(fmt.offsets[:-1], fmt.offsets[1:])]
    _, o, _ = mipd_exchange._layer_codes(  # pylint: disable=protected-access
      segs, [jnp.ones(s.shape, bool) for s in segs], fmt.quantizer
    )
    pull_out.append(jnp.sum(o, dtype=jnp.int32))
  caps = (owners.row.slots, owners.row.outliers, fmt.outliers)
  return kept, push_out, jnp.stack(pull_out), caps


def recording(tx: optax.GradientTransformation, records: list) -> optax.GradientTransformation:
  """``tx`` (a default ``jc.mipd``), with its payloads' counts sent to ``records``."""

  def update_fn(updates, state, params=None):
    out = tx.update(updates, state, params)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    sel, halves, groups, q = _layout(leaves)
    gs = [leaves[i][1].astype(jnp.float32) for i in sel]
    preds = [treedef.flatten_up_to(state.prediction)[i] for i in sel]
    pnorms = [jnp.sqrt(jnp.sum(jnp.square(treedef.flatten_up_to(params)[i]))) for i in sel]
    # The half update's parity, read from the state as the real update reads it.
    parity = (jax.lax.pmax(state.count, AXIS) % 2).astype(jnp.int32)
    for active, (group, members) in enumerate(zip(groups, halves)):
      *counts, caps = _counts(group, members, gs, preds, pnorms, q)

      def record(device, parity, *counts, active=active, caps=caps):
        if int(parity) == active:
          records.append((active, int(device), *map(np.asarray, counts), caps))

      jax.debug.callback(record, jax.lax.axis_index(AXIS), parity, *counts, ordered=False)
    return out

  return optax.GradientTransformation(tx.init, update_fn)


def summarize(records: list, num_steps: int) -> str:
  """Per group and count: mean, largest and capacity, and the steps above a capacity."""
  lines = [md_head("group | count | mean | largest | capacity | above capacity", "rlrrrr")]
  for group in sorted({r[0] for r in records}):
    recs = [r for r in records if r[0] == group]
    slots, push_cap, pull_cap = recs[0][5]
    for name, idx, cap in (
      ("kept entries per owner (push)", 2, slots),
      ("exact outliers per owner (push)", 3, push_cap),
      ("exact outliers per owner (pull)", 4, pull_cap),
    ):
      v = np.concatenate([np.ravel(r[idx]) for r in recs])
      lines.append(md_row(group + 1, name, f"{v.mean():.1f}", v.max(), cap, int(np.sum(v > cap))))
  lines.append(f"\n{len(records)} device-steps recorded over {num_steps} steps.")
  return "\n".join(lines)


def wire_table(devices: list[int]) -> str:
  """Bytes per device per step of each collective, for the demo CNN and two MLPs."""
  model = models.create_model(default.get_config())
  demo = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 40)))["params"])
  mlp = lambda w: {
    k: jax.ShapeDtypeStruct(s, jnp.float32)
    for k, s in zip("wvub", ((w, w), (w // 2, w), (w // 2, w), (w,)))
  }
  head = "model | K | allgather bytes | allgather ratio | two_phase bytes | two_phase ratio"
  lines = [md_head(head + " | auto ratio")]
  tx = lambda collective: jc.mipd(DROP_RATE, axis_name="b", collective=collective)
  for name, p in {"demo CNN": demo, "786K": mlp(512), "3.1M": mlp(1024)}.items():
    for k in devices:
      ag, tp, auto = (jc.wire_report(tx(c), p, axis_name="b", num_devices=k) for c in COLLECTIVES)
      cells = (f"{ag.bytes_received:,.0f}", f"{ag.ratio:.2f}x", f"{tp.bytes_received:,.0f}")
      lines.append(md_row(name, k, *cells, f"{tp.ratio:.2f}x", f"{auto.ratio:.2f}x"))
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  steps = default.get_config().num_steps
  parser.add_argument("--steps", type=int, default=steps, help="training steps (%(default)s)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workdir", default="runs/mipd_capacity")
  parser.add_argument("--wire", action="store_true", help="bytes per step, instead of training")
  parser.add_argument(
    "--devices", type=ints, default="2,4,8,16,32,64", help="--wire: device counts K"
  )
  args = parser.parse_args(argv)
  if args.wire:
    print(wire_table(args.devices))
    return 0
  use_cpu_devices(8)
  cfg = dataclasses.replace(default.get_config(), seed=args.seed, num_steps=args.steps)
  mesh, data, model, p0 = train.setup(cfg, args.workdir)
  records: list = []
  tx = recording(jc.mipd(DROP_RATE, axis_name=AXIS, collective="two_phase"), records)
  r = train.train_method(
    "mipd", cfg, model=model, init_params=p0, data=data, mesh=mesh, exchange=tx
  )
  jax.effects_barrier()
  print(f"test accuracy {100 * r['test_accuracy']:.1f}%, overflow steps {r['overflow_steps']}")
  print(summarize(records, cfg.num_steps))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
