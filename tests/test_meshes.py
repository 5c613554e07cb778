"""Multi-axis meshes: tensor-parallel weights, gradients compressed over the data axis.

``jc.state_specs(..., param_specs=...)`` places every transform's state on a (4, 2)
("data", "model") mesh and a (2, 2, 2) one; each runs under ``jax.shard_map`` with
check_vma on, chained with momentum SGD (whose trace is sharded like its parameter). The
exchange over "data" of a model-sharded
leaf is the 1-D exchange of that shard: checked bit for bit against a run on a 1-D
mesh of the same shard's gradients.
"""

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

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
  state_specs = jc.state_specs(
    tx, params, axis_name=data, num_devices=mesh.shape[data], param_specs=specs, mesh=mesh
  )
  put = lambda tree, s: jax.device_put(
    tree,
    jax.tree.map(  # noqa: E731
      lambda sp: jax.NamedSharding(mesh, sp), s
    ),
  )
  params = put(params, specs)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs))(
    params
  )

  def step(p, s, x):
    g = jax.grad(loss)(jc.vary(p, data), x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, u

  f = jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(specs, state_specs, P(data)), out_specs=(specs, state_specs, specs)
    )
  )
  ups = []
  for x in xs:
    params, state, u = f(params, state, jax.device_put(x, jax.NamedSharding(mesh, P(data))))
    ups.append(u)
  return params, state, ups, state_specs


def batches(n=2, rows=16):
  return [jax.random.normal(jax.random.key(i), (rows, 64)) for i in range(n)]


TRANSFORMS = {
  "qsgd": lambda: jc.per_device_state(jc.qsgd(axis_name=D, collective="allgather")),
  "qsgd_two_phase_ef": lambda: jc.per_device_state(
    jc.qsgd(axis_name=D, collective="two_phase", error_feedback=True)
  ),
  "onebit_sgd": lambda: jc.per_device_state(jc.onebit_sgd(axis_name=D)),
  "dgc": lambda: jc.per_device_state(jc.dgc(0.01, axis_name=D, collective="allgather")),
  "sparsify": lambda: jc.per_device_state(jc.sparsify(density=0.05, axis_name=D)),
  "mipd": lambda: jc.mipd(axis_name=D),
  "topk_ef": lambda: jc.per_device_state(
    jc.compress(jc.codecs.TopK(0.05), axis_name=D, error_feedback=True, collective="allgather")
  ),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transform_trains_on_a_2d_mesh(name):
  tx = optax.chain(TRANSFORMS[name](), optax.sgd(1e-2, momentum=0.9))
  mesh = mesh2d()
  params, state, ups, specs = run_steps(tx, mesh, PARAMS, SPECS, batches())
  for leaf in jax.tree.leaves(params):
    assert bool(jnp.all(jnp.isfinite(leaf)))
  assert any(float(jnp.max(jnp.abs(u))) > 0 for u in jax.tree.leaves(ups[-1]))
  # Each state leaf sits where its spec says (the per-device rows over "data").
  for leaf, spec in zip(
    jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  ):
    assert leaf.sharding.spec == spec or leaf.sharding.is_equivalent_to(
      jax.NamedSharding(mesh, spec), leaf.ndim
    )
  # The optimizer's momentum of a tensor-parallel kernel is sharded like the kernel.
  trim = lambda sp: P(*sp[: max([i + 1 for i, e in enumerate(sp) if e is not None] or [0])])  # noqa: E731
  assert jax.tree.map(trim, specs[1][0].trace) == jax.tree.map(trim, SPECS)
  assert state[1][0].trace["w1"].sharding.spec == P(None, M)


def test_identity_is_pmean_over_data_exactly():
  mesh = mesh2d()
  tx = jc.per_device_state(jc.compress(jc.codecs.Identity(), axis_name=D, collective="allgather"))
  state_specs = jc.state_specs(tx, PARAMS, axis_name=D, num_devices=4, param_specs=SPECS, mesh=mesh)
  params = jax.device_put(PARAMS, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), SPECS))
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(SPECS,), out_specs=state_specs))(
    params
  )

  def step(p, s, x):
    g = jax.grad(loss)(jc.vary(p, D), x)
    u, _ = tx.update(g, s, p)
    return u, jax.tree.map(lambda a: jax.lax.pmean(a, D), g)

  f = jax.jit(
    jax.shard_map(step, mesh=mesh, in_specs=(SPECS, state_specs, P(D)), out_specs=(SPECS, SPECS))
  )
  x = jax.device_put(batches(1)[0], jax.NamedSharding(mesh, P(D)))
  got, want = f(params, state, x)
  chex.assert_trees_all_equal(got, want)


def test_a_sharded_leaf_is_exchanged_like_its_shard_on_a_1d_mesh():
  """OneBit (deterministic) with two-phase error feedback: the 2-D run's model shard m
  equals a 1-D run over "data" of shard m's gradients, bit for bit, over two steps."""
  k = 4
  params = {"w": jnp.zeros((64, 64))}
  grads = jax.random.normal(jax.random.key(3), (2, k, 64, 64))  # step, data device
  make = lambda: jc.per_device_state(  # noqa: E731
    jc.compress(jc.codecs.OneBit(256), axis_name=D, collective="two_phase", error_feedback=True)
  )

  def updates(mesh, specs, g_spec, sl):
    tx = make()
    st_specs = jc.state_specs(
      tx,
      {"w": params["w"][:, sl]} if sl else params,
      axis_name=D,
      num_devices=k,
      param_specs=specs,
      mesh=mesh,
    )
    p = params if sl is None else {"w": params["w"][:, sl]}
    p = jax.device_put(p, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs))
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=st_specs))(p)
    f = jax.jit(
      jax.shard_map(
        lambda g, s: tx.update({"w": g[0]}, s),
        mesh=mesh,
        in_specs=(g_spec, st_specs),
        out_specs=(specs, st_specs),
      )
    )
    out = []
    for t in range(2):
      g = grads[t] if sl is None else grads[t][:, :, sl]
      u, state = f(jax.device_put(g, jax.NamedSharding(mesh, g_spec)), state)
      out.append(u["w"])
    return out

  two_d = updates(mesh2d(), {"w": P(None, M)}, P(D, None, M), None)
  mesh1 = jax.make_mesh((k,), (D,), devices=jax.devices()[:k])
  for m, sl in enumerate((slice(0, 32), slice(32, 64))):
    one_d = updates(mesh1, {"w": P()}, P(D), sl)
    for t in range(2):
      np.testing.assert_array_equal(
        np.asarray(two_d[t])[:, 32 * m : 32 * (m + 1)], np.asarray(one_d[t])
      )


def test_three_axis_mesh():
  mesh = jax.make_mesh((2, 2, 2), (D, M, "expert"), devices=jax.devices()[:8])
  params = {"w": jnp.full((64, 64), 0.1), "b": jnp.zeros((64,))}
  specs = {"w": P(None, (M, "expert")), "b": P((M, "expert"))}  # columns over 4 shards

  def loss3(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

  for inner, identity in (
    (jc.per_device_state(jc.onebit_sgd(axis_name=D)), False),
    (
      jc.per_device_state(jc.compress(jc.codecs.Identity(), axis_name=D, collective="allgather")),
      True,
    ),
  ):
    tx = optax.chain(inner, optax.sgd(0.1))
    st_specs = jc.state_specs(tx, params, axis_name=D, num_devices=2, param_specs=specs, mesh=mesh)
    p = jax.device_put(params, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), specs))
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=st_specs))(p)

    def step(p, s, x):
      g = jax.grad(loss3)(jc.vary(p, D), x)
      u, s = tx.update(g, s, p)
      return u, s, jax.tree.map(lambda a: -0.1 * jax.lax.pmean(a, D), g)

    f = jax.jit(
      jax.shard_map(
        step, mesh=mesh, in_specs=(specs, st_specs, P(D)), out_specs=(specs, st_specs, specs)
      )
    )
    x = jax.device_put(batches(1, 8)[0], jax.NamedSharding(mesh, P(D)))
    u, state, dense = f(p, state, x)
    if identity:
      chex.assert_trees_all_equal(u, dense)
    else:  # 1-bit: the same sign pattern as the dense mean almost everywhere
      agree = jnp.mean((jnp.sign(u["w"]) == jnp.sign(dense["w"])).astype(jnp.float32))
      assert float(agree) > 0.6
    chex.assert_trees_all_equal(jax.tree.map(jnp.shape, u), jax.tree.map(jnp.shape, params))


def test_state_specs_errors():
  mesh = mesh2d()
  tx = jc.per_device_state(jc.onebit_sgd(axis_name=D))
  with pytest.raises(ValueError, match="num_devices=8 but the mesh's axis 'data' has 4"):
    jc.state_specs(tx, PARAMS, axis_name=D, num_devices=8, param_specs=SPECS, mesh=mesh)
  with pytest.raises(ValueError, match="the data axis"):
    jc.state_specs(
      tx, PARAMS, axis_name=D, num_devices=4, param_specs={**SPECS, "w1": P(D, None)}, mesh=mesh
    )
  with pytest.raises(ValueError, match="pass mesh="):
    jc.state_specs(tx, PARAMS, axis_name=D, num_devices=4, param_specs=SPECS)
  with pytest.raises(ValueError, match="does not divide"):
    jc.state_specs(
      tx,
      {**PARAMS, "b1": jnp.zeros((63,))},
      axis_name=D,
      num_devices=4,
      param_specs=SPECS,
      mesh=mesh,
    )
  with pytest.raises(ValueError, match="structure of params"):
    jc.state_specs(tx, PARAMS, axis_name=D, num_devices=4, param_specs={"w1": P()}, mesh=mesh)
  # The mesh can also come from the params' shardings.
  placed = jax.device_put(PARAMS, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), SPECS))
  specs = jc.state_specs(tx, placed, axis_name=D, num_devices=4, param_specs=SPECS)
  assert specs.inner.residual["w1"] == P(D, None, M)


def test_state_specs_1d_unchanged():
  """Without param_specs: per-device leaves P(axis), the rest P()."""
  tx = optax.chain(jc.per_device_state(jc.onebit_sgd(axis_name=D)), optax.adam(1e-3))
  specs = jc.state_specs(tx, PARAMS, axis_name=D, num_devices=8)
  flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  per_device = jax.tree.leaves(specs[0], is_leaf=lambda x: isinstance(x, P))
  assert per_device and all(
    s == P(D) or s == P(D, None) or s == P(D, None, None) for s in per_device
  )
  assert all(s == P() for s in flat[len(per_device) :])
