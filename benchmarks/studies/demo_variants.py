"""Variants of the demo's DGC, Wangni, MIPD and 1-bit Adam exchanges, trained as its rows.

  python -m benchmarks.studies.demo_variants --variants dgc_clip_mean,dgc_no_clip --seed 0
  python -m benchmarks.studies.demo_variants --variants all --seed 1
  python -m benchmarks.studies.demo_variants --saturation     # or --mipd-drops

Each variant trains the demo's CNN (examples/mnist1d, 8 CPU devices) with one exchange
changed, next to a dense run of the same seed, with its bytes ratio from
``jc.wire_report`` (DGC: steady state). ``--saturation``: the share of the greedy Wangni
sparsifier's planned count that saturates, per kernel of the gradient at init;
``--mipd-drops``: MIPD's drops per layer at init. Tables: the methods' pages
(docs/benchmarks.md, "Demo variants", links them).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

import jax.numpy as jnp
import numpy as np

from benchmarks._timing import md_head
from benchmarks._timing import md_row
from benchmarks._timing import use_cpu_devices
from benchmarks.studies import compressed
from benchmarks.studies import init_grads
from examples.mnist1d import train
from examples.mnist1d.configs import default
import jaxcomp as jc

AXIS = train.AXIS


def _dgc(config, num_devices: int, steady: bool, *, clip="sum", warmup=None, **kwargs):
  """The demo's DGC with one change; ``steady``: without warm-up (for the byte count)."""
  clip_norm = {"sum": num_devices * config.grad_clip, "mean": config.grad_clip, None: None}[clip]
  warmup = config.warmup_steps if warmup is None else warmup
  return jc.dgc(
    0.001,
    0.9,
    nesterov=True,
    clip_norm=clip_norm,
    axis_name=AXIS,
    warmup_steps=0 if steady else warmup,
    **kwargs,
  )


def _onebit_adam(config, steady: bool, *, freeze=None, **kwargs):
  """The demo's 1-bit Adam with ``kwargs`` changed; ``freeze``: another warm-up
  fraction; ``steady``: the compression stage alone (for the byte count)."""
  if freeze is not None and not steady:
    kwargs["freeze_step"] = round(freeze * config.num_steps)
  return train.make_onebit_adam(config, warmup=not steady, **kwargs)


#: method -> exchange factory(config, K, steady, **the variant's change)
FACTORIES = {
  "dgc": _dgc,
  "wangni": lambda c, k, steady, **kw: jc.sparsify(axis_name=AXIS, **kw),
  "mipd": lambda c, k, steady, drop, **kw: jc.mipd(drop, axis_name=AXIS, **kw),
  "onebit_adam": lambda c, k, steady, **kw: _onebit_adam(c, steady, **kw),
}
_DENSE_CLASSIFIER = {"filter": lambda path, x: x.ndim >= 2 and x.size >= 2048}
_NO_BOUND = {"bound_momentum": False}

# name -> (method whose optimizer and exchange factory it uses, the change)
VARIANTS = {
  # DGC: the demo's recipe is dgc_demo (clip_norm = K x the mean-gradient threshold).
  "dgc_demo": ("dgc", {}),
  "dgc_clip_mean": ("dgc", {"clip": "mean"}),
  "dgc_no_clip": ("dgc", {"clip": None}),
  "dgc_no_clip_warmup300": ("dgc", {"clip": None, "warmup": 300}),
  "dgc_warmup200": ("dgc", {"warmup": 200}),
  "dgc_warmup300": ("dgc", {"warmup": 300}),
  "dgc_no_masking": ("dgc", {"momentum_masking": False}),
  "dgc_dense_classifier": ("dgc", _DENSE_CLASSIFIER),
  # Wangni (greedy) at other densities; the demo row is 5%.
  "wangni_1pct": ("wangni", {"density": 0.01}),
  "wangni_2pct": ("wangni", {"density": 0.02}),
  "wangni_10pct": ("wangni", {"density": 0.1}),
  "wangni_1pct_ef": ("wangni", {"density": 0.01, "error_feedback": True}),
  # MIPD ablation (the paper's Fig. 9 groups B-D; the demo row is mipd_full).
  "mipd_half": ("mipd", {"drop": 0.0, "quantize": False}),
  "mipd_half_drop": ("mipd", {"drop": 0.5, "quantize": False}),
  "mipd_full": ("mipd", {"drop": 0.5}),
  # Quantization without drops (half update on): which module costs the accuracy.
  "mipd_half_quant": ("mipd", {"drop": 0.0}),
  "mipd_no_compensation": ("mipd", {"drop": 0.5, "compensate": False}),
  "mipd_keep0": ("mipd", {"drop": 0.5, "min_keep": 0.0}),
  "mipd_alpha01": ("mipd", {"drop": 0.5, "alpha": 0.1}),
  "mipd_alpha09": ("mipd", {"drop": 0.5, "alpha": 0.9}),
  "mipd_beta1": ("mipd", {"drop": 0.5, "beta": 1.0}),
  "mipd_half_drop_predict_compensated": (
    "mipd",
    {"drop": 0.5, "quantize": False, "predict_from": "compensated"},
  ),
  "mipd_full_predict_compensated": ("mipd", {"drop": 0.5, "predict_from": "compensated"}),
  # 1-bit Adam: the demo's row is onebit_adam_demo (m / sqrt(v) compressed, 20% warm-up,
  # the momentum bound); the others without the bound, or Algorithm 1 ("momentum").
  "onebit_adam_demo": ("onebit_adam", {}),
  "onebit_adam_unbounded": ("onebit_adam", _NO_BOUND),
  "onebit_adam_momentum": ("onebit_adam", {"compress": "momentum"}),
  "onebit_adam_momentum_unbounded": ("onebit_adam", {"compress": "momentum", **_NO_BOUND}),
  "onebit_adam_half": ("onebit_adam", {"freeze": 0.5}),
  "onebit_adam_half_unbounded": ("onebit_adam", {"freeze": 0.5, **_NO_BOUND}),
}


def run(names, seed: int, workdir: str) -> None:
  config = dataclasses.replace(default.get_config(), seed=seed)
  mesh, data, model, init_params = train.setup(config, workdir)
  k = mesh.size
  common = dict(model=model, init_params=init_params, data=data, mesh=mesh)
  r = train.train_method("dense", config, **common)
  dense = r["test_accuracy"]
  changes = {"dense": r["layer_change"]}
  rows = [
    f"| dense | {100 * dense:.1f} | | {r['bytes_received']:,.0f} | 1.0x |"
    f" {r['train_time_s']:.1f} | |"
  ]
  for name in names:
    method, change = VARIANTS[name]
    make = lambda steady: FACTORIES[method](config, k, steady, **change)
    r = train.train_method(
      method, config, exchange=make(False), steady_exchange=make(True), **common
    )
    acc = r["test_accuracy"]
    changes[name] = r["layer_change"]
    overflow = "" if r["overflow_steps"] is None else r["overflow_steps"]
    rows.append(
      f"| {name} | {100 * acc:.1f} | {100 * (acc - dense):+.1f} | {r['bytes_received']:,.0f} |"
      f" {r['ratio']:.1f}x | {r['train_time_s']:.1f} | {overflow} |"
    )
  print(f"\nseed {seed}, {k} devices, {config.num_steps} steps\n")
  head = "variant | test acc (%) | vs dense (points) | bytes recv/device/step | ratio vs dense"
  print(md_head(head + " | train time (s) | overflow steps"))
  print("\n".join(rows))
  # How far each kernel moved from its initialization: ||w_T - w_0|| / ||w_0||.
  kernels = [p for p in changes["dense"] if p.endswith("['kernel']")]
  print("\n" + md_head(" | ".join(["variant", *kernels])))
  for name, change in changes.items():
    print(md_row(name, *(f"{change[p]:.3f}" for p in kernels)))


def saturation(workdir: str) -> None:
  grads = init_grads(workdir)[1]
  print("\n" + md_head("kernel | n | κ = 1% | κ = 5% | κ = 10%"))
  for path, g in compressed(grads):
    shares = []
    for kappa in (0.01, 0.05, 0.1):
      p, _ = jc.codecs.UnbiasedSparsifier(density=kappa).probabilities(jnp.asarray(g))
      shares.append(f"{float(np.sum(np.asarray(p) >= 1)) / (kappa * g.size):.3f}")
    print(md_row(path, f"{g.size:,}", *shares))


def mipd_drops(workdir: str) -> None:
  """MIPD's per-layer drop counts at init (batch 256), per half-update group.

  With ``min_keep=0`` (the paper's cap) and the default ``min_keep=0.1``: eqs. 1, 6, 7
  with the prediction still 0, so the ESP rate compares each layer's whole gradient.
  """
  from jaxcomp._src.methods import mipd  # pylint: disable=import-outside-toplevel

  params, grads = init_grads(workdir)
  sel = [(path, g, dict(compressed(params))[path]) for path, g in compressed(grads)]
  sizes = [int(g.size) for _, g, _ in sel]
  head = "group | layer | entries | rate r_i | dropped (min_keep=0) | dropped (min_keep=0.1)"
  print("\n" + md_head(head, align="rlrrrr"))
  for gi, half in enumerate(mipd.balanced_halves(sizes)):
    sz = [sizes[i] for i in half]
    rates = mipd.drop_rates(
      jnp.stack([jnp.linalg.norm(sel[i][2]) for i in half]),
      jnp.stack([jnp.linalg.norm(sel[i][1]) for i in half]),
      0.5,
    )
    total = round(0.5 * sum(sz))
    paper = mipd.allocate_drops(rates, sz, total)
    floor = mipd.allocate_drops(rates, [s - math.ceil(0.1 * s) for s in sz], total)
    for j, i in enumerate(half):
      drops = (f"{int(paper[j]):,}", f"{int(floor[j]):,}")
      print(md_row(gi + 1, sel[i][0], f"{sizes[i]:,}", f"{float(rates[j]):.3f}", *drops))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--variants", default="dgc_demo", help=f"comma-separated, or 'all': {', '.join(VARIANTS)}"
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workdir", default=os.path.join("runs", "mnist1d"))
  what = "instead of training"
  parser.add_argument("--saturation", action="store_true", help=f"Wangni's saturation, {what}")
  parser.add_argument("--mipd-drops", action="store_true", help=f"MIPD's drops at init, {what}")
  args = parser.parse_args(argv)
  use_cpu_devices(8)
  if args.saturation or args.mipd_drops:
    return (saturation if args.saturation else mipd_drops)(args.workdir)
  names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
  run(names, args.seed, args.workdir)


if __name__ == "__main__":
  main()
