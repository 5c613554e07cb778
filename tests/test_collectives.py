"""Compressed exchanges on 8 CPU devices, under jax.shard_map and jax.pmap."""

import chex
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K

SHAPES = {"w": (48, 96), "b": (96,)}  # w compressed (4608 values), b dense
PARAMS = {name: jnp.zeros(shape) for name, shape in SHAPES.items()}


def _shard_map_run(tx, grads):
  m = helpers.mesh()
  tx = jc.per_device_state(tx)
  state = helpers.shard_map_init(tx, PARAMS, m)
  return helpers.shard_map_update(tx, m, PARAMS)(helpers.shard(grads, m), state)


def _pmap_run(tx, grads):
  replicated = jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), PARAMS)
  state = jax.pmap(tx.init, axis_name=AXIS)(replicated)
  return jax.pmap(tx.update, axis_name=AXIS)(grads, state)


@pytest.mark.parametrize("collective", ["allgather", "two_phase"])
def test_identity_equals_pmean_exactly_shard_map(collective):
  grads = helpers.per_device_grads(jax.random.key(0), SHAPES)
  tx = jc.compress(jc.codecs.Identity(), axis_name=AXIS, collective=collective)
  updates, _ = _shard_map_run(tx, grads)
  dense = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
  # lax.pmean on CPU adds in rank order; so does the codecs' decode_sum.
  expected = jax.jit(
    jax.shard_map(
      lambda g: jax.tree.map(lambda x: lax.pmean(x[0], AXIS), g),
      mesh=helpers.mesh(),
      in_specs=P(AXIS),
      out_specs=P(),
    )
  )(helpers.shard(grads, helpers.mesh()))
  chex.assert_trees_all_equal(updates, expected)
  chex.assert_trees_all_close(updates, dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("collective", ["allgather", "two_phase"])
def test_identity_equals_pmean_exactly_pmap(collective):
  grads = helpers.per_device_grads(jax.random.key(1), SHAPES)
  tx = jc.compress(jc.codecs.Identity(), axis_name=AXIS, collective=collective)
  updates, _ = _pmap_run(tx, grads)
  expected = jax.pmap(lambda g: jax.tree.map(lambda x: lax.pmean(x, AXIS), g), axis_name=AXIS)(
    grads
  )
  chex.assert_trees_all_equal(updates, expected)


TRANSFORMS = {
  "qsgd4_allgather": lambda: jc.qsgd(bits=4, axis_name=AXIS, collective="allgather"),
  "qsgd2_two_phase": lambda: jc.qsgd(
    bits=2, bucket_size=128, axis_name=AXIS, collective="two_phase"
  ),
  "qsgd4_ef_two_phase": lambda: jc.qsgd(
    bits=4, axis_name=AXIS, collective="two_phase", error_feedback=True
  ),
  "onebit": lambda: jc.onebit_sgd(axis_name=AXIS),
  "onebit_allgather": lambda: jc.onebit_sgd(axis_name=AXIS, collective="allgather"),
  "fp16": lambda: jc.compress(jc.codecs.Cast(jnp.float16), axis_name=AXIS, collective="allgather"),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_outputs_identical_on_every_device_pmap(name):
  grads = helpers.per_device_grads(jax.random.key(2), SHAPES)
  updates, _ = _pmap_run(TRANSFORMS[name](), grads)
  for leaf in jax.tree.leaves(updates):
    np.testing.assert_array_equal(np.asarray(leaf), np.broadcast_to(leaf[0], leaf.shape))


@pytest.mark.parametrize("name", ["qsgd2_two_phase", "onebit"])
def test_outputs_identical_on_every_device_shard_map(name):
  grads = helpers.per_device_grads(jax.random.key(3), SHAPES)
  m = helpers.mesh()
  tx = jc.per_device_state(TRANSFORMS[name]())
  state = helpers.shard_map_init(tx, PARAMS, m)

  def step(g, s):
    u, _ = tx.update(jax.tree.map(lambda x: x[0], g), s)
    return jax.tree.map(lambda x: x[None], u)  # one row per device

  rows = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS)))(
    helpers.shard(grads, m), state
  )
  for leaf in jax.tree.leaves(rows):
    leaf = np.asarray(leaf)
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))


def _mean_over_keys(tx, grads, num_keys):
  """The compressed mean for ``num_keys`` independent state keys (vmapped in shard_map)."""
  m = helpers.mesh()
  tx = jc.per_device_state(tx)
  state = helpers.shard_map_init(tx, PARAMS, m)
  keys = jax.random.split(jax.random.key(11), num_keys)

  def step(g, s):
    g = jax.tree.map(lambda x: x[0], g)

    def one(key):
      return tx.update(g, jc.PerDeviceState(s.inner._replace(key=key[None])))[0]["w"]

    return jax.vmap(one)(keys)

  return jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(AXIS), P(AXIS)), out_specs=P()))(
    helpers.shard(grads, m), state
  )


def _chi2_ratio(samples, truth):
  """||mean - truth||^2 over its expectation sum(var_i)/M; ~1 (sd sqrt(2/n)) if unbiased."""
  samples = np.asarray(samples, np.float64).reshape(samples.shape[0], -1)
  truth = np.asarray(truth, np.float64).reshape(-1)
  m = samples.shape[0]
  err = samples.mean(0) - truth
  return float(np.sum(err**2) / (np.sum(samples.var(0, ddof=1)) / m))


@pytest.mark.parametrize("collective", ["allgather", "two_phase"])
def test_compressed_mean_is_unbiased(collective):
  """Averaged over many keys, the QSGD exchange's output approaches the true mean.

  The statistic ||mean_M - mu||^2 / (sum_i var_i / M) is ~ chi^2_n / n for an unbiased
  estimator: 1 with standard deviation sqrt(2/n) = 0.02 for n = 4608; a bias of even a
  tenth of a standard error per coordinate would push it above 1 + 0.01 M.
  """
  grads = helpers.per_device_grads(jax.random.key(4), SHAPES)
  tx = jc.qsgd(bits=2, bucket_size=128, axis_name=AXIS, collective=collective)
  samples = _mean_over_keys(tx, grads, num_keys=256)
  truth = jnp.mean(grads["w"], axis=0)
  ratio = _chi2_ratio(samples, truth)
  assert abs(ratio - 1.0) < 5 * np.sqrt(2 / truth.size), ratio
  # Negative control: the same statistic rejects 1-bit without error feedback (biased).
  biased = _mean_over_keys(
    jc.compress(jc.codecs.OneBit(128), axis_name=AXIS, collective=collective), grads, 4
  )
  biased = biased + 1e-3 * jax.random.normal(jax.random.key(0), biased.shape)  # var > 0
  assert _chi2_ratio(biased, truth) > 10


def test_devices_draw_independent_bits():
  """Identical gradients on all devices: independent rounding averages the noise down."""
  g = jax.random.normal(jax.random.key(5), SHAPES["w"])
  grads = {"w": jnp.broadcast_to(g, (K, *g.shape)), "b": jnp.zeros((K, 96))}
  tx = jc.qsgd(bits=2, bucket_size=128, axis_name=AXIS, collective="allgather")
  updates, _ = _shard_map_run(tx, grads)
  single, _ = jc.qsgd(bits=2, bucket_size=128, axis_name=None).update(
    {"w": g, "b": jnp.zeros(96)},
    jc.qsgd(bits=2, bucket_size=128, axis_name=None).init({"w": g, "b": jnp.zeros(96)}),
  )
  err_k = float(jnp.sum((updates["w"] - g) ** 2))
  err_1 = float(jnp.sum((single["w"] - g) ** 2))
  assert err_k < 0.25 * err_1  # expected ratio 1/K = 0.125


def test_same_seed_same_run_different_seed_differs():
  grads = helpers.per_device_grads(jax.random.key(6), SHAPES)
  a, _ = _shard_map_run(jc.qsgd(bits=2, axis_name=AXIS, seed=3, collective="allgather"), grads)
  b, _ = _shard_map_run(jc.qsgd(bits=2, axis_name=AXIS, seed=3, collective="allgather"), grads)
  c, _ = _shard_map_run(jc.qsgd(bits=2, axis_name=AXIS, seed=4, collective="allgather"), grads)
  chex.assert_trees_all_equal(a, b)
  assert not np.array_equal(a["w"], c["w"])


def _ef_conservation(collective, steps=6):
  """Runs onebit EF for `steps` steps; returns (sum of outputs + held residual, sum in)."""
  m = helpers.mesh()
  tx = jc.per_device_state(jc.onebit_sgd(bucket_size=256, axis_name=AXIS, collective=collective))
  state = helpers.shard_map_init(tx, PARAMS, m)
  update = helpers.shard_map_update(tx, m, PARAMS)
  total_out = jnp.zeros(SHAPES["w"])
  total_in = jnp.zeros(SHAPES["w"])
  for t in range(steps):
    grads = helpers.per_device_grads(jax.random.key(100 + t), SHAPES)
    updates, state = update(helpers.shard(grads, m), state)
    total_out += updates["w"]
    total_in += grads["w"].mean(0)
  # The state has a leading axis K, one row per device.
  state = state.inner
  held = np.asarray(state.residual["w"]).mean(0)  # first stage: mean of devices' residuals
  if collective == "two_phase":  # second stage: chunk j's residual lives on device j
    n = np.prod(SHAPES["w"])
    held = held + np.asarray(state.chunk_residual["w"]).reshape(-1)[:n].reshape(SHAPES["w"])
  return total_out + held, total_in, total_out


@pytest.mark.parametrize("collective", ["allgather", "two_phase"])
def test_error_feedback_conserves_the_gradient_on_8_devices(collective):
  """sum_t out_t + mean_d(e_d) (+ second-stage residuals) == sum_t mean_d(g_{d,t})."""
  conserved, total_in, total_out = _ef_conservation(collective)
  chex.assert_trees_all_close(conserved, total_in, atol=2e-5, rtol=1e-5)
  assert float(jnp.max(jnp.abs(total_out - total_in))) > 1e-2  # residual really held


def test_unbound_axis_name_is_a_clear_error():
  tx = jc.qsgd(axis_name=AXIS, collective="allgather")
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="not bound"):
    tx.update(PARAMS, state)
  with pytest.raises(ValueError, match="not bound"):
    jc.onebit_sgd(axis_name=AXIS).init(PARAMS)  # two-phase EF sizes chunks by K


def test_chains_with_optax_adam_under_shard_map():
  grads = helpers.per_device_grads(jax.random.key(7), SHAPES)
  m = helpers.mesh()
  tx = optax.chain(
    jc.per_device_state(jc.qsgd(bits=4, axis_name=AXIS, collective="two_phase")), optax.adam(1e-3)
  )
  # optax.adam's bias correction (float ** int32 count) is not strict-promotion clean.
  with jax.numpy_dtype_promotion("standard"):
    state = helpers.shard_map_init(tx, PARAMS, m)
    step = helpers.shard_map_update(tx, m, PARAMS)
    updates, state = step(helpers.shard(grads, m), state)
    updates, state = step(helpers.shard(grads, m), state)
  # The compressor's state is per device (leading K), adam's is replicated.
  assert state[0].inner.key.shape == (K,)
  assert state[1][0].mu["w"].shape == SHAPES["w"]
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, PARAMS)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_gather_tree_is_one_collective_and_exact_for_mixed_dtypes():
  from jaxcomp._src.exchanges import collectives  # pylint: disable=import-outside-toplevel

  shapes = {
    "f32": ((10,), jnp.float32),
    "bits": ((7,), jnp.bool_),
    "u8": ((2, 3), jnp.uint8),
    "bf16": ((5,), jnp.bfloat16),
    "i32": ((3,), jnp.int32),
    "u16": ((4,), jnp.uint16),
  }
  keys = jax.random.split(jax.random.key(0), len(shapes))
  tree = {}
  for key, (name, (shape, dtype)) in zip(keys, shapes.items()):
    bits = jax.random.bits(key, (K, *shape), jnp.uint32)
    tree[name] = (
      (bits % 2 == 1)
      if dtype == jnp.bool_
      else (
        jax.random.normal(key, (K, *shape)).astype(dtype)
        if jnp.issubdtype(dtype, jnp.floating)
        else bits.astype(dtype)
      )
    )
  m = helpers.mesh()
  f = jax.jit(
    jax.shard_map(
      lambda t: collectives.gather_tree(jax.tree.map(lambda x: x[0], t), AXIS),
      mesh=m,
      in_specs=P(AXIS),
      out_specs=P(),
    )
  )
  tree = helpers.shard(tree, m)
  out = f(tree)
  for name, x in tree.items():
    assert out[name].dtype == x.dtype and out[name].shape == x.shape, name
    np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(x), err_msg=name)
  hlo = f.lower(tree).compile().as_text()
  assert hlo.count("all-gather(") + hlo.count("all-gather-start(") == 1


def test_all_to_all_tree_is_one_collective_and_exact_for_mixed_dtypes():
  from jaxcomp._src.exchanges import collectives  # pylint: disable=import-outside-toplevel

  keys = jax.random.split(jax.random.key(2), 4)
  # Device d holds K slices per array; slice j goes to device j.
  tree = {
    "f32": jax.random.normal(keys[0], (K, K, 3, 5)),
    "bf16": jax.random.normal(keys[1], (K, K, 7)).astype(jnp.bfloat16),
    "u8": jax.random.bits(keys[2], (K, K, 6), jnp.uint8),
    "bits": jax.random.bits(keys[3], (K, K, 9), jnp.uint8) % 2 == 1,
  }
  f = jax.pmap(lambda t: collectives.all_to_all_tree(t, AXIS), axis_name=AXIS)
  out = f(tree)
  for name, x in tree.items():
    assert out[name].dtype == x.dtype and out[name].shape == x.shape, name
    # Device d receives slice d of every device j, stacked in rank order.
    np.testing.assert_array_equal(
      np.asarray(out[name]), np.swapaxes(np.asarray(x), 0, 1), err_msg=name
    )
  assert f.lower(tree).compile().as_text().count("all-to-all(") == 1


def test_psum_tree_sums_one_buffer_per_dtype_exactly():
  from jaxcomp._src.exchanges import collectives  # pylint: disable=import-outside-toplevel

  keys = jax.random.split(jax.random.key(3), 5)
  tree = {
    "a": jax.random.normal(keys[0], (K, 7, 3)),
    "b": jax.random.normal(keys[1], (K, 11)),
    "c": jax.random.normal(keys[2], (K,)),
    "h": jax.random.normal(keys[3], (K, 5)).astype(jnp.bfloat16),
    "i": jax.random.bits(keys[4], (K, 4), jnp.uint32).astype(jnp.int32) % 1000,
  }
  fused = jax.pmap(lambda t: collectives.pmean_tree(t, AXIS), axis_name=AXIS)
  out = fused(tree)
  want = jax.pmap(lambda t: lax.pmean(t, AXIS), axis_name=AXIS)(tree)
  chex.assert_trees_all_equal(out, want)  # same shapes, dtypes and bits
  # f32 (three leaves), bf16 and int32: three buffers, none of them a per-leaf operand.
  assert sum(helpers.all_reduce_operands(fused.lower(tree).compile().as_text())) == 3


def test_dense_leaves_share_one_all_reduce_operand():
  shapes = {"w": (64, 64), "b1": (64,), "b2": (32,), "b3": (16,), "s": ()}
  grads = helpers.per_device_grads(jax.random.key(4), shapes)
  tx = jc.qsgd(axis_name=AXIS, collective="allgather")
  replicated = {n: jnp.zeros((K, *s)) for n, s in shapes.items()}
  state = jax.pmap(tx.init, axis_name=AXIS)(replicated)
  update = jax.pmap(tx.update, axis_name=AXIS)
  out, _ = update(grads, state)
  want = jax.pmap(lambda g: lax.pmean(g, AXIS), axis_name=AXIS)(grads)
  for name in ("b1", "b2", "b3", "s"):
    np.testing.assert_array_equal(out[name], want[name], err_msg=name)
  assert helpers.all_reduce_operands(update.lower(grads, state).compile().as_text()) == [1]


@pytest.mark.parametrize("codec", [jc.codecs.QSGD(7, 512, "max"), jc.codecs.OneBit()])
def test_two_devices_send_dense_leaves_with_the_payloads(codec):
  # K = 2, all-gather: the full-precision leaves ride in the payloads' all-gather (same
  # bytes as an all-reduce) and average to exactly what lax.pmean gives.
  shapes = {"w": (64, 64), "b1": (64,), "b2": (32,), "s": ()}
  grads = helpers.per_device_grads(jax.random.key(5), shapes, k=2)
  tx = jc.compress(codec, axis_name=AXIS, collective="auto")
  replicated = {n: jnp.zeros((2, *s)) for n, s in shapes.items()}
  devices = jax.devices()[:2]
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(replicated)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  out, _ = update(grads, state)
  want = jax.pmap(lambda g: lax.pmean(g, AXIS), axis_name=AXIS, devices=devices)(grads)
  for name in ("b1", "b2", "s"):
    np.testing.assert_array_equal(out[name], want[name], err_msg=name)
  hlo = update.lower(grads, state).compile().as_text()
  assert helpers.all_reduce_operands(hlo) == []
  assert hlo.count("all-gather(") + hlo.count("all-gather-start(") == 1
  report = jc.wire_report(
    tx, {n: jnp.zeros(s) for n, s in shapes.items()}, axis_name=AXIS, num_devices=2
  )
  dense_bytes = 4 * (64 + 32 + 1)
  payload = sum(
    a.size * a.dtype.itemsize
    for a in jax.tree.leaves(
      jax.eval_shape(lambda x: codec.encode(x, key=jax.random.key(0)), jnp.zeros((64, 64)))
    )
  )
  assert report.bytes_received == payload + dense_bytes  # as with a separate all-reduce


def test_compressed_leaves_share_one_all_gather():
  params = {"w": jnp.zeros((64, 64)), "v": jnp.zeros((32, 128)), "b": jnp.zeros((64,))}
  codec = jc.codecs.QSGD(7, 512, "max")
  report = jc.wire_report(
    jc.compress(codec, axis_name=AXIS, collective="allgather"),
    params,
    axis_name=AXIS,
    num_devices=K,
  )
  gathers = [op for op in report.ops if "all_gather" in op.primitive]
  per_leaf = [
    sum(
      a.size * a.dtype.itemsize
      for a in jax.tree.leaves(
        jax.eval_shape(lambda x: codec.encode(x, key=jax.random.key(0)), params[n])
      )
    )
    for n in ("v", "w")
  ]
  assert [op.operand_bytes for op in gathers] == [sum(per_leaf)]
  two_phase = jc.wire_report(
    jc.compress(codec, axis_name=AXIS, collective="two_phase"),
    params,
    axis_name=AXIS,
    num_devices=K,
  )
  prims = sorted(
    op.primitive.split("_invariant")[0]
    for op in two_phase.ops
    if not op.primitive.startswith(("psum", "pmax", "pmin"))
  )
  assert prims == ["all_gather", "all_to_all"]


@pytest.mark.parametrize("collective", ["allgather", "two_phase"])
def test_fused_exchange_returns_each_leaf_its_own_mean(collective):
  # The Identity codec's mean is exactly the pmean: a leaf mixed up with another, or
  # split at the wrong offset, would show.
  shapes = {"w": (64, 64), "v": (32, 128), "u": (16, 48), "b": (64,)}
  grads = helpers.per_device_grads(jax.random.key(1), shapes)
  tx = jc.compress(jc.codecs.Identity(), axis_name=AXIS, collective=collective, error_feedback=True)
  replicated = {n: jnp.zeros((K, *s)) for n, s in shapes.items()}
  state = jax.pmap(tx.init, axis_name=AXIS)(replicated)
  out, state = jax.pmap(tx.update, axis_name=AXIS)(grads, state)
  want = jax.pmap(lambda g: lax.pmean(g, AXIS), axis_name=AXIS)(grads)
  chex.assert_trees_all_equal(out, want)
  for name in ("w", "v", "u"):  # lossless: nothing left for error feedback
    np.testing.assert_array_equal(state.residual[name], 0.0)


@pytest.mark.parametrize("k,want", [(2, "allgather"), (K, "two_phase")])
def test_auto_collective_is_allgather_on_two_devices_else_two_phase(k, want):
  codec = jc.codecs.OneBit(256)
  params = {"w": jnp.zeros((64, 64))}
  grads = helpers.per_device_grads(jax.random.key(3), {"w": (64, 64)})
  grads = jax.tree.map(lambda g: g[:k], grads)
  devices = jax.devices()[:k]

  def run(collective):
    tx = jc.compress(codec, axis_name=AXIS, collective=collective, error_feedback=True)
    replicated = jax.tree.map(lambda x: jnp.broadcast_to(x, (k, *x.shape)), params)
    state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(replicated)
    update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
    for _ in range(2):
      out, state = update(grads, state)
    return out, state

  chex.assert_trees_all_equal(run("auto"), run(want))
  report = jc.wire_report(
    jc.compress(codec, axis_name=AXIS, collective="auto"), params, axis_name=AXIS, num_devices=k
  )
  prims = {op.primitive.split("_invariant")[0] for op in report.ops}
  assert prims == ({"all_gather"} if want == "allgather" else {"all_gather", "all_to_all"})
  # Elias-coded QSGD has a fallback: "auto" is its all-gather at any K.
  jc.compress(jc.codecs.EliasQSGD(7), axis_name=AXIS, collective="auto")


def test_cpu_decode_is_materialized_once_and_unchanged():
  # On XLA:CPU the decoded mean is computed inside a lax.cond (a fusion barrier) so the
  # optimizer's several readers do not each unpack the payloads again; values identical.
  from jaxcomp._src.exchanges import collectives  # pylint: disable=import-outside-toplevel

  codec = jc.codecs.QSGD(7, 512, "max")
  payloads = [
    codec.encode(jax.random.normal(jax.random.key(i), (64, 96)), key=jax.random.key(10 + i))
    for i in range(2)
  ]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *payloads)
  decode_means = collectives._decode_means  # pylint: disable=protected-access
  barrier = jax.jit(lambda st: decode_means([codec], [st], 2))
  plain = jax.jit(lambda st: [codec.decode_sum(st) / 2])
  np.testing.assert_array_equal(barrier(stacked)[0], plain(stacked)[0])
  assert "conditional" in barrier.lower(stacked).compile().as_text()
  assert "conditional" not in plain.lower(stacked).compile().as_text()
  # The K = 2 exchange of jc.compress goes through it.
  shapes = {"w": (64, 64), "b": (64,)}
  grads = helpers.per_device_grads(jax.random.key(6), shapes, k=2)
  tx = jc.compress(codec, axis_name=AXIS, collective="auto")
  devices = jax.devices()[:2]
  state = jax.pmap(tx.init, axis_name=AXIS, devices=devices)(
    {n: jnp.zeros((2, *s)) for n, s in shapes.items()}
  )
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  assert "conditional" in update.lower(grads, state).compile().as_text()


def test_xla_cpu_drops_optimization_barriers_before_fusion():
  # Why _materialized uses a lax.cond and not lax.optimization_barrier: the barrier does
  # not survive XLA:CPU's pipeline. If a jax release keeps it, this fails and the
  # barrier becomes the simpler way to write the decoded mean once.
  if jax.default_backend() != "cpu":
    pytest.skip("about XLA:CPU")

  def f(x, w):
    y = lax.optimization_barrier([x.astype(jnp.float32) * 3.0])[0]
    return jnp.sum(y * y), w - 0.1 * y

  hlo = jax.jit(f).lower(jnp.ones(1000, jnp.uint8), jnp.ones(1000)).compile().as_text()
  assert "opt-barrier" not in hlo
