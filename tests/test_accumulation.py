"""Gradient accumulation around a compressed exchange.

``optax.MultiSteps`` and ``jc.multi_steps`` over ``optax.chain(jc.per_device_state(
<exchange>), optax.sgd(..., momentum=0.9))``, under ``jax.shard_map`` with ``jc.state_specs`` (the
accumulated gradients are local: per device) and under ``jax.pmap``. With the Identity
codec both equal dense accumulation; ``jc.multi_steps`` runs the exchange once per k
mini-steps (its collectives sit in a ``lax.cond``), ``optax.MultiSteps`` on every one.
"""

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

PARAMS = {"w": jnp.full((64, 32), 0.5), "b": jnp.zeros((32,))}
EVERY = 3
STEPS = 6


def mini_batches():
  return [
    {
      "w": jax.random.normal(jax.random.key(t), (K, 64, 32)),
      "b": jax.random.normal(jax.random.key(50 + t), (K, 32)),
    }
    for t in range(STEPS)
  ]


def pmean_exchange():
  """The dense reference: lax.pmean of every leaf."""
  return optax.GradientTransformation(
    lambda p: optax.EmptyState(),
    lambda u, s, p=None: (jax.tree.map(lambda g: jax.lax.pmean(g, AXIS), u), s),
  )


def wrap(kind, inner):
  if kind == "optax":
    tx = optax.MultiSteps(inner, every_k_schedule=EVERY).gradient_transformation()

    # optax.MultiSteps divides float gradients by an int32 count: it needs standard
    # dtype promotion (the suite runs strict, see conftest.py).
    def update(*args, **kwargs):
      with jax.numpy_dtype_promotion("standard"):
        return tx.update(*args, **kwargs)

    return optax.GradientTransformation(tx.init, update)
  return jc.multi_steps(inner, every_k_schedule=EVERY)


def assert_close_to_dense(got, dense):
  """Equal up to the order of the sum over 8 devices (the Identity exchange adds the
  gathered rows, the all-reduce in its own order): a few float32 ulp."""
  chex.assert_trees_all_close(got, dense, rtol=8 * float(jnp.finfo(jnp.float32).eps), atol=0)


def run_shard_map(tx):
  m = mesh()
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=K)
  state = jax.jit(jax.shard_map(tx.init, mesh=m, in_specs=P(), out_specs=specs))(PARAMS)

  def step(p, g, s):
    u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
    return optax.apply_updates(p, u), s

  f = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(), P(AXIS), specs), out_specs=(P(), specs)))
  params, history = PARAMS, []
  for g in mini_batches():
    params, state = f(params, shard(g, m), state)
    history.append(params)
  return history, state, specs, f


@pytest.mark.parametrize("kind", ["optax", "jaxcomp"])
def test_identity_accumulation_equals_dense_under_shard_map(kind):
  dense, _, _, _ = run_shard_map(
    wrap(kind, optax.chain(pmean_exchange(), optax.sgd(0.1, momentum=0.9)))
  )
  got, state, specs, _ = run_shard_map(
    wrap(
      kind,
      optax.chain(
        jc.per_device_state(
          jc.compress(jc.codecs.Identity(), axis_name=AXIS, collective="allgather")
        ),
        optax.sgd(0.1, momentum=0.9),
      ),
    )
  )
  # The accumulated gradients are per device: one row block per device over AXIS.
  assert specs.acc_grads["w"] == P((AXIS,))
  assert state.acc_grads["w"].shape == (K * 64, 32)
  for t in range(STEPS):
    assert_close_to_dense(got[t], dense[t])
  # Parameters move only on every EVERY-th mini-step.
  for t in range(STEPS):
    prev = PARAMS if t == 0 else got[t - 1]
    moved = not np.array_equal(np.asarray(got[t]["w"]), np.asarray(prev["w"]))
    assert moved == ((t + 1) % EVERY == 0), t


def test_compressed_accumulation_multi_steps_matches_optax():
  """The two wrappers give the same training with a real codec (OneBit, two-phase EF)."""
  make = lambda: optax.chain(  # noqa: E731
    jc.per_device_state(jc.onebit_sgd(axis_name=AXIS)), optax.sgd(0.1, momentum=0.9)
  )
  a, sa, _, _ = run_shard_map(wrap("optax", make()))
  b, sb, _, _ = run_shard_map(wrap("jaxcomp", make()))
  # The same arithmetic, fused differently (a cond against a select): a few ulp.
  assert_close_to_dense(a[-1], b[-1])
  assert_close_to_dense(jc.unwrap_keys(sa.inner_opt_state), jc.unwrap_keys(sb.inner_opt_state))


def counting(calls: list) -> optax.GradientTransformation:
  """Passes updates through and records, from the device, each time it runs."""

  def update_fn(updates, state, params=None):
    del params
    jax.debug.callback(lambda: calls.append(1))
    return updates, state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update_fn)


@pytest.mark.parametrize("kind,exchanges", [("optax", STEPS), ("jaxcomp", STEPS // EVERY)])
def test_how_often_the_exchange_runs(kind, exchanges):
  """jc.multi_steps runs the exchange once per EVERY mini-steps (its inner update is in
  a cond on the mini-step counter); optax.MultiSteps on every mini-step."""
  calls = []
  tx = wrap(
    kind,
    optax.chain(
      counting(calls), jc.per_device_state(jc.onebit_sgd(axis_name=AXIS)), optax.sgd(0.1)
    ),
  )
  run_shard_map(tx)
  jax.effects_barrier()
  assert len(calls) == exchanges * K


@pytest.mark.parametrize("kind", ["optax", "jaxcomp"])
def test_identity_accumulation_equals_dense_under_pmap(kind):
  def run(inner):
    tx = wrap(kind, optax.chain(inner, optax.sgd(0.1, momentum=0.9)))
    state = jax.pmap(lambda _: tx.init(PARAMS), axis_name=AXIS)(jnp.arange(K))
    params = jax.tree.map(lambda x: jnp.broadcast_to(x, (K,) + x.shape), PARAMS)

    def step(p, g, s):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    f = jax.pmap(step, axis_name=AXIS)
    for g in mini_batches():
      params, state = f(params, g, state)
    return params

  dense = run(pmean_exchange())
  got = run(jc.compress(jc.codecs.Identity(), axis_name=AXIS, collective="allgather"))
  assert_close_to_dense(got, dense)


def test_multi_steps_validates_k():
  with pytest.raises(ValueError, match="every_k_schedule"):
    jc.multi_steps(optax.sgd(0.1), every_k_schedule=0)


def test_scalar_parameter_accumulation_gets_a_clear_error():
  tx = optax.MultiSteps(jc.per_device_state(jc.onebit_sgd(axis_name=AXIS)), 2)
  with pytest.raises(ValueError, match="0-d parameter"):
    jc.state_specs(
      tx.gradient_transformation(), {"t": jnp.zeros(()), **PARAMS}, axis_name=AXIS, num_devices=K
    )
