"""jc.dense_mean: the dense A/B baseline as a transform, lax.pmean of every leaf."""

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

SHAPES = {"w": (16, 8), "b": (8,), "h": (5, 3)}


def _grads():
  grads = helpers.per_device_grads(jax.random.key(0), SHAPES)
  grads["h"] = grads["h"].astype(jnp.bfloat16)  # a second dtype: a second all-reduce
  return grads


def _params():
  return jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), _grads())


def _pmean_per_leaf(grads):
  return jax.tree.map(lambda g: lax.pmean(g, AXIS), grads)


def test_equals_pmean_of_every_leaf_under_shard_map():
  """Under shard_map (check_vma on, the default), the mean of each leaf in its dtype,
  as lax.pmean of that leaf gives it, and the same on every device."""
  m = helpers.mesh()
  tx = jc.dense_mean(axis_name=AXIS)
  params, grads = _params(), helpers.shard(_grads(), m)
  state = helpers.shard_map_init(tx, params, m)
  assert state == optax.EmptyState()
  out, state = helpers.shard_map_update(tx, m, params)(grads, state)
  want = jax.jit(
    jax.shard_map(
      lambda g: _pmean_per_leaf(jax.tree.map(lambda x: x[0], g)),
      mesh=m,
      in_specs=P(AXIS),
      out_specs=P(),
    )
  )(grads)
  for name in SHAPES:
    assert out[name].dtype == grads[name].dtype, name
    # One buffer per dtype, summed by the same all-reduce as each leaf's psum: the same
    # sums, to the rounding of the summation order (float32: a few ulp; bfloat16: one).
    eps = float(jnp.finfo(grads[name].dtype).eps)
    chex.assert_trees_all_close(
      out[name].astype(jnp.float32), want[name].astype(jnp.float32), rtol=0, atol=8 * eps
    )
  np.testing.assert_allclose(out["w"], np.mean(np.asarray(grads["w"]), 0), rtol=1e-6, atol=1e-6)


def test_equals_pmean_under_pmap():
  tx = jc.dense_mean(axis_name=AXIS)
  grads = _grads()
  state = jax.pmap(lambda _: tx.init(_params()), axis_name=AXIS)(jnp.arange(K))
  out, _ = jax.pmap(tx.update, axis_name=AXIS)(grads, state)
  want = jax.pmap(_pmean_per_leaf, axis_name=AXIS)(grads)
  for name in SHAPES:
    assert out[name].dtype == grads[name].dtype, name
    eps = float(jnp.finfo(grads[name].dtype).eps)
    chex.assert_trees_all_close(
      out[name].astype(jnp.float32), want[name].astype(jnp.float32), rtol=0, atol=8 * eps
    )
    chex.assert_trees_all_equal(out[name][0], out[name][K - 1])


def test_one_all_reduce_per_dtype():
  """Three leaves in two dtypes: two buffers all-reduced in the compiled step (which
  XLA may combine into one all-reduce of two operands), not one per leaf."""
  m = helpers.mesh()
  tx = jc.dense_mean(axis_name=AXIS)
  params = _params()
  state = helpers.shard_map_init(tx, params, m)
  hlo = (
    helpers.shard_map_update(tx, m, params).lower(helpers.shard(_grads(), m), state).compile()
  ).as_text()
  assert helpers.collective_counts(hlo)["all-gather"] == 0
  assert sum(helpers.all_reduce_operands(hlo)) == 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_wire_report_prices_it_at_the_dense_baseline(dtype):
  """Its bytes are the dense baseline's, 2(K-1)/K of the gradient bytes: ratio 1."""
  params = {"w": jnp.zeros((256, 64), dtype), "b": jnp.zeros((64,), dtype)}
  report = jc.wire_report(
    optax.chain(jc.dense_mean(axis_name=AXIS), optax.sgd(0.1)),
    params,
    axis_name=AXIS,
    num_devices=K,
  )
  n = 256 * 64 + 64
  assert report.bytes_received == pytest.approx(2 * (K - 1) / K * jnp.dtype(dtype).itemsize * n)
  assert report.bytes_received == pytest.approx(report.dense_bytes)
  assert report.ratio == pytest.approx(1.0)
  assert [op.count for op in report.ops] == [1]  # both leaves in one all-reduce


def test_axis_name_is_required():
  with pytest.raises(TypeError, match=r"jc\.dense_mean needs axis_name"):
    jc.dense_mean()
  with pytest.raises(TypeError, match=r"jc\.dense_mean needs axis_name"):
    jc.dense_mean(axis_name=None)


def test_bad_collective_and_specs_without_a_reduce_scatter():
  with pytest.raises(ValueError, match=r"'psum' or 'reduce_scatter', got 'allgather'"):
    jc.dense_mean(axis_name=AXIS, collective="allgather")
  with pytest.raises(ValueError, match=r"param_specs .* collective='reduce_scatter'"):
    jc.dense_mean(axis_name=AXIS, param_specs={"w": P(AXIS)})
