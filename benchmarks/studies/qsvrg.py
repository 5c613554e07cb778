"""Quantized SVRG on L2-regularised logistic regression, 8 CPU devices: rate and bits.

  python -m benchmarks.studies.qsvrg                 # d = 32, 8 epochs
  python -m benchmarks.studies.qsvrg --dim 256 --epochs 10

Runs :func:`jaxcomp.qsvrg` under ``jax.shard_map`` on 8 CPU devices (256 examples and
T = 32 minibatches of 8 per device and epoch) with the paper's quantizer (s = √n, l2, one
bucket), coarser ones and plain SVRG (``Identity`` codec): the per-epoch contraction of
``f(y_p) - f*`` (``f*`` by Newton's method in float64) and the bits per device per epoch
(:func:`jaxcomp.qsvrg_wire_report`) against dense SVRG and the paper's Elias bound.
Results: docs/methods/qsvrg.md.
"""

from __future__ import annotations

import argparse

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from benchmarks._timing import use_cpu_devices
import jaxcomp as jc

K, ROWS, BATCH, AXIS = 8, 256, 8, "b"


def _problem(d: int, lam: float, seed: int = 0):
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((K * ROWS, d)) / np.sqrt(d)
  p = 1.0 / (1.0 + np.exp(-(a @ (2.0 * rng.standard_normal(d)) + 0.5)))
  y = np.where(rng.random(K * ROWS) < p, 1.0, -1.0)
  a1 = np.hstack([a, np.ones((K * ROWS, 1))])
  theta = np.zeros(d + 1)
  for _ in range(30):
    s = 1.0 / (1.0 + np.exp(y * (a1 @ theta)))
    grad = -(a1.T @ (y * s)) / len(a1) + lam * theta
    hess = (a1.T * (s * (1 - s))) @ a1 / len(a1) + lam * np.eye(d + 1)
    theta -= np.linalg.solve(hess, grad)

  def f(w, b):
    z = y * (a @ np.asarray(w, np.float64) + float(b))
    return float(np.mean(np.logaddexp(0.0, -z)) + 0.5 * lam * (w @ w + float(b) ** 2))

  lmax = 0.25 * float(np.max(np.sum(a1**2, axis=1))) + lam
  return a, y, f, f(theta[:d], theta[d]), lmax


def run(d: int, lam: float, epochs: int, eta_l: float) -> list[dict]:
  a, y, f, fstar, lmax = _problem(d, lam)
  eta = eta_l / lmax
  steps = ROWS // BATCH

  def loss(params, batch):
    x, t = batch
    z = t * (x @ params["w"] + params["b"])
    reg = 0.5 * lam * (jnp.sum(jnp.square(params["w"])) + jnp.square(params["b"]))
    return jnp.mean(jnp.logaddexp(0.0, -z)) + reg

  mesh = jax.make_mesh((K,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
  xs, ys = jax.device_put(
    (jnp.asarray(a, jnp.float32), jnp.asarray(y, jnp.float32)), NamedSharding(mesh, P(AXIS))
  )
  params0 = {"w": jnp.zeros((d,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
  variants = {
    "SVRG (dense, Identity codec)": dict(codec=jc.codecs.Identity()),
    "QSVRG s=sqrt(n) (paper)": {},
    "QSVRG s=sqrt(n), buckets of 8": dict(bucket_size=8),
    "QSVRG s=1 (2 bits)": dict(levels=1),
  }
  rows = []
  for name, kw in variants.items():
    # The paper's exchange (every device decodes every payload) at K = 8, not "auto"'s
    # two-phase one, which quantizes the chunk averages again.
    opt = jc.qsvrg(loss, eta, axis_name=AXIS, collective="allgather", **kw)

    def epoch(params, state, x, t, key, opt=opt):
      k = jax.random.fold_in(key, lax.axis_index(AXIS))
      idx = jax.random.randint(k, (steps, BATCH), 0, ROWS)
      return opt.epoch(params, state, (x, t), (x[idx], t[idx]))

    specs = dict(in_specs=(P(), P(), P(AXIS), P(AXIS), P()), out_specs=(P(), P()))
    step = jax.jit(jax.shard_map(epoch, mesh=mesh, **specs))
    params, state = jax.device_put((params0, opt.init(params0)), NamedSharding(mesh, P()))
    sub = [f(np.zeros(d), 0.0) - fstar]
    for p in range(epochs):
      params, state = step(params, state, xs, ys, jax.random.key(100 + p))
      sub.append(f(np.asarray(params["w"], np.float64), params["b"]) - fstar)
    sub = np.maximum(np.array(sub), 1e-300)
    rate = float(np.exp(np.mean(np.log(sub[1:] / sub[:-1]))))
    batch = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in ((BATCH, d), (BATCH,)))
    report = jc.qsvrg_wire_report(
      opt, params0, batch, axis_name=AXIS, num_devices=K, inner_steps=steps
    )
    bits, dense = report.broadcast_bits_per_epoch, report.dense_bits_per_epoch
    final, bound = float(sub[-1] / sub[0]), report.paper_bound_bits
    rows.append(dict(name=name, rate=rate, final=final, bits=bits, dense=dense, bound=bound))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dim", type=int, default=32)
  parser.add_argument("--lam", type=float, default=0.1)
  parser.add_argument("--epochs", type=int, default=8)
  parser.add_argument("--eta-l", type=float, default=0.6, help="step size times L")
  args = parser.parse_args()
  use_cpu_devices(K)
  rows = run(args.dim, args.lam, args.epochs, args.eta_l)
  n = args.dim + 1
  print(
    f"logistic regression, K={K}, n={n}, lambda={args.lam}, T={ROWS // BATCH}, "
    f"eta={args.eta_l}/L, {args.epochs} epochs; bits per device per epoch"
  )
  print(
    f"{'variant':<32} {'rate/epoch':>10} {'final/initial':>14} {'bits/epoch':>11} "
    f"{'vs dense':>9} {'Elias bound':>12}"
  )
  for r in rows:
    print(
      f"{r['name']:<32} {r['rate']:>10.4f} {r['final']:>14.2e} {r['bits']:>11,} "
      f"{r['dense'] / r['bits']:>8.2f}x {r['bound']:>12,.0f}"
    )


if __name__ == "__main__":
  main()
