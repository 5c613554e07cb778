r"""Data + tensor parallelism: compressed gradients over "data", weights sharded over "model".

A two-layer MLP on a ("data", "model") mesh, Megatron style: the hidden layer's kernel
is split by columns over "model", the output kernel by rows, and the partial outputs
are summed over "model" (``lax.psum``). The gradients are exchanged over "data" only,
as 1-bit SGD with error feedback, accumulated over ``--accumulate`` mini-steps
(``jc.multi_steps``: one exchange per update), and a step whose gradient is NaN/Inf
on any device is skipped on all of them (``jc.skip_nonfinite``). ``jc.state_specs``
places the optimizer state: the residuals per data device and sharded like their
kernels, Adam's moments sharded like their kernels.

From the repository root::

  python -m examples.tensor_parallel                     # (4, 2) mesh on 8 CPU devices
  python -m examples.tensor_parallel --mesh 2,2,2        # a third axis, "expert"
  python -m examples.tensor_parallel --nan-at 3          # a NaN on one device at step 3
"""

import os

import jax

if os.environ.get("JAX_PLATFORMS", "cpu").lower() in ("", "cpu"):
  try:
    jax.config.update("jax_num_cpu_devices", 8)
  except RuntimeError:  # backends already up: keep their devices
    pass

# pylint: disable=wrong-import-position
import argparse

from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import jaxcomp as jc

DATA, MODEL, EXPERT = "data", "model", "expert"


def init_params(key, d_in=64, hidden=256, d_out=10):
  k1, k2 = jax.random.split(key)
  return {
    "w1": jax.random.normal(k1, (d_in, hidden)) / np.sqrt(d_in),
    "b1": jnp.zeros((hidden,)),
    "w2": jax.random.normal(k2, (hidden, d_out)) / np.sqrt(hidden),
    "b2": jnp.zeros((d_out,)),
  }


def param_specs(three_axes: bool):
  """Columns of w1 (and b1) and rows of w2 over the tensor-parallel axes."""
  tp = (MODEL, EXPERT) if three_axes else MODEL
  return {"w1": P(None, tp), "b1": P(tp), "w2": P(tp, None), "b2": P()}


def loss_fn(params, batch, tp_axes):
  x, y = batch
  h = jax.nn.relu(x @ params["w1"] + params["b1"])  # this device's hidden columns
  logits = lax.psum(h @ params["w2"], tp_axes) + params["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_data(n, key, d_in=64, classes=10):
  """A learnable toy task: labels from a fixed random linear map."""
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (n, d_in))
  y = jnp.argmax(x @ jax.random.normal(kw, (d_in, classes)), axis=1)
  return x, y


def train(mesh_shape=(4, 2), steps=20, accumulate=2, nan_at=-1, seed=0, log=print):
  """Trains and returns ``(losses, notfinite_count, params)``."""
  three = len(mesh_shape) == 3
  names = (DATA, MODEL, EXPERT)[: len(mesh_shape)]
  mesh = jax.make_mesh(tuple(mesh_shape), names, devices=jax.devices()[: int(np.prod(mesh_shape))])
  tp_axes = names[1:]
  specs = param_specs(three)
  k = mesh.shape[DATA]

  tx = jc.multi_steps(
    jc.skip_nonfinite(
      optax.chain(
        jc.per_device_state(jc.onebit_sgd(bucket_size=256, axis_name=DATA)), optax.adam(3e-3)
      ),
      axis_name=DATA,
    ),
    every_k_schedule=accumulate,
  )
  state_specs = jc.state_specs(
    tx,
    init_params(jax.random.key(seed)),
    axis_name=DATA,
    num_devices=k,
    param_specs=specs,
    mesh=mesh,
  )
  params = jax.device_put(
    init_params(jax.random.key(seed)), jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  )
  opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs))(
    params
  )

  def train_step(params, opt_state, batch, poison):
    grads = jax.grad(loss_fn)(jc.vary(params, DATA), batch, tp_axes)
    # --nan-at: one device's gradient turns NaN (a stand-in for an overflow).
    bad = (poison > 0) & (lax.axis_index(DATA) == 1)
    grads = jax.tree.map(lambda g: jnp.where(bad, jnp.nan, g), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    loss = lax.pmean(loss_fn(params, batch, tp_axes), DATA)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(
    jax.shard_map(
      train_step,
      mesh=mesh,
      in_specs=(specs, state_specs, P(DATA), P()),
      out_specs=(specs, state_specs, P()),
    )
  )
  x, y = make_data(2048, jax.random.key(seed + 1))
  per_step = 16 * k
  losses = []
  for t in range(steps):
    lo = (t * per_step) % (x.shape[0] - per_step + 1)
    batch = jax.device_put(
      (x[lo : lo + per_step], y[lo : lo + per_step]), NamedSharding(mesh, P(DATA))
    )
    params, opt_state, loss = step(params, opt_state, batch, jnp.int32(t == nan_at))
    losses.append(float(loss))
    if t % 5 == 0 or t == steps - 1:
      log(f"step {t:3d}  loss {losses[-1]:.4f}")
  skipped = int(opt_state.inner_opt_state.notfinite_count)
  log(f"steps skipped (non-finite): {skipped}")
  return losses, skipped, params


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mesh", default="4,2", help="data,model[,expert] axis sizes")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--accumulate", type=int, default=2, help="mini-steps per update")
  parser.add_argument(
    "--nan-at",
    type=int,
    default=-1,
    help="mini-step at which one device's gradient is NaN (-1: never)",
  )
  args = parser.parse_args(argv)
  shape = tuple(int(s) for s in args.mesh.split(","))
  if len(shape) not in (2, 3):
    raise ValueError(f"--mesh takes 2 or 3 axis sizes, got {args.mesh!r}")
  train(shape, args.steps, args.accumulate, args.nan_at)


if __name__ == "__main__":
  main()
