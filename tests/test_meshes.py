"""Multi-axis meshes: tensor-parallel weights, gradients compressed over the data axis.

``jc.state_specs(..., param_specs=...)`` places every transform's state on a (4, 2)
("data", "model") mesh and a (2, 2, 2) one; each runs under ``jax.shard_map`` with
check_vma on, chained with ``optax.adam``. The exchange over "data" of a model-sharded
leaf is the 1-D exchange of that shard: checked bit for bit against a run on a 1-D
mesh of the same shard's gradients.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

D, M = "data", "model"
PARAMS = {"w1": jnp.full((64, 64), 0.1), "b1": jnp.zeros((64,)), "w2": jnp.full((64, 32), 0.1)}
SPECS = {"w1": P(None, M), "b1": P(M), "w2": P(M, None)}


def mesh2d():
  return jax.make_mesh((4, 2), (D, M), devices=jax.devices()[:8])


def loss(p, x):
  return jnp.sum(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]) ** 2 / x.shape[0]


def run_steps(tx, mesh, params, specs, xs, *, data=D):
  """init + len(xs) shard_map steps; returns (params, state, per-step updates)."""
  state_specs = jc.state_specs(tx, params, axis_name=data, num_devices=mesh.shape[data],
                               param_specs=specs, mesh=mesh)
  put = lambda tree, s: jax.device_put(tree, jax.tree.map(  # noqa: E731
      lambda sp: jax.NamedSharding(mesh, sp), s))
  params = put(params, specs)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,),
                                out_specs=state_specs))(params)

  def step(p, s, x):
    g = jax.grad(loss)(jc.vary(p, data), x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, u

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, state_specs, P(data)),
                            out_specs=(specs, state_specs, specs)))
  ups = []
  for x in xs:
    params, state, u = f(params, state, jax.device_put(x, jax.NamedSharding(mesh, P(data))))
    ups.append(u)
  return params, state, ups, state_specs


def batches(n=2, rows=16):
  return [jax.random.normal(jax.random.key(i), (rows, 64)) for i in range(n)]


_UNUSED = {
    "qsgd": lambda: jc.per_device_state(jc.qsgd(axis_name=D)),
    "qsgd_two_phase_ef": lambda: jc.per_device_state(
        jc.qsgd(axis_name=D, collective="two_phase", error_feedback=True)),
    "onebit_sgd": lambda: jc.per_device_state(jc.onebit_sgd(axis_name=D)),
    "dgc": lambda: jc.per_device_state(jc.dgc(0.01, axis_name=D)),
    "sparsify": lambda: jc.per_device_state(jc.sparsify(density=0.05, axis_name=D)),
    "mipd": lambda: jc.mipd(axis_name=D),
    "topk_ef": lambda: jc.per_device_state(
        jc.compress(jc.codecs.TopK(0.05), axis_name=D, error_feedback=True)),
}


def test_identity_is_pmean_over_data_exactly():
  mesh = mesh2d()
  tx = jc.per_device_state(jc.compress(jc.codecs.Identity(), axis_name=D))
  state_specs = jc.state_specs(tx, PARAMS, axis_name=D, num_devices=4, param_specs=SPECS,
                               mesh=mesh)
  params = jax.device_put(PARAMS, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), SPECS))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(SPECS,),
                                out_specs=state_specs))(params)

  def step(p, s, x):
    g = jax.grad(loss)(jc.vary(p, D), x)
    u, _ = tx.update(g, s, p)
    return u, jax.tree.map(lambda a: jax.lax.pmean(a, D), g)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(SPECS, state_specs, P(D)),
                            out_specs=(SPECS, SPECS)))
  x = jax.device_put(batches(1)[0], jax.NamedSharding(mesh, P(D)))
  got, want = f(params, state, x)
  chex.assert_trees_all_equal(got, want)


def test_state_specs_errors():
  mesh = mesh2d()
  tx = jc.per_device_state(jc.onebit_sgd(axis_name=D))
  with pytest.raises(ValueError, match="num_devices=8 but the mesh's axis 'data' has 4"):
    jc.state_specs(tx, PARAMS, axis_name=D, num_devices=8, param_specs=SPECS, mesh=mesh)
  with pytest.raises(ValueError, match="the data axis"):
    jc.state_specs(tx, PARAMS, axis_name=D, num_devices=4,
                   param_specs={**SPECS, "w1": P(D, None)}, mesh=mesh)
  with pytest.raises(ValueError, match="pass mesh="):
    jc.state_specs(tx, PARAMS, axis_name=D, num_devices=4, param_specs=SPECS)
  with pytest.raises(ValueError, match="does not divide"):
    jc.state_specs(tx, {**PARAMS, "b1": jnp.zeros((63,))}, axis_name=D, num_devices=4,
                   param_specs=SPECS, mesh=mesh)
  with pytest.raises(ValueError, match="structure of params"):
    jc.state_specs(tx, PARAMS, axis_name=D, num_devices=4, param_specs={"w1": P()},
                   mesh=mesh)
  # The mesh can also come from the params' shardings.
  placed = jax.device_put(PARAMS, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), SPECS))
  specs = jc.state_specs(tx, placed, axis_name=D, num_devices=4, param_specs=SPECS)
  assert specs.inner.residual["w1"] == P(D, None, M)
