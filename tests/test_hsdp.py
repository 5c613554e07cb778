"""jc.hsdp: parameters sharded over the fast axis of a (2, 4) mesh of the 8 CPU devices
(2 nodes of L = 4 devices), replicated over the nodes, the exchange between nodes
compressed; under jax.shard_map with check_vma on."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc

SLOW, FAST = "node", "gpu"
AXES = (SLOW, FAST)
N, L = 2, 4

# Every first axis divisible by L. "w" has 2048 values: the default filter compresses
# it, but not its (16, 32) shard of 512.
PARAMS = {"w": jnp.zeros((64, 32)), "v": jnp.zeros((32, 40)), "b": jnp.zeros((12,))}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N, L), AXES)


def _grads(key, params=PARAMS):
  """One full-size gradient per device: each leaf with a leading axis of N·L."""
  keys = jax.random.split(key, len(params))
  return {
    name: jax.random.normal(k, (N * L,) + p.shape, p.dtype)
    for k, (name, p) in zip(keys, sorted(params.items()))
  }


def _shard(x, f):
  """Rows f of L of ``x``: what P(FAST) gives device f."""
  s = x.shape[0] // L
  return x[f * s : (f + 1) * s]


def _specs(tx, mesh, params=PARAMS):
  return jc.state_specs(
    tx, params, axis_name=AXES, num_devices=N * L, mesh=mesh, param_specs=P(FAST)
  )


def _placed(params, mesh):
  return jax.device_put(params, NamedSharding(mesh, P(FAST)))


def _init(tx, mesh, params=PARAMS):
  specs = _specs(tx, mesh, params)
  params = _placed(params, mesh)
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(FAST), out_specs=specs)
  return jax.jit(init)(params), specs


def _shard_grads(shards, g):
  """The gradient of the shards through jc.fsdp_gather when the gathered weights'
  local gradient is ``g``: the node's mean of this device's shard (dense backward)."""

  def loss(shards):
    w = jc.fsdp_gather(shards, axis_name=FAST)
    return sum(jnp.vdot(w[k], g[k]) for k in w)

  return jax.grad(loss)(jc.vary(shards, SLOW))


def _run(tx, route, mesh, grads, params=PARAMS, steps=1):
  """``steps`` updates of the ``jc.hsdp`` ``tx`` on the same per-device gradients: for
  ``grads="shards"`` through jc.fsdp_gather's backward, for ``"full"`` as they are.
  Returns every device's updates, ``(N·L, steps, *shard)`` per leaf, and the state."""
  state, specs = _init(tx, mesh, params)
  grads = jax.device_put(grads, NamedSharding(mesh, P(AXES)))

  def run(g, state, shards):
    g = jax.tree.map(lambda x: x[0], g)

    def step(state, _):
      gi = _shard_grads(shards, g) if route == "shards" else g
      u, state = tx.update(gi, state, shards)
      return state, u

    state, us = jax.lax.scan(step, state, None, length=steps)
    return jax.tree.map(lambda u: u[None], us), state

  fn = jax.shard_map(
    run, mesh=mesh, in_specs=(P(AXES), specs, P(FAST)), out_specs=(P(AXES), specs)
  )
  return jax.jit(fn)(grads, state, _placed(params, mesh))


def _hsdp(inner, route):
  return jc.hsdp(inner, fast_axis=FAST, grads=route)


ROUTES = ("shards", "full")


@pytest.mark.parametrize("route", ROUTES)
def test_identity_codec_gives_the_shard_of_the_mean_over_both_axes(mesh, route):
  """Both routes: device (n, f) gets rows f of the mean over all N·L devices of their
  full-size gradients, for every node n."""
  grads = _grads(jax.random.key(0))
  tx = _hsdp(jc.compress(jc.codecs.Identity(), axis_name=SLOW), route)
  out, _ = _run(tx, route, mesh, grads)
  for name, g in grads.items():
    mean = np.asarray(g).mean(0)
    for i in range(N * L):
      got = np.asarray(out[name])[i, 0]
      assert got.shape == (PARAMS[name].shape[0] // L,) + PARAMS[name].shape[1:]
      assert out[name].dtype == g.dtype
      np.testing.assert_allclose(got, _shard(mean, i % L), rtol=1e-6, atol=1e-6, err_msg=name)
