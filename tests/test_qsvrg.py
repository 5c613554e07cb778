"""Quantized SVRG: linear convergence on logistic regression, SVRG's rate, bits per epoch."""

import chex
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.methods import qsvrg as qsvrg_lib
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K

# L2-regularised logistic regression, 8 devices x 256 examples, 32 features and a bias.
ROWS, D, LAM = 256, 32, 0.1
BATCH = 8  # examples per device per inner step
T = ROWS // BATCH  # inner steps per epoch: one pass over the local shard
ETA = 0.5  # about 0.6 / L (L = 0.25 max ||[a, 1]||^2 + LAM = 0.85)
EPOCHS = 8
PARAMS = {"w": jnp.zeros((D,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def _loss(params, batch):
  x, y = batch
  z = y * (x @ params["w"] + params["b"])
  reg = 0.5 * LAM * (jnp.sum(jnp.square(params["w"])) + jnp.square(params["b"]))
  return jnp.mean(jnp.logaddexp(0.0, -z)) + reg


class _Problem:
  """The data (float64 on the host, float32 on the mesh) and f* from Newton's method."""

  def __init__(self):
    rng = np.random.default_rng(0)
    self.a = rng.standard_normal((K * ROWS, D)) / np.sqrt(D)
    w_true = 2.0 * rng.standard_normal(D)
    p = 1.0 / (1.0 + np.exp(-(self.a @ w_true + 0.5)))
    self.y = np.where(rng.random(K * ROWS) < p, 1.0, -1.0)
    a1 = np.hstack([self.a, np.ones((K * ROWS, 1))])
    theta = np.zeros(D + 1)
    for _ in range(30):  # Newton in float64: quadratic convergence to machine precision
      s = 1.0 / (1.0 + np.exp(self.y * (a1 @ theta)))
      grad = -(a1.T @ (self.y * s)) / len(a1) + LAM * theta
      hess = (a1.T * (s * (1 - s))) @ a1 / len(a1) + LAM * np.eye(D + 1)
      theta -= np.linalg.solve(hess, grad)
    assert np.linalg.norm(grad) < 1e-12
    self.fstar = self.f(theta[:D], theta[D])

  def f(self, w, b) -> float:
    z = self.y * (self.a @ np.asarray(w, np.float64) + float(b))
    return float(np.mean(np.logaddexp(0.0, -z)) + 0.5 * LAM * (w @ w + float(b) ** 2))

  def suboptimality(self, params) -> float:
    return self.f(np.asarray(params["w"], np.float64), params["b"]) - self.fstar


@pytest.fixture(scope="module")
def problem():
  return _Problem()


def _sample(x, y, key):
  """This device's T minibatches, drawn from its own shard (with replacement)."""
  k = jax.random.fold_in(key, lax.axis_index(AXIS))
  idx = jax.random.randint(k, (T, BATCH), 0, ROWS)
  return x[idx], y[idx]


def _train_shard_map(problem, codec=None, epochs=EPOCHS):
  """QSVRG (codec=None) or the same code with ``codec`` on 8 devices under shard_map.

  Returns the suboptimality before each epoch and after the last, the final params and
  each device's own copy of them (leading axis K).
  """
  opt = qsvrg_lib.qsvrg(_loss, ETA, axis_name=AXIS, codec=codec, collective="allgather")
  traces = []

  def epoch(params, state, x, y, key):
    traces.append(1)
    params, state = opt.epoch(params, state, (x, y), _sample(x, y, key))
    # Each device's own buffer, typed varying (no data movement) to read it back per device.
    mine = jax.tree.map(lambda v: v[None], jc.vary(params, AXIS))
    return params, state, mine

  m = helpers.mesh()
  run = jax.jit(
    jax.shard_map(
      epoch, mesh=m, in_specs=(P(), P(), P(AXIS), P(AXIS), P()), out_specs=(P(), P(), P(AXIS))
    )
  )
  x = jax.device_put(jnp.asarray(problem.a, jnp.float32), jax.NamedSharding(m, P(AXIS)))
  y = jax.device_put(jnp.asarray(problem.y, jnp.float32), jax.NamedSharding(m, P(AXIS)))
  # Replicated on the mesh from the start, as the outputs will be: else the second call
  # sees new input shardings and compiles again.
  params, state = jax.device_put((PARAMS, opt.init(PARAMS)), jax.NamedSharding(m, P()))
  subopt = [problem.suboptimality(params)]
  per_device = []
  for p in range(epochs):
    params, state2, mine = run(params, state, x, y, jax.random.key(100 + p))
    chex.assert_trees_all_equal_shapes_and_dtypes(state, state2)
    state = state2
    subopt.append(problem.suboptimality(params))
    per_device.append(jax.device_get(mine))
  assert len(traces) == 1  # one compilation for all the epochs
  return np.array(subopt), params, per_device


@pytest.fixture(scope="module")
def runs(problem):
  return {
    "qsvrg": _train_shard_map(problem),
    "svrg": _train_shard_map(problem, jc.codecs.Identity()),
  }


def _contraction(subopt):
  """Per-epoch ratios and their geometric mean (the fitted linear rate)."""
  ratios = subopt[1:] / subopt[:-1]
  return ratios, float(np.exp(np.mean(np.log(ratios))))


def test_qsvrg_converges_linearly(runs):
  subopt, _, _ = runs["qsvrg"]
  assert np.all(subopt > 0)
  ratios, rate = _contraction(subopt)
  print(
    f"\nQSVRG suboptimality per epoch: {np.array2string(subopt, precision=2)}"
    f"\n  ratios {np.array2string(ratios, precision=3)}, rate {rate:.3f}"
  )
  # Theorem 3.6's 0.9^p, at every epoch; and a clearly linear rate overall (measured
  # 0.16 then about 0.23 per epoch: the mean iterate of one local pass).
  assert np.all(ratios <= 0.9), ratios
  assert rate <= 0.4, rate
  assert subopt[-1] <= 1e-5 * subopt[0], subopt


def test_qsvrg_matches_svrg_rate(runs):
  q, _, _ = runs["qsvrg"]
  s, _, _ = runs["svrg"]
  _, rate_q = _contraction(q)
  _, rate_s = _contraction(s)
  print(f"\ncontraction per epoch: QSVRG {rate_q:.4f}, SVRG (Identity codec) {rate_s:.4f}")
  assert rate_s <= 0.4
  assert rate_q <= 1.5 * rate_s, (rate_q, rate_s)
  assert q[-1] <= 10 * s[-1], (q[-1], s[-1])
  assert not np.array_equal(q, s)  # the quantizer did act


def test_parameters_identical_on_every_device(runs):
  for name in ("qsvrg", "svrg"):
    _, params, per_device = runs[name]
    for mine in per_device:
      for leaf in jax.tree.leaves(mine):
        for d in range(1, K):
          np.testing.assert_array_equal(leaf[d], leaf[0])
    chex.assert_trees_all_equal(
      jax.tree.map(lambda v: v[0], per_device[-1]), jax.device_get(params)
    )


def test_pmap_matches_shard_map(problem, runs):
  """Two epochs under jax.pmap: same result as shard_map, identical on every device."""
  opt = qsvrg_lib.qsvrg(_loss, ETA, axis_name=AXIS, collective="allgather")

  def epoch(params, state, x, y, key):
    return opt.epoch(params, state, (x, y), _sample(x, y, key))

  run = jax.pmap(epoch, axis_name=AXIS, in_axes=(None, None, 0, 0, None), devices=jax.devices()[:K])
  x = jnp.asarray(problem.a, jnp.float32).reshape(K, ROWS, D)
  y = jnp.asarray(problem.y, jnp.float32).reshape(K, ROWS)
  params, state = PARAMS, opt.init(PARAMS)
  for p in range(2):
    params, state = run(params, state, x, y, jax.random.key(100 + p))
    for leaf in jax.tree.leaves(params):
      for d in range(1, K):
        np.testing.assert_array_equal(leaf[d], leaf[0])
    params, state = jax.tree.map(lambda v: v[0], (params, state))
  ref, _, _ = runs["qsvrg"]  # the same epoch keys
  np.testing.assert_allclose(problem.suboptimality(params), ref[2], rtol=1e-3)


# ----------------------------------------------------------------------------- bits


def test_bits_per_epoch():
  opt = qsvrg_lib.qsvrg(_loss, ETA, axis_name=AXIS, collective="allgather")
  batch = (
    jax.ShapeDtypeStruct((BATCH, D), jnp.float32),
    jax.ShapeDtypeStruct((BATCH,), jnp.float32),
  )
  report = qsvrg_lib.qsvrg_wire_report(
    opt, PARAMS, batch, axis_name=AXIS, num_devices=K, inner_steps=T
  )
  print("\n" + str(report))
  n = D + 1
  assert report.num_params == n
  assert report.snapshot_bits == 32 * n  # one dense float32 ∇f_j(y)
  assert all(op.primitive.startswith("psum") for op in report.snapshot_ops)
  # Each step: the QSGD payloads with s = round(sqrt(n_leaf)): w has s = 6 (4 bits with
  # the sign, 8 codes per uint32 word) and the scalar b has s = 1 (2 bits, one word).
  codec_w, codec_b = jc.codecs.QSGD(6), jc.codecs.QSGD(1)
  expected_step = codec_w.wire_bits((D,)) + codec_b.wire_bits(())
  assert expected_step == (32 * -(-4 * D // 32) + 32) + (32 + 32)
  assert report.step_bits == expected_step
  assert all("all_gather" in op.primitive for op in report.step_ops)
  assert report.broadcast_bits_per_epoch == 32 * n + T * expected_step
  assert report.dense_bits_per_epoch == (T + 1) * 32 * n
  assert report.dense_bits_per_epoch / report.broadcast_bits_per_epoch > 3.5
  # Ring convention: the dense all-reduce 2(K-1)/K·4n bytes, each all-gather (K-1)·B.
  expected_received = 8 * (2 * (K - 1) / K * 4 * n + T * (K - 1) * expected_step / 8)
  assert report.received_bits_per_epoch == pytest.approx(expected_received)
  # Unquantized SVRG through the same code sends 32n bits per step.
  dense = qsvrg_lib.qsvrg_wire_report(
    qsvrg_lib.qsvrg(_loss, ETA, axis_name=AXIS, codec=jc.codecs.Identity(), collective="allgather"),
    PARAMS,
    batch,
    axis_name=AXIS,
    num_devices=K,
    inner_steps=T,
  )
  assert dense.broadcast_bits_per_epoch == dense.dense_bits_per_epoch
  # A codec chosen per leaf by a function: the same as the default.
  per_leaf = qsvrg_lib.qsvrg_wire_report(
    qsvrg_lib.qsvrg(
      _loss,
      ETA,
      axis_name=AXIS,
      codec=lambda leaf: jc.codecs.QSGD(qsvrg_lib.default_levels(leaf.size)),
      collective="allgather",
    ),
    PARAMS,
    batch,
    axis_name=AXIS,
    num_devices=K,
    inner_steps=T,
  )
  assert per_leaf.step_bits == expected_step and per_leaf.fallback_step_bits == 0
  # The two-phase exchange traces too: scatter (all_to_all) then all_gather.
  two_phase = qsvrg_lib.qsvrg_wire_report(
    qsvrg_lib.qsvrg(_loss, ETA, axis_name=AXIS, collective="two_phase"),
    PARAMS,
    batch,
    axis_name=AXIS,
    num_devices=K,
    inner_steps=T,
  )
  # (all_gather's primitive is "all_gather_invariant" on jax 0.10, "all_gather" on 0.12.)
  prims = {op.primitive for op in two_phase.step_ops}
  assert "all_to_all" in prims and len(prims) == 2
  assert any(p.startswith("all_gather") for p in prims)


def test_bits_for_a_large_tensor_against_the_paper_bound():
  """n = 2**20, s = 1024: fixed-width 12 bits per value vs the Elias bound's 2.8."""
  params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  loss = lambda p, batch: jnp.sum(p["w"] * batch)
  opt = qsvrg_lib.qsvrg(loss, 0.1, axis_name=AXIS, collective="allgather")
  batch = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  report = qsvrg_lib.qsvrg_wire_report(
    opt, params, batch, axis_name=AXIS, num_devices=K, inner_steps=100
  )
  n = 2**20
  assert qsvrg_lib.default_levels(n) == 1024
  assert report.step_bits == 12 * n + 32  # 11 magnitude bits for s = 1024, one sign bit
  assert (
    report.paper_bound_bits < report.broadcast_bits_per_epoch < (report.dense_bits_per_epoch / 2.5)
  )


# ----------------------------------------------------------------------------- API


def _local_problem():
  a = jax.random.normal(jax.random.key(0), (64, 8))
  loss = lambda p, b: 0.5 * jnp.mean((b[0] @ p["w"] + p["c"].astype(jnp.float32) - b[1]) ** 2)
  return (a, a @ jnp.arange(8.0)), loss


def test_epoch_equals_snapshot_steps_end_epoch():
  """epoch = snapshot, T steps, end_epoch; dtypes and state kept; a schedule works."""
  data, loss = _local_problem()
  # An optax schedule mixes int32 and float: must pass under strict dtype promotion.
  opt = qsvrg_lib.qsvrg(
    loss, optax.exponential_decay(0.2, 8, 0.5), levels=3, bucket_size=4, seed=3, axis_name=None
  )
  params = {"w": jnp.zeros(8), "c": jnp.zeros((), jnp.bfloat16)}
  state = opt.init(params)
  batches = jax.tree.map(lambda v: v.reshape(8, 8, *v.shape[1:]), data)
  y1, state1 = jax.jit(opt.epoch)(params, state, data, batches)
  chex.assert_trees_all_equal_shapes_and_dtypes(y1, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(state1, state)
  assert float(loss(y1, data)) < 0.75 * float(loss(params, data))

  s = opt.snapshot(params, state, data)
  x = params
  step = jax.jit(opt.step)
  for t in range(8):
    x, s = step(x, s, jax.tree.map(lambda v, t=t: v[t], batches))
  chex.assert_trees_all_close(opt.end_epoch(s), y1, rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(s._replace(key=None), state1._replace(key=None), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(jax.random.key_data(s.key), jax.random.key_data(state1.key))
  assert int(state1.count) == 8 and int(state1.inner_count) == 8
  # A given full local gradient is the same as computing it from the full batch.
  g = jax.grad(loss)(params, data)
  chex.assert_trees_all_close(
    opt.snapshot(params, state, grad=g).full_grad,
    opt.snapshot(params, state, data).full_grad,
    rtol=1e-6,
  )
  # No step yet: the epoch's mean iterate is the snapshot.
  chex.assert_trees_all_equal(opt.end_epoch(opt.snapshot(params, state, data)), params)


@pytest.mark.parametrize(
  "make",
  [
    lambda: qsvrg_lib.qsvrg(_loss, 0.0, axis_name=None),
    lambda: qsvrg_lib.qsvrg(_loss, -1.0, axis_name=None),
    lambda: qsvrg_lib.qsvrg(_loss, 0.1, collective="psum", axis_name=None),
    lambda: qsvrg_lib.qsvrg(_loss, 0.1, levels=0, axis_name=None),
    lambda: qsvrg_lib.qsvrg(_loss, 0.1, bucket_size=0, axis_name=None),
    lambda: qsvrg_lib.qsvrg(_loss, 0.1, codec=jc.codecs.Identity(), levels=4, axis_name=None),
    lambda: qsvrg_lib.qsvrg(_loss, 0.1, axis_name=None).snapshot(
      PARAMS, qsvrg_lib.qsvrg(_loss, 0.1, axis_name=None).init(PARAMS)
    ),
    lambda: qsvrg_lib.qsvrg(_loss, 0.1, axis_name=AXIS, collective="allgather").snapshot(
      PARAMS, qsvrg_lib.qsvrg(_loss, 0.1, axis_name=None).init(PARAMS), grad=PARAMS
    ),  # axis not bound
    lambda: qsvrg_lib.qsvrg_wire_report(
      qsvrg_lib.qsvrg(_loss, 0.1, axis_name=AXIS, collective="allgather"),
      PARAMS,
      PARAMS,
      axis_name=AXIS,
      num_devices=1,
      inner_steps=4,
    ),
  ],
)
def test_bad_arguments_raise_value_error(make):
  with pytest.raises(ValueError):
    make()


def test_bad_types_raise_type_error():
  with pytest.raises(TypeError, match="codec"):
    qsvrg_lib.qsvrg(_loss, 0.1, codec="qsgd", axis_name=None)
  with pytest.raises(TypeError, match="floating-point"):
    qsvrg_lib.qsvrg(_loss, 0.1, axis_name=None).init({"w": jnp.zeros(4, jnp.int32)})
  opt = qsvrg_lib.qsvrg(_loss, 0.1, codec=lambda leaf: "qsgd", axis_name=None)
  batch = (jnp.zeros((BATCH, D)), jnp.zeros(BATCH))
  with pytest.raises(TypeError, match="must return a jaxcomp codec"):
    jax.eval_shape(opt.step, PARAMS, opt.init(PARAMS), batch)


def test_default_levels():
  assert [qsvrg_lib.default_levels(n) for n in (1, 2, 32, 100, 2**20)] == [1, 1, 6, 10, 1024]
  assert qsvrg_lib.default_levels(2**20, bucket_size=512) == 23
  assert qsvrg_lib.default_levels(100, bucket_size=512) == 10


def test_step_exchanges_all_leaves_together_with_per_leaf_results():
  """Leaves quantized with different codecs share one all-gather, the filtered leaves one
  all-reduce (the snapshot too), and every leaf ends exactly where its own exchange
  (``collectives.gather_means`` / ``lax.pmean``, the same keys) puts it."""
  from jaxcomp._src.exchanges import collectives  # pylint: disable=import-outside-toplevel

  shapes = {"w1": (16, 8), "w2": (100,), "b1": (8,), "b2": (3,)}
  keys = jax.random.split(jax.random.key(7), len(shapes))
  params = {n: jax.random.normal(k, s) for (n, s), k in zip(shapes.items(), keys)}
  loss = lambda p, batch: sum(jnp.sum(jnp.sin(v) * batch) for v in jax.tree.leaves(p))
  only_w = lambda path, leaf: leaf.ndim == 2 or leaf.size >= 100
  # Learning rate 1: x - mean, which XLA cannot contract into an FMA in one program and
  # not the other (that would differ in the last bit while the exchanges agree).
  # Max-norm QSGD, levels per leaf as the default: an l2 scale's sum of squares may be
  # added in another order in another program, which moves it by an ulp.
  codec = lambda leaf: jc.codecs.QSGD(qsvrg_lib.default_levels(leaf.size), None, "max")
  opt = qsvrg_lib.qsvrg(
    loss, 1.0, axis_name=AXIS, filter=only_w, codec=codec, collective="allgather"
  )
  batches = jnp.arange(1.0, K + 1.0)
  state = opt.init(params)

  def snapshot_and_step(p, s, batch):
    s = opt.snapshot(p, s, batch)
    return opt.step(p, s, batch), s

  run = jax.pmap(snapshot_and_step, axis_name=AXIS, in_axes=(None, None, 0))
  (new, _), snap = run(params, state, batches)

  def reference(p, s, batch):  # the same step, leaf by leaf
    gx = jax.grad(loss)(p, batch)
    gy = jax.grad(loss)(s.snapshot, batch)
    _, step_key = jax.random.split(s.key)
    step_key = jax.random.fold_in(step_key, lax.axis_index(AXIS))
    out = {}
    for i, name in enumerate(sorted(p)):  # the flattening order of a dict
      v = gx[name] - gy[name] + s.full_grad[name]
      if only_w(None, p[name]):
        (ex,), _ = collectives.gather_means(
          [codec(v)], [v], [jax.random.fold_in(step_key, i)], AXIS
        )
        mean = ex.mean.reshape(v.shape)
      else:
        mean = lax.pmean(v, AXIS)
      out[name] = p[name] - mean
    return out

  snap0 = jax.tree.map(lambda a: a[0], snap)
  want = jax.pmap(reference, axis_name=AXIS, in_axes=(None, None, 0))(params, snap0, batches)
  chex.assert_trees_all_equal(new, want)  # every device, every leaf, bit for bit
  assert qsvrg_lib.default_levels(128) != qsvrg_lib.default_levels(100)  # two codecs
  hlo = run.lower(params, state, batches).compile().as_text()
  # The snapshot's all-reduce of every leaf, the step's of b1 and b2, the step's
  # all-gather of w1's and w2's payloads.
  assert helpers.collective_counts(hlo) == {"all-gather": 1, "all-reduce": 2, "all-to-all": 0}


def test_default_collective_pays_at_the_device_count():
  """collective="auto" (the default): on 8 devices a leaf large enough for the two-phase
  exchange moves its bytes, fewer than the all-gather's; on 2 devices the all-gather."""
  n = 4096
  loss = lambda w, batch: 0.5 * jnp.mean((batch[0] @ w - batch[1]) ** 2)
  params = jax.ShapeDtypeStruct((n,), jnp.float32)
  batch = (jax.ShapeDtypeStruct((4, n), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))

  def received(k, **kw):
    opt = qsvrg_lib.qsvrg(loss, ETA, axis_name=AXIS, **kw)
    return qsvrg_lib.qsvrg_wire_report(
      opt, params, batch, axis_name=AXIS, num_devices=k, inner_steps=T
    ).received_bits_per_epoch

  assert received(8) == received(8, collective="two_phase") < received(8, collective="allgather")
  assert received(2) == received(2, collective="allgather")
