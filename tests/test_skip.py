"""``jc.skip_nonfinite``: a step with a NaN on one device is skipped on every device.

The inner transform (and its collectives) runs every step; on a skipped step every
device returns zero updates and keeps its state bit for bit. Under ``jax.pmap`` the
run goes in a fresh process with a timeout: a device that skipped a collective the
others entered would hang, and a hang must fail the test, not the suite.
"""

import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc
from tests.helpers import AXIS
from tests.helpers import K
from tests.helpers import mesh
from tests.helpers import shard

PARAMS = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}

TRANSFORMS = {
  "qsgd": lambda: jc.per_device_state(jc.qsgd(axis_name=AXIS, collective="allgather")),
  "qsgd_two_phase_ef": lambda: jc.per_device_state(
    jc.qsgd(axis_name=AXIS, collective="two_phase", error_feedback=True)
  ),
  "onebit_sgd": lambda: jc.per_device_state(jc.onebit_sgd(axis_name=AXIS)),
  "dgc": lambda: jc.per_device_state(jc.dgc(0.01, axis_name=AXIS, collective="allgather")),
  "sparsify": lambda: jc.per_device_state(jc.sparsify(density=0.05, axis_name=AXIS)),
  "mipd": lambda: jc.mipd(axis_name=AXIS),
  "topk_ef": lambda: jc.per_device_state(
    jc.compress(jc.codecs.TopK(0.05), axis_name=AXIS, error_feedback=True, collective="allgather")
  ),
}


def grads(t, bad_leaf=None, device=3):
  g = {
    "w": jax.random.normal(jax.random.key(t), (K, 64, 32)) + 1.0,
    "b": jax.random.normal(jax.random.key(100 + t), (K, 32)),
  }
  if bad_leaf is not None:
    g[bad_leaf] = g[bad_leaf].at[device, 5].set(jnp.nan)
  return g


def shard_map_steps(tx, m):
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=K)
  state = jax.jit(jax.shard_map(tx.init, mesh=m, in_specs=P(), out_specs=specs))(PARAMS)

  def step(g, s):
    # Every device's own copy of the updates (the exchange makes them identical).
    u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, PARAMS)
    return jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying")[None], u), s

  f = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(AXIS), specs), out_specs=(P(AXIS), specs)))
  return state, lambda g, s: f(shard(g, m), s)


@pytest.mark.parametrize("bad_leaf", ["w", "b"])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_one_device_nan_skips_everywhere_under_shard_map(name, bad_leaf):
  tx = jc.skip_nonfinite(
    optax.chain(TRANSFORMS[name](), optax.sgd(1e-2, momentum=0.9)), axis_name=AXIS
  )
  state, step = shard_map_steps(tx, mesh())
  _, state = step(grads(0), state)
  before = jax.device_get(state)
  ups, state = step(grads(1, bad_leaf), state)
  for leaf in jax.tree.leaves(ups):  # zero on every device
    np.testing.assert_array_equal(np.asarray(leaf), 0)
  chex.assert_trees_all_equal(jax.device_get(state.inner_state), before.inner_state)
  np.testing.assert_array_equal(np.asarray(state.notfinite_count), 1)
  ups, state = step(grads(2), state)  # and training goes on
  assert any(float(jnp.max(jnp.abs(u))) > 0 for u in jax.tree.leaves(ups))
  np.testing.assert_array_equal(np.asarray(state.notfinite_count), 1)


def test_finite_steps_are_not_changed():
  """Without a NaN the wrapper returns the inner transform's updates and state."""
  inner = optax.chain(TRANSFORMS["onebit_sgd"](), optax.sgd(1e-2, momentum=0.9))
  m = mesh()
  s_in, f_in = shard_map_steps(inner, m)
  s_sk, f_sk = shard_map_steps(jc.skip_nonfinite(inner, axis_name=AXIS), m)
  for t in range(2):
    u_in, s_in = f_in(grads(t), s_in)
    u_sk, s_sk = f_sk(grads(t), s_sk)
    chex.assert_trees_all_equal(u_in, u_sk)
  chex.assert_trees_all_equal(s_in, s_sk.inner_state)


def test_tensor_parallel_shards_skip_together():
  """A NaN in one model shard of one data device: all 8 devices skip."""
  m2 = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
  specs = {"w": P(None, "model"), "b": P("model")}
  tx = jc.skip_nonfinite(
    optax.chain(jc.per_device_state(jc.onebit_sgd(axis_name="data")), optax.sgd(0.1)),
    axis_name="data",
  )
  st_specs = jc.state_specs(tx, PARAMS, axis_name="data", num_devices=4, param_specs=specs, mesh=m2)
  state = jax.jit(jax.shard_map(tx.init, mesh=m2, in_specs=(specs,), out_specs=st_specs))(
    jax.device_put(PARAMS, jax.tree.map(lambda s: jax.NamedSharding(m2, s), specs))
  )
  g_specs = {"w": P("data", None, "model"), "b": P("data", "model")}
  f = jax.jit(
    jax.shard_map(
      lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s),
      mesh=m2,
      in_specs=(g_specs, st_specs),
      out_specs=(specs, st_specs),
    )
  )
  g = jax.tree.map(lambda x: x[:4], grads(0))
  g["w"] = g["w"].at[1, 0, 31].set(jnp.inf)  # data device 1, model shard 1 only
  g = jax.device_put(g, jax.tree.map(lambda s: jax.NamedSharding(m2, s), g_specs))
  ups, state = f(g, state)
  np.testing.assert_array_equal(np.asarray(ups["w"]), 0)
  np.testing.assert_array_equal(np.asarray(state.notfinite_count), 1)


def test_compress_counts_a_nan_in_a_dense_leaf():
  tx = jc.compress(jc.codecs.OneBit(), axis_name=AXIS, collective="allgather")
  state = jax.pmap(lambda _: tx.init(PARAMS), axis_name=AXIS)(jnp.arange(K))
  out, state = jax.pmap(tx.update, axis_name=AXIS)(grads(0, "b"), state)
  np.testing.assert_array_equal(np.asarray(state.nonfinite_count)[3], 1)
  assert not np.isfinite(np.asarray(out["b"])).all()


def test_apply_if_finite_is_not_collective_safe():
  """Why skip_nonfinite exists: optax.apply_if_finite's per-device branch around the
  exchange does not trace under shard_map with check_vma."""
  tx = optax.apply_if_finite(jc.per_device_state(jc.onebit_sgd(axis_name=AXIS)), 3)
  with pytest.raises(TypeError, match="cond branches must have equal output types"):
    state, step = shard_map_steps(tx, mesh())
    step(grads(0), state)


_PMAP_SCRIPT = textwrap.dedent("""
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp, numpy as np, optax, jaxcomp as jc
    params = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
    for inner in (jc.onebit_sgd(axis_name="i"), jc.dgc(0.01, axis_name="i"),
                  jc.mipd(axis_name="i")):
      tx = jc.skip_nonfinite(optax.chain(inner, optax.sgd(0.1)), axis_name="i")
      state = jax.pmap(lambda _: tx.init(params), axis_name="i")(jnp.arange(8))
      step = jax.pmap(lambda g, s: tx.update(g, s, params), axis_name="i")
      g = {"w": jax.random.normal(jax.random.key(0), (8, 64, 32)), "b": jnp.ones((8, 32))}
      _, state = step(g, state)
      before = jax.device_get(state.inner_state)
      ups, state = step({**g, "w": g["w"].at[5, 0, 0].set(jnp.nan)}, state)
      assert all((np.asarray(u) == 0).all() for u in jax.tree.leaves(ups))
      after = jax.device_get(state.inner_state)
      for a, b in zip(jax.tree.leaves(jc.unwrap_keys(before)),
                      jax.tree.leaves(jc.unwrap_keys(after))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      assert (np.asarray(state.notfinite_count) == 1).all()
    print("pmap skip ok")
""")


def test_pmap_skip_in_a_fresh_process():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  done = subprocess.run(
    [sys.executable, "-c", _PMAP_SCRIPT],
    env=env,
    cwd=root,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "pmap skip ok" in done.stdout
