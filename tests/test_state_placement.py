"""One way to hold state: every jaxcomp transform wrapped in jc.per_device_state.

The README's shard_map pattern (the compressor wrapped in ``jc.per_device_state``, the
optimizer after it, parameters and their updates replicated) runs for every method, and
matches the same method under ``jax.pmap`` (where nothing is wrapped).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K

PARAMS = {"w": jnp.full((64, 48), 0.5, jnp.float32), "b": jnp.zeros((48,), jnp.float32)}

METHODS = {
  "compress": lambda: jc.compress(
    jc.codecs.QSGD(7, 512, "max"), axis_name=AXIS, collective="allgather"
  ),
  "qsgd": lambda: jc.qsgd(axis_name=AXIS, collective="two_phase"),
  "onebit_sgd": lambda: jc.onebit_sgd(axis_name=AXIS),
  "ef_signsgd": lambda: jc.ef_signsgd(axis_name=AXIS),
  "sparsify": lambda: jc.sparsify(density=0.1, axis_name=AXIS),
  "powersgd": lambda: jc.powersgd(2, axis_name=AXIS),
  "dgc": lambda: jc.dgc(0.01, axis_name=AXIS, collective="allgather"),
  "mipd": lambda: jc.mipd(0.5, axis_name=AXIS),
  "onebit_adam": lambda: jc.onebit_adam(1e-2, freeze_step=1, axis_name=AXIS),
  "decoupled_momentum": lambda: jc.decoupled_momentum(
    1e-2, chunk_size=16, topk=8, axis_name=AXIS, filter=lambda path, leaf: leaf.ndim == 2
  ),
}


def _loss(params, x):
  return jnp.mean(jnp.square(x @ params["w"] + params["b"]))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_readme_pattern_runs_every_method_wrapped(name):
  """Three steps of the README's train_step with the method wrapped in per_device_state:
  the parameters stay replicated (shard_map checks it) and equal pmap's, unwrapped."""
  method = METHODS[name]
  tx = optax.chain(jc.per_device_state(method()), optax.sgd(0.1))
  m = helpers.mesh()
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=K)
  state = jax.jit(jax.shard_map(tx.init, mesh=m, in_specs=P(), out_specs=specs))(PARAMS)

  def train_step(params, opt_state, x):
    grads = jax.grad(_loss)(jc.vary(params, AXIS), x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.jit(
    jax.shard_map(train_step, mesh=m, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
  )
  ptx = optax.chain(method(), optax.sgd(0.1))
  stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (K, *p.shape)), PARAMS)
  pstate = jax.pmap(ptx.init, axis_name=AXIS)(stacked)

  def pstep(params, opt_state, x):
    grads = jax.grad(_loss)(params, x)
    updates, opt_state = ptx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  pstep = jax.pmap(pstep, axis_name=AXIS)
  params, pparams = PARAMS, stacked
  for t in range(3):
    x = jax.random.normal(jax.random.key(t), (K * 4, 64))
    params, state = step(params, state, helpers.shard(x, m))
    pparams, pstate = pstep(pparams, pstate, x.reshape(K, 4, 64))
  for name_, leaf in params.items():
    assert np.all(np.isfinite(np.asarray(leaf)))
    np.testing.assert_allclose(
      np.asarray(pparams[name_][0]), np.asarray(leaf), rtol=1e-5, atol=1e-6
    )
  assert not np.array_equal(np.asarray(params["w"]), np.asarray(PARAMS["w"]))


@pytest.mark.parametrize("name", ["mipd", "onebit_adam"])
def test_transforms_that_place_their_own_state_come_back_unchanged(name):
  """MIPD's state is the same on every device, 1-bit Adam wraps its per-device buffers
  itself: per_device_state returns them as they are (their state is not stacked)."""
  tx = METHODS[name]()
  assert jc.per_device_state(tx) is tx
  other = jc.compress(jc.codecs.Identity(), axis_name=AXIS, collective="allgather")
  assert jc.per_device_state(other) is not other
