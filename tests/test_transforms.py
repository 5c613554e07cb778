"""One harness over every transform, plus bad input, the NaN policy and convergence."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from tests import helpers
from tests.helpers import AXIS, K

# Mixed dtypes in one tree: dtype preservation is checked with a single compilation.
PARAMS = {
    "w32": jnp.zeros((48, 96), jnp.float32),
    "w16": jnp.zeros((64, 64), jnp.bfloat16),
    "b": jnp.zeros((96,), jnp.float32),
}

FACTORIES = {
    "identity": lambda axis: jc.compress(jc.codecs.Identity(), axis_name=axis),
    "bf16": lambda axis: jc.compress(jc.codecs.Cast(jnp.bfloat16), axis_name=axis),
    "fp16_two_phase": lambda axis: jc.compress(jc.codecs.Cast(jnp.float16), axis_name=axis,
                                               collective="two_phase"),
    "qsgd4": lambda axis: jc.qsgd(bits=4, axis_name=axis),
    "qsgd2_l2_two_phase": lambda axis: jc.qsgd(bits=2, bucket_size=128, norm="l2",
                                               axis_name=axis, collective="two_phase"),
    "qsgd8_ef": lambda axis: jc.qsgd(bits=8, axis_name=axis, error_feedback=True),
    "onebit_sgd": lambda axis: jc.onebit_sgd(axis_name=axis),
    "onebit_allgather": lambda axis: jc.onebit_sgd(axis_name=axis, collective="allgather"),
}


def _random_grads(key):
  keys = jax.random.split(key, len(PARAMS))
  return {name: jax.random.normal(k, p.shape, p.dtype)
          for k, (name, p) in zip(keys, sorted(PARAMS.items()))}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_harness_local(name):
  """axis_name=None: dtypes kept, state stable, one compilation, zeros give zeros."""
  chex.clear_trace_counter()
  tx = FACTORIES[name](None)
  state = tx.init(PARAMS)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def update(grads, state):
    return tx.update(grads, state, PARAMS)

  zeros, state1 = update(jax.tree.map(jnp.zeros_like, PARAMS), state)
  chex.assert_trees_all_equal(zeros, PARAMS)  # exactly zero, same dtypes
  updates, state2 = update(_random_grads(jax.random.key(0)), state1)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, PARAMS)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, state1, state2)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_harness_shard_map(name):
  """The same checks on 8 devices under jax.shard_map, with the per-device state."""
  chex.clear_trace_counter()
  m = helpers.mesh()
  tx = jc.per_device_state(FACTORIES[name](AXIS))
  state = helpers.shard_map_init(tx, PARAMS, m)
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=K)

  @chex.assert_max_traces(n=1)
  def step(grads, state):
    return tx.update(jax.tree.map(lambda x: x[0], grads), state, PARAMS)

  update = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(AXIS), specs),
                                 out_specs=(P(), specs)))
  stacked = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), tree)
  zeros, state1 = update(helpers.shard(stacked(PARAMS), m), state)
  chex.assert_trees_all_equal(jax.device_get(zeros), jax.device_get(PARAMS))
  grads = jax.vmap(_random_grads)(jax.random.split(jax.random.key(1), K))
  updates, state2 = update(helpers.shard(grads, m), state1)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, PARAMS)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, state1, state2)
  # Sanity: the update estimates the mean. The loosest codec here, 2-bit l2-norm QSGD on
  # buckets of 128 quantized twice, has relative error ~ sqrt(2 sqrt(128)) ~ 5 on
  # independent noise; garbage (wrong scale or layout) is far off.
  mean = jax.tree.map(lambda g: jnp.mean(g.astype(jnp.float32), 0), grads)
  err = float(jnp.linalg.norm(updates["w32"] - mean["w32"]) / jnp.linalg.norm(mean["w32"]))
  assert err < 12.0, err


# Transforms that are the whole optimizer, exchange included: their updates are parameter
# steps, not a mean gradient, and they place their own per-device state (jc.onebit_adam
# keeps m and v replicated, so the updates are; it is not wrapped in per_device_state).
# freeze_step=2: of the three steps below the last one runs the compression stage.
OPTIMIZER_FACTORIES = {
    "onebit_adam": lambda axis: jc.onebit_adam(0.01, freeze_step=2, axis_name=axis),
    "onebit_adam_buckets": lambda axis: jc.onebit_adam(0.01, freeze_step=2, bucket_size=256,
                                                       axis_name=axis),
}


def _optimizer_harness(name, update, state, grads_of, adam_means):
  """Zeros give zero steps; dtypes kept; state stable; the exchanged momentum points
  where the mean momentum does; the dense leaf is Adam on the mean.

  1-bit Adam's momentum after a compressed step is the scaled sign of the momenta, taken
  twice (worker and server). For Gaussian-like x the scaled sign keeps
  cos(x, s·sign(x)) = E|x| / rms(x) = sqrt(2/π) ≈ 0.8, so two of them keep about 0.64
  of the direction of Adam's (exact) mean momentum (0.8 on one device, where the
  server's input is already a scaled sign); a wrong layout, scale or sign gives about 0
  or less. (The steps themselves are not compared: v frozen after a single
  random gradient weighs a few coordinates enormously.)
  """
  zeros, state1 = update(grads_of(jax.tree.map(jnp.zeros_like, PARAMS)), state)
  chex.assert_trees_all_equal(jax.device_get(zeros), jax.device_get(PARAMS))
  keys = jax.random.split(jax.random.key(11), 2)
  _, state2 = update(grads_of(keys[0]), state1)
  updates, state3 = update(grads_of(keys[1]), state2)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, PARAMS)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, state1, state2, state3)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
  with jax.numpy_dtype_promotion("standard"):
    adam = optax.adam(0.01)
    s = adam.init(PARAMS)
    for g in adam_means:
      ref, s = adam.update(g, s)
  for leaf in ("w32", "w16"):
    a = np.asarray(state3.m[leaf], np.float64).ravel()
    b = np.asarray(s[0].mu[leaf], np.float64).ravel()
    cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    assert cos > 0.4, (name, leaf, cos)
  np.testing.assert_allclose(np.asarray(updates["b"]), np.asarray(ref["b"]), rtol=1e-5,
                             atol=1e-8)  # the dense leaf: Adam on the mean


@pytest.mark.parametrize("name", sorted(OPTIMIZER_FACTORIES))
def test_optimizer_harness_local(name):
  chex.clear_trace_counter()
  tx = OPTIMIZER_FACTORIES[name](None)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def update(grads, state):
    return tx.update(grads, state, PARAMS)

  def grads_of(key_or_tree):
    return key_or_tree if isinstance(key_or_tree, dict) else _random_grads(key_or_tree)

  means = [jax.tree.map(jnp.zeros_like, PARAMS)] + [
      _random_grads(k) for k in jax.random.split(jax.random.key(11), 2)]
  _optimizer_harness(name, update, tx.init(PARAMS), grads_of, means)


@pytest.mark.parametrize("name", sorted(OPTIMIZER_FACTORIES))
def test_optimizer_harness_shard_map(name):
  chex.clear_trace_counter()
  m = helpers.mesh()
  tx = OPTIMIZER_FACTORIES[name](AXIS)
  state = helpers.shard_map_init(tx, PARAMS, m)
  specs = jc.state_specs(tx, PARAMS, axis_name=AXIS, num_devices=K)

  @chex.assert_max_traces(n=1)
  def step(grads, state):
    return tx.update(jax.tree.map(lambda x: x[0], grads), state, PARAMS)

  update = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(AXIS), specs),
                                 out_specs=(P(), specs)))
  stacked = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), tree)

  def per_device(key):
    return jax.vmap(_random_grads)(jax.random.split(key, K))

  def grads_of(key_or_tree):
    tree = stacked(key_or_tree) if isinstance(key_or_tree, dict) else per_device(key_or_tree)
    return helpers.shard(tree, m)

  means = [jax.tree.map(jnp.zeros_like, PARAMS)] + [
      jax.tree.map(lambda g: jnp.mean(g.astype(jnp.float32), 0).astype(g.dtype),
                   per_device(k)) for k in jax.random.split(jax.random.key(11), 2)]
  _optimizer_harness(name, update, state, grads_of, means)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make", [
    lambda: jc.codecs.QSGD(7, 512, norm="l1"),
    lambda: jc.codecs.QSGD(0),
    lambda: jc.codecs.QSGD(-3),
    lambda: jc.codecs.QSGD(7, bucket_size=0),
    lambda: jc.codecs.QSGD(7, bucket_size=-512),
    lambda: jc.codecs.OneBit(bucket_size=0),
    lambda: jc.qsgd(bits=1),
    lambda: jc.qsgd(norm="inf"),
    lambda: jc.qsgd(bucket_size=0),
    lambda: jc.compress(jc.codecs.Identity(), collective="ring"),
    lambda: jc.wire_report(jc.qsgd(axis_name=AXIS), PARAMS, axis_name=AXIS, num_devices=1),
])
def test_bad_arguments_raise_value_error(make):
  with pytest.raises(ValueError):
    make()


def test_bad_types_raise_type_error():
  with pytest.raises(TypeError, match="codec"):
    jc.compress("qsgd")
  with pytest.raises(TypeError, match="floating"):
    jc.codecs.Cast(jnp.int8)
  tx = jc.qsgd()
  with pytest.raises(TypeError, match="floating-point"):
    tx.init({"steps": jnp.zeros((64, 64), jnp.int32)})
  state = tx.init({"w": jnp.zeros((64, 64))})
  with pytest.raises(TypeError, match="floating-point"):
    tx.update({"w": jnp.zeros((64, 64), jnp.int32)}, state)
  with pytest.raises(TypeError, match="floating-point"):
    jc.codecs.QSGD(7).encode(jnp.arange(10), key=jax.random.key(0))


def test_filter_selects_leaves():
  tx = jc.qsgd(bits=2, filter=lambda path, leaf: "w16" in jax.tree_util.keystr(path))
  grads = _random_grads(jax.random.key(2))
  updates, _ = tx.update(grads, tx.init(PARAMS))
  chex.assert_trees_all_equal(updates["w32"], grads["w32"])  # not compressed
  assert not np.array_equal(updates["w16"], grads["w16"])    # compressed
  # The default filter: >= 1024 values and >= 2 dims.
  assert jc.default_filter((), jnp.zeros((32, 32)))
  assert not jc.default_filter((), jnp.zeros((4096,)))
  assert not jc.default_filter((), jnp.zeros((16, 32)))


# ----------------------------------------------------------------------------- NaN policy


@pytest.mark.parametrize("name", ["onebit_sgd", "qsgd8_ef"])
def test_nonfinite_gradient_does_not_poison_error_feedback(name):
  m = helpers.mesh()
  tx = jc.per_device_state(FACTORIES[name](AXIS))
  state = helpers.shard_map_init(tx, PARAMS, m)
  update = helpers.shard_map_update(tx, m, PARAMS)
  grads = lambda key: jax.vmap(_random_grads)(jax.random.split(key, K))

  _, state1 = update(helpers.shard(grads(jax.random.key(3)), m), state)
  bad = grads(jax.random.key(4))
  bad["w32"] = bad["w32"].at[3, 5, 7].set(jnp.nan)  # device 3 only
  out, state2 = update(helpers.shard(bad, m), state1)
  # Loud: the mean is not finite, on every device.
  assert not bool(jnp.all(jnp.isfinite(out["w32"])))
  r1 = np.asarray(state1.inner.residual["w32"])
  r2 = np.asarray(state2.inner.residual["w32"])
  np.testing.assert_array_equal(r2[3], r1[3])       # the bad device keeps its residual
  assert np.all(np.isfinite(r2))
  assert not np.array_equal(r2[0], r1[0])           # the others carry on
  np.testing.assert_array_equal(np.asarray(state2.inner.nonfinite_count),
                                [0, 0, 0, 1, 0, 0, 0, 0])
  for leaf in jax.tree.leaves(state2.inner.chunk_residual):
    assert np.all(np.isfinite(np.asarray(leaf)))   # second stage too
  out3, _ = update(helpers.shard(grads(jax.random.key(5)), m), state2)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(out3))


# ----------------------------------------------------------------------------- convergence


LR = 0.02
MOMENTUM = 0.0


def _least_squares(minibatch: bool, steps: int):
  """1-bit SGD with error feedback on 8 devices; returns (final loss, optimal loss)."""
  rows, d, o = 64, 32, 48  # per device; W has 1536 values: compressed by default
  kx, kw, kn = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(kx, (K, rows, d))
  w_true = jax.random.normal(kw, (d, o))
  y = x @ w_true + 0.5 * jax.random.normal(kn, (K, rows, o))
  xa, ya = x.reshape(-1, d), y.reshape(-1, o)
  w_opt = jnp.linalg.lstsq(xa, ya)[0]
  loss = lambda w, xb, yb: jnp.mean(jnp.sum((xb @ w - yb) ** 2, -1))
  optimum = float(loss(w_opt, xa, ya))

  m = helpers.mesh()
  # Error feedback with a constant step stalls at a quantization-noise floor (EF-SGD
  # converges to a neighbourhood proportional to the step); a decaying step removes it.
  lr = optax.cosine_decay_schedule(LR, steps, alpha=0.0)
  tx = optax.chain(jc.per_device_state(jc.onebit_sgd(bucket_size=256, axis_name=AXIS)),
                   optax.sgd(lr, momentum=MOMENTUM))
  params = {"w": jnp.zeros((d, o))}
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=K)
  with jax.numpy_dtype_promotion("standard"):  # optax schedules mix int and float
    state = helpers.shard_map_init(tx, params, m)

    def train(params, state, x, y, key):
      x, y = x[0], y[0]

      def body(carry, step_key):
        params, state = carry
        if minibatch:
          idx = jax.random.choice(jax.random.fold_in(step_key, lax.axis_index(AXIS)),
                                  rows, (8,), replace=False)
          xb, yb = x[idx], y[idx]
        else:
          xb, yb = x, y
        # Local gradient: w.r.t. replicated params, jax.grad would psum it (dense).
        grads = jax.grad(lambda p: loss(p["w"], xb, yb))(jc.vary(params, AXIS))
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), None

      (params, state), _ = lax.scan(body, (params, state), jax.random.split(key, steps))
      return params, state

    run = jax.jit(jax.shard_map(train, mesh=m, in_specs=(P(), specs, P(AXIS), P(AXIS), P()),
                                out_specs=(P(), specs)))
    params, _ = run(params, state, helpers.shard(x, m), helpers.shard(y, m), jax.random.key(8))
  return float(loss(params["w"], xa, ya)), optimum


def test_already_reduced_gradient_is_a_clear_error():
  """jax.grad w.r.t. replicated params in shard_map psums: compressing that is refused."""
  m = helpers.mesh()
  tx = jc.per_device_state(jc.qsgd(axis_name=AXIS))
  params = {"w": jnp.ones((64, 64))}
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=K)
  state = helpers.shard_map_init(tx, params, m)
  x = helpers.shard(jnp.arange(K, dtype=jnp.float32), m)

  def step(params, state, x, use_vary):
    p = jc.vary(params, AXIS) if use_vary else params
    grads = jax.grad(lambda p: jnp.sum(p["w"]) * x[0])(p)
    return tx.update(grads, state, params)

  for use_vary in (True, False):
    run = jax.jit(jax.shard_map(lambda p, s, x: step(p, s, x, use_vary), mesh=m,
                                in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs)))
    if use_vary:
      updates, _ = run(params, state, x)  # the local gradients x_d, averaged: 3.5
      np.testing.assert_allclose(np.asarray(updates["w"]), 3.5, rtol=0.05)
    else:
      with pytest.raises(ValueError, match="already replicated"):
        run(params, state, x)


@pytest.mark.parametrize("minibatch,steps", [(False, 800), (True, 2000)])
def test_onebit_sgd_converges_on_least_squares(minibatch, steps):
  final, optimum = _least_squares(minibatch, steps)
  assert final <= 1.01 * optimum, (final, optimum)
