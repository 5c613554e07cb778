"""One harness over every transform and codec (dtypes, state, one compilation, the error
against the mean under shard_map and pmap), plus bad input, the NaN policy and convergence."""

import warnings

import chex
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.codecs import normal as normal_lib
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K

# Mixed dtypes in one tree: dtype preservation is checked with a single compilation.
PARAMS = {
  "w32": jnp.zeros((48, 96), jnp.float32),
  "w16": jnp.zeros((64, 64), jnp.bfloat16),
  "b": jnp.zeros((96,), jnp.float32),
}

FACTORIES = {
  "identity": lambda axis: jc.compress(
    jc.codecs.Identity(), axis_name=axis, collective="allgather"
  ),
  "bf16": lambda axis: jc.compress(
    jc.codecs.Cast(jnp.bfloat16), axis_name=axis, collective="allgather"
  ),
  "fp16_two_phase": lambda axis: jc.compress(
    jc.codecs.Cast(jnp.float16), axis_name=axis, collective="two_phase"
  ),
  "qsgd4": lambda axis: jc.qsgd(bits=4, axis_name=axis, collective="allgather"),
  "qsgd2_l2_two_phase": lambda axis: jc.qsgd(
    bits=2, bucket_size=128, norm="l2", axis_name=axis, collective="two_phase"
  ),
  "qsgd8_ef": lambda axis: jc.qsgd(
    bits=8, axis_name=axis, error_feedback=True, collective="allgather"
  ),
  "onebit_sgd": lambda axis: jc.onebit_sgd(axis_name=axis),
  "onebit_allgather": lambda axis: jc.onebit_sgd(axis_name=axis, collective="allgather"),
  # Relative error on the harness's second step: the update is an orthogonal
  # projection of the mean (the residual is zero after the all-zero first step), so
  # the error is below 1, and close to 1 on noise (rank 4 of 48 keeps little of it).
  "powersgd": lambda axis: jc.powersgd(4, axis_name=axis),
  "onebit_per_column": lambda axis: jc.onebit_sgd(per_column=True, axis_name=axis),
  "onebit_per_column_allgather": lambda axis: jc.onebit_sgd(
    per_column=True, axis_name=axis, collective="allgather"
  ),
  "ef_signsgd": lambda axis: jc.ef_signsgd(axis_name=axis),
  "ef_signsgd_allgather": lambda axis: jc.ef_signsgd(
    bucket_size=256, axis_name=axis, collective="allgather"
  ),
  "topk": lambda axis: jc.compress(jc.codecs.TopK(0.1), axis_name=axis, collective="allgather"),
  "randomk": lambda axis: jc.compress(
    jc.codecs.RandomK(0.25), axis_name=axis, collective="allgather"
  ),
  "elias_qsgd": lambda axis: jc.compress(
    jc.codecs.EliasQSGD(7, bucket_size=512, norm="max"), axis_name=axis, collective="allgather"
  ),
  "normal": lambda axis: jc.compress(
    jc.codecs.NormalQuantizer(256), axis_name=axis, collective="allgather"
  ),
  "sparsify": lambda axis: jc.sparsify(epsilon=1.0, density=0.5, method="exact", axis_name=axis),
  "fp8_sr": lambda axis: jc.compress(
    jc.codecs.Float8(rounding="stochastic"), axis_name=axis, collective="allgather"
  ),
  "fp8_e5m2_two_phase": lambda axis: jc.compress(
    jc.codecs.Float8("e5m2"), axis_name=axis, collective="two_phase"
  ),
  # Momentum correction on the harness's second step (u = v = 0 after the zero step):
  # v = g, and DGC sends its top 10%.
  "dgc": lambda axis: jc.dgc(0.1, axis_name=axis, collective="allgather"),
  # Not quantized, every layer exchanged each step, and one compressed layer (w32), so
  # that the update after the zero step (prediction 0) is the mean of each device's top
  # half of w32 exactly; the default configuration's quantization and half updates are
  # tested in tests/test_mipd.py.
  "mipd": lambda axis: jc.mipd(
    0.5,
    quantize=False,
    half_update=False,
    filter=lambda path, leaf: jax.tree_util.keystr(path) == "['w32']",
    axis_name=axis,
  ),
}


def _random_grads(key):
  keys = jax.random.split(key, len(PARAMS))
  return {
    name: jax.random.normal(k, p.shape, p.dtype)
    for k, (name, p) in zip(keys, sorted(PARAMS.items()))
  }


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

  update = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(AXIS), specs), out_specs=(P(), specs)))
  stacked = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), tree)
  zeros, state1 = update(helpers.shard(stacked(PARAMS), m), state)
  chex.assert_trees_all_equal(jax.device_get(zeros), jax.device_get(PARAMS))
  grads = jax.vmap(_random_grads)(jax.random.split(jax.random.key(1), K))
  updates, state2 = update(helpers.shard(grads, m), state1)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, PARAMS)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, state1, state2)
  # The update estimates the mean gradient within what the method guarantees (BOUNDS).
  g = np.asarray(grads["w32"], np.float64).reshape(K, -1)
  mean = g.mean(0)
  err = np.linalg.norm(np.asarray(updates["w32"], np.float64).reshape(-1) - mean)
  assert err / np.linalg.norm(mean) <= BOUNDS[name](g), (err / np.linalg.norm(mean), name)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_harness_pmapped(name):
  """The same checks on 8 devices under jax.pmap, the state per device as it is. (The
  name avoids "pmap." in the step's qualified name, which chex takes for a jax.pmap.)"""
  chex.clear_trace_counter()
  tx = FACTORIES[name](AXIS)
  stacked = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), tree)
  state = jax.pmap(tx.init, axis_name=AXIS)(stacked(PARAMS))

  @chex.assert_max_traces(n=1)
  def step(grads, state):
    return tx.update(grads, state, PARAMS)

  update = jax.pmap(step, axis_name=AXIS)
  zeros, state1 = update(stacked(PARAMS), state)
  chex.assert_trees_all_equal(jax.device_get(zeros), jax.device_get(stacked(PARAMS)))
  grads = jax.vmap(_random_grads)(jax.random.split(jax.random.key(1), K))
  updates, state2 = update(grads, state1)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, stacked(PARAMS))
  chex.assert_trees_all_equal_shapes_and_dtypes(state, state1, state2)
  for leaf in jax.tree.leaves(updates):  # the same mean on every device
    chex.assert_trees_all_equal(leaf[0], leaf[K - 1])
  g = np.asarray(grads["w32"], np.float64).reshape(K, -1)
  mean = g.mean(0)
  err = np.linalg.norm(np.asarray(updates["w32"][0], np.float64).reshape(-1) - mean)
  assert err / np.linalg.norm(mean) <= BOUNDS[name](g), (err / np.linalg.norm(mean), name)


# ------------------------------------------------------------------ harness error bounds
#
# BOUNDS[name](g) is the largest relative error ||update - mean|| / ||mean|| that factory
# `name` may show on the harness's gradients g ((K, n) float64: the w32 leaf of each
# device, N(0, 1), n = 4608, flattened as the codecs flatten it; a first step, so every
# residual is zero). Each bound comes from what the method guarantees:
#
# * Deterministic codecs (Identity, Cast, OneBit) have one possible output: the bound is
#   its error, computed here in float64 from the codec's definition, plus float32
#   rounding (_SLACK).
# * Stochastic codecs (QSGD) bound the squared error S = ||update - mean||^2 by its
#   expectation plus Z standard deviations. The quantizations are independent over
#   devices and coordinates, so S is a sum of n independent terms (nearly normal) whose
#   mean and variance are exact functions of g (_qsgd_moments). A second quantization
#   (two-phase) of y = mean + e1 is bounded with Lemma 3.1 (_two_phase_qsgd_bound).
#
# Every factory in FACTORIES needs an entry (test_every_factory_has_a_bound): a bound of
# its own, derived and commented like these, never a loose constant.

Z = 6.0  # standard deviations above the expected squared error
_SLACK = 1e-4  # float32 rounding of the exchange, relative to ||mean||
_CHUNK = 4608 // K  # two-phase chunk of the w32 leaf (a multiple of 32: no padding)


def _bucket_ids(n: int, bucket: int, chunk: int | None = None) -> np.ndarray:
  """Bucket of each position: buckets restart at each two-phase chunk."""
  pos = np.arange(n)
  if chunk is None:
    return pos // bucket
  per_chunk = -(-chunk // bucket)
  return (pos // chunk) * per_chunk + (pos % chunk) // bucket


def _qsgd_moments(v, s, bucket, norm, chunk=None):
  """Variance and 4th central moment of each coordinate's QSGD error, for rows v.

  With step h = scale / s and r = |v| / h, the error is (1 - p) h or -p h (p = r mod 1)
  with probabilities p and 1 - p: variance h^2 p (1 - p), 4th moment
  h^4 p (1 - p) ((1 - p)^3 + p^3). E||Q(v) - v||^2, their sum, is at most Lemma 3.1's
  min(b/s^2, sqrt(b)/s) ||v||^2 per bucket with the l2 norm.
  """
  ids = _bucket_ids(v.shape[-1], bucket, chunk)
  scale = np.zeros((v.shape[0], ids.max() + 1))
  for d in range(v.shape[0]):
    if norm == "l2":
      scale[d] = np.sqrt(np.bincount(ids, v[d] ** 2))
    else:
      np.maximum.at(scale[d], ids, np.abs(v[d]))
  h = scale[:, ids] / s
  r = np.abs(v) / np.where(h > 0, h, 1.0)
  p = r - np.floor(r)
  var = h**2 * p * (1 - p)
  return var, h**4 * p * (1 - p) * ((1 - p) ** 3 + p**3)


def _mean_error_moments(g, s, bucket, norm, chunk=None):
  """Per coordinate: variance and variance-of-square of e_i = mean over devices of the
  independent errors (what the all-gather or the first phase adds to the mean)."""
  var, m4 = _qsgd_moments(g, s, bucket, norm, chunk)
  k = g.shape[0]
  mean_var = var.sum(0) / k**2
  # T = e_i^2: Var(T) = (sum_d (m4_d - 3 var_d^2) + 2 (sum_d var_d)^2) / K^4
  var_sq = ((m4 - 3 * var**2).sum(0) + 2 * var.sum(0) ** 2) / k**4
  return mean_var, var_sq


def _qsgd_bound(s, bucket, norm):
  """QSGD through the all-gather: S = sum_i e_i^2, E[S] + Z sd(S) exactly."""

  def bound(g):
    mean_var, var_sq = _mean_error_moments(g, s, bucket, norm)
    hi = mean_var.sum() + Z * np.sqrt(var_sq.sum())
    return np.sqrt(hi) / np.linalg.norm(g.mean(0)) + _SLACK

  return bound


def _two_phase_qsgd_bound(s, bucket, norm):
  """QSGD, two-phase: update = Q2(y), y = mean + e1 per chunk, Q2 the owner's own draw.

  ||update - mean||^2 = S1 + S2 + 2C with S1 = ||e1||^2, S2 = ||Q2(y) - y||^2,
  C = <e1, Q2(y) - y>. S1 as in _qsgd_bound. Given y, Lemma 3.1 gives
  E[S2 | y] <= W = sum_i c_i y_i^2 (c_i = min(b/s^2, sqrt(b)/s) of i's bucket; l2 norm),
  a sum of independent terms in e1 bounded by E[W] + Z sd(W); S2's terms are independent
  given y, each at most h2^2 (h2 = ||y_B|| / s, bounded per bucket the same way), so
  sd(S2 | y) <= h2max sqrt(W), and sd(C | y) <= h2max / 2 · sqrt(S1).
  """
  assert norm == "l2", "Lemma 3.1 needs the l2 norm"

  def bound(g):
    mean = g.mean(0)
    mean_var, var_sq = _mean_error_moments(g, s, bucket, norm, _CHUNK)
    s1 = mean_var.sum() + Z * np.sqrt(var_sq.sum())
    ids = _bucket_ids(g.shape[1], bucket, _CHUNK)
    size = np.bincount(ids)[ids]
    c = np.minimum(size / s**2, np.sqrt(size) / s)
    # y_i^2 = mean_i^2 + 2 mean_i e_i + e_i^2; Var(2 m e + e^2) <= 2 (4 m^2 Var e + Var e^2)
    y_sq = mean**2 + mean_var
    y_var = 2 * (4 * mean**2 * mean_var + var_sq)
    w = (c * y_sq).sum() + Z * np.sqrt((c**2 * y_var).sum())
    bucket_sq = np.bincount(ids, y_sq) + Z * np.sqrt(np.bincount(ids, y_var))
    h2max = np.sqrt(bucket_sq.max()) / s
    s2 = w + Z * h2max * np.sqrt(w)
    cross = Z * h2max / 2 * np.sqrt(s1)
    return np.sqrt(s1 + s2 + 2 * cross) / np.linalg.norm(mean) + _SLACK

  return bound


def _onebit(v, bucket, chunk=None):
  """1-bit SGD's quantization of rows v: each bucket's non-negative entries decode to
  their mean, the negative ones to theirs (the projection onto two constants)."""
  ids = _bucket_ids(v.shape[-1], bucket, chunk)
  out = np.empty_like(v)
  for d in range(v.shape[0]):
    pos = v[d] >= 0
    for side in (pos, ~pos):
      total = np.bincount(ids[side], v[d][side], minlength=ids.max() + 1)
      count = np.bincount(ids[side], minlength=ids.max() + 1)
      out[d][side] = (total / np.maximum(count, 1))[ids[side]]
  return out


def _exact_bound(update_fn):
  """A deterministic exchange: its own error (float64) plus float32 rounding."""

  def bound(g):
    mean = g.mean(0)
    return np.linalg.norm(update_fn(g) - mean) / np.linalg.norm(mean) + _SLACK

  return bound


def _cast(g, dtype):
  return np.asarray(jnp.asarray(g, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


def _fp16_scaled(rows):
  """Cast(float16) of each row: scaled by 2^(15 - e), e = ceil(log2 max|row|), cast,
  and scaled back (the scale is a power of two: exact)."""
  e = np.frexp(np.abs(rows).max(axis=-1, keepdims=True))[1]
  scale = np.ldexp(1.0, 15 - e)
  return _cast(rows * scale, jnp.float16) / scale


def _fp16_two_phase(g):
  chunks = g.reshape(K, K, _CHUNK)  # device, chunk, value
  first = np.stack([_fp16_scaled(chunks[d]) for d in range(K)]).mean(0)  # owner's average
  return _fp16_scaled(first).reshape(-1)


def _onebit_columns(rows):
  """1-bit SGD per column (Seide et al. §3) of rows holding the (48, 96) w32 matrix:
  every column's non-negative entries decode to their mean, the negative ones to theirs."""
  cols = rows.reshape(rows.shape[0], 48, 96).transpose(0, 2, 1).reshape(-1, 48)
  out = _onebit(cols, 48)  # one bucket per column
  return out.reshape(rows.shape[0], 96, 48).transpose(0, 2, 1).reshape(rows.shape[0], -1)


def _scaled_sign(rows, bucket, chunk=None):
  """EF-signSGD's scaled sign: ||v_B||_1 / |B| · sign(v) per bucket B, sign(0) = +1."""
  ids = _bucket_ids(rows.shape[-1], bucket, chunk)
  out = np.empty_like(rows)
  for d in range(rows.shape[0]):
    scale = np.bincount(ids, np.abs(rows[d])) / np.bincount(ids)
    out[d] = np.where(rows[d] >= 0, 1.0, -1.0) * scale[ids]
  return out


def _top(g, k):
  """Each row of g with all but its k largest magnitudes zeroed."""
  out = np.zeros_like(g)
  for d, row in enumerate(g):
    idx = np.argsort(-np.abs(row))[:k]
    out[d, idx] = row[idx]
  return out


def _randomk_worst_bound(ratio):
  """RandomK at density 1/ratio (an integer): systematic sampling keeps every ratio-th
  entry from a random start, so device d's draw is one of ``ratio`` phases and the
  update is one of ratio^K vectors. The bound is the largest error among all of them
  (exact enumeration through the Gram matrix of the devices' per-phase errors)."""

  def bound(g):
    k_dev, n = g.shape
    phase = np.arange(n) % ratio
    errs = np.stack(
      [np.stack([np.where(phase == c, ratio * row, 0.0) - row for c in range(ratio)]) for row in g]
    ).reshape(k_dev * ratio, n)
    gram = errs @ errs.T
    grid = np.meshgrid(*[np.arange(ratio)] * k_dev, indexing="ij")
    combos = np.stack(grid, -1).reshape(-1, k_dev)  # every device's phase, all ratio^K
    rows = combos + ratio * np.arange(k_dev)  # (combos, K) rows of errs
    sq = sum(gram[rows[:, a], rows[:, b]] for a in range(k_dev) for b in range(k_dev))
    return np.sqrt(sq.max()) / k_dev / np.linalg.norm(g.mean(0)) + _SLACK

  return bound


def _wangni_exact_p(a, epsilon):
  """Algorithm 2 of Wangni et al. (closed form, by sorting): p = min(λ|a|, 1) with the
  fewest kept entries in expectation subject to E||Q(a)||² = (1 + ε)||a||²."""
  mags = np.sort(np.abs(a))[::-1]
  total = np.sum(mags**2)
  for k in range(len(mags)):  # k saturated entries (p = 1)
    rest = mags[k:]
    lam = rest.sum() / (epsilon * total + np.sum(rest**2))
    if lam * rest[0] <= 1:
      break
  p = np.minimum(lam * np.abs(a), 1.0)
  # The constraint holds with equality (a check of this reimplementation).
  np.testing.assert_allclose(np.sum(a**2 / p), (1 + epsilon) * total, rtol=1e-9)
  return p


def _bernoulli_bound(p_of):
  """An unbiased Bernoulli sparsifier Q(x)_i = Z_i x_i / p_i (independent Z_i), through
  the all-gather: E[S] + Z sd(S) exactly, as _qsgd_bound, with per-entry error moments
  var = x²(1-p)/p and E e⁴ = x⁴ (1-p) ((1-p)³/p³ + 1)."""

  def bound(g):
    p = np.stack([p_of(row) for row in g])
    var = g**2 * (1 - p) / p
    m4 = g**4 * (1 - p) * ((1 - p) ** 3 / p**3 + 1)
    k = g.shape[0]
    mean_var = var.sum(0) / k**2
    var_sq = ((m4 - 3 * var**2).sum(0) + 2 * var.sum(0) ** 2) / k**4
    hi = mean_var.sum() + Z * np.sqrt(var_sq.sum())
    return np.sqrt(hi) / np.linalg.norm(g.mean(0)) + _SLACK

  return bound


def _normal_quantizer_bound(intervals, sigmas):
  """The normal quantizer is deterministic: a value within μ ± sigmas·σ decodes to a
  point of its interval (its conditional mean), so it errs by at most the interval's
  width; the others are sent exactly. The bound sums those widths per device (from the
  interval table: the format's definition), float64. The codec's (μ, σ) are float32, so
  a value near an edge may fall in the next interval: each value is charged the widest
  of its interval and the two beside it, and values up to 0.1% beyond the range count
  as inside."""
  _, edges, _ = normal_lib.intervals_table(intervals, sigmas)
  w = np.diff(edges)
  widths = np.maximum(np.maximum(w, np.r_[w[1:], w[-1]]), np.r_[w[0], w[:-1]])

  def bound(g):
    err = 0.0
    for row in g:
      mu, sigma = row.mean(), row.std()
      z = np.abs(row - mu) / sigma
      inside = z < sigmas * 1.001
      j = np.clip(np.searchsorted(edges, z, side="right") - 1, 0, len(widths) - 1)
      err += np.sqrt(np.sum(np.where(inside, widths[j] * sigma, 0.0) ** 2))
    return err / g.shape[0] / np.linalg.norm(g.mean(0)) + _SLACK

  return bound


def _float8_bound(mantissa_bits, min_exponent, max_finite, *, ulps, two_phase=False):
  """jc.codecs.Float8, worst case: each value within ``ulps`` of its format's ulp at its
  block's scale 2^e, ``ulps · (2^-m |x| + 2^(e + e_min - m))``, with 2^e < 2 max|x| / M
  (the smallest scale that fits); the mean of K such errors within the mean of the
  bounds. Two-phase: plus the owner's re-encoding of y = mean + e1, |y| <= |mean| + the
  first bound, its scale under that of 1.25 max|x|."""

  def one(x, amax):
    return ulps * (
      2.0**-mantissa_bits * np.abs(x)
      + 2.0 ** (min_exponent - mantissa_bits) * 2 * amax / max_finite
    )

  def bound(g):
    mean, amax = g.mean(0), np.abs(g).max()
    err = one(g, amax).mean(0)
    if two_phase:
      err = err + one(np.abs(mean) + err, 1.25 * amax)
    return np.linalg.norm(err) / np.linalg.norm(mean) + _SLACK

  return bound


BOUNDS = {
  "fp8_sr": _float8_bound(3, -6, 448.0, ulps=1.0),  # stochastic: under one ulp
  "fp8_e5m2_two_phase": _float8_bound(2, -14, 57344.0, ulps=0.5, two_phase=True),  # nearest
  "identity": _exact_bound(lambda g: g.mean(0)),
  "bf16": _exact_bound(lambda g: _cast(g, jnp.bfloat16).mean(0)),
  "fp16_two_phase": _exact_bound(_fp16_two_phase),
  "qsgd4": _qsgd_bound(7, 512, "max"),
  "qsgd2_l2_two_phase": _two_phase_qsgd_bound(1, 128, "l2"),
  "qsgd8_ef": _qsgd_bound(127, 512, "max"),  # the residual is zero at the first step
  "onebit_sgd": _exact_bound(  # two-phase on 8 devices: chunks of one bucket each
    lambda g: _onebit(_onebit(g, 1024, _CHUNK).mean(0)[None], 1024, _CHUNK)[0]
  ),
  "onebit_allgather": _exact_bound(lambda g: _onebit(g, 1024).mean(0)),
  # First step (zero residual): update = P P^T mean with P's columns orthonormal, an
  # orthogonal projection of the mean, so ||update - mean|| <= ||mean||.
  "powersgd": lambda g: 1.0 + _SLACK,
  # Per column, the two-phase chunks are whole columns: the owner re-quantizes the
  # average of the decoded columns per column again.
  "onebit_per_column": _exact_bound(lambda g: _onebit_columns(_onebit_columns(g).mean(0)[None])[0]),
  "onebit_per_column_allgather": _exact_bound(lambda g: _onebit_columns(g).mean(0)),
  # bucket_size=None: one bucket per two-phase chunk, in both phases.
  "ef_signsgd": _exact_bound(
    lambda g: _scaled_sign(_scaled_sign(g, _CHUNK, _CHUNK).mean(0)[None], _CHUNK, _CHUNK)[0]
  ),
  "ef_signsgd_allgather": _exact_bound(lambda g: _scaled_sign(g, 256).mean(0)),
  "topk": _exact_bound(lambda g: _top(g, 461).mean(0)),  # ceil(0.1 · 4608)
  "randomk": _randomk_worst_bound(4),
  "elias_qsgd": _qsgd_bound(7, 512, "max"),  # QSGD's quantization, draw for draw
  "normal": _normal_quantizer_bound(256, 3.0),
  "sparsify": _bernoulli_bound(lambda row: _wangni_exact_p(row, 1.0)),
  "dgc": _exact_bound(lambda g: _top(g, 461).mean(0)),
  "mipd": _exact_bound(lambda g: _top(g, 2304).mean(0)),  # round(0.5 · 4608) dropped
}


def test_every_factory_has_a_bound():
  assert set(BOUNDS) == set(FACTORIES), (
    f"factories without an error bound: {sorted(set(FACTORIES) - set(BOUNDS))}; "
    f"bounds without a factory: {sorted(set(BOUNDS) - set(FACTORIES))}"
  )


# Transforms that are the whole optimizer, exchange included: their updates are parameter
# steps, not a mean gradient, and they place their own per-device state (jc.onebit_adam
# keeps m and v replicated, so the updates are; it is not wrapped in per_device_state).
# freeze_step=2: of the three steps below the last one runs the compression stage.
OPTIMIZER_FACTORIES = {
  "onebit_adam": lambda axis: jc.onebit_adam(0.01, freeze_step=2, axis_name=axis),
  "onebit_adam_buckets": lambda axis: jc.onebit_adam(
    0.01, freeze_step=2, bucket_size=256, axis_name=axis
  ),
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
    a = np.asarray(state3[0].m[leaf], np.float64).ravel()
    b = np.asarray(s[0].mu[leaf], np.float64).ravel()
    cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    assert cos > 0.4, (name, leaf, cos)
  np.testing.assert_allclose(
    np.asarray(updates["b"]), np.asarray(ref["b"]), rtol=1e-5, atol=1e-8
  )  # the dense leaf: Adam on the mean


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
    _random_grads(k) for k in jax.random.split(jax.random.key(11), 2)
  ]
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

  update = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(AXIS), specs), out_specs=(P(), specs)))
  stacked = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), tree)

  def per_device(key):
    return jax.vmap(_random_grads)(jax.random.split(key, K))

  def grads_of(key_or_tree):
    tree = stacked(key_or_tree) if isinstance(key_or_tree, dict) else per_device(key_or_tree)
    return helpers.shard(tree, m)

  means = [jax.tree.map(jnp.zeros_like, PARAMS)] + [
    jax.tree.map(lambda g: jnp.mean(g.astype(jnp.float32), 0).astype(g.dtype), per_device(k))
    for k in jax.random.split(jax.random.key(11), 2)
  ]
  _optimizer_harness(name, update, state, grads_of, means)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
  "make",
  [
    lambda: jc.codecs.QSGD(7, 512, norm="l1"),
    lambda: jc.codecs.QSGD(0),
    lambda: jc.codecs.QSGD(-3),
    lambda: jc.codecs.QSGD(7, bucket_size=0),
    lambda: jc.codecs.QSGD(7, bucket_size=-512),
    lambda: jc.codecs.OneBit(bucket_size=0),
    lambda: jc.qsgd(bits=1, axis_name=None),
    lambda: jc.qsgd(norm="inf", axis_name=None),
    lambda: jc.qsgd(bucket_size=0, axis_name=None),
    lambda: jc.compress(jc.codecs.Identity(), collective="ring", axis_name=None),
    lambda: jc.wire_report(
      jc.qsgd(axis_name=AXIS, collective="allgather"), PARAMS, axis_name=AXIS, num_devices=1
    ),
  ],
)
def test_bad_arguments_raise_value_error(make):
  with pytest.raises(ValueError):
    make()


#: Every transform that exchanges, built with its other arguments given.
EXCHANGING = {
  "compress": lambda **kw: jc.compress(jc.codecs.QSGD(7), **kw),
  "qsgd": jc.qsgd,
  "onebit_sgd": jc.onebit_sgd,
  "ef_signsgd": jc.ef_signsgd,
  "sparsify": lambda **kw: jc.sparsify(density=0.1, **kw),
  "dgc": jc.dgc,
  "mipd": jc.mipd,
  "powersgd": jc.powersgd,
  "onebit_adam": lambda **kw: jc.onebit_adam(1e-3, freeze_step=1, **kw),
  "scale_by_onebit_adam": lambda **kw: jc.scale_by_onebit_adam(freeze_step=1, **kw),
  "decoupled_momentum": lambda **kw: jc.decoupled_momentum(1e-3, **kw),
  "scale_by_decoupled_momentum": jc.scale_by_decoupled_momentum,
  "qsvrg": lambda **kw: jc.qsvrg(lambda w, batch: jnp.sum(w), 0.1, **kw),
  "diloco": lambda **kw: jc.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, **kw),
  "sparseloco": lambda **kw: jc.sparseloco(optax.sgd(0.1), sync_every=2, density=0.1, **kw),
}


@pytest.mark.parametrize("name", sorted(EXCHANGING))
def test_exchanging_transforms_require_axis_name(name):
  """Built without axis_name a transform would compress locally and exchange nothing
  (under pmap the replicas drift apart silently): the error says what to pass, and
  axis_name=None, the one-device simulation, is an explicit choice. (Under pmap with
  the axis given, the replicas get the same mean: test_harness_pmapped.)"""
  make = EXCHANGING[name]
  with pytest.raises(
    TypeError,
    match=rf"jc\.{name} needs axis_name: .*axis_name='batch'.*"
    r"axis_name=None to simulate the compression on one device",
  ):
    make()
  make(axis_name=None)
  make(axis_name=AXIS)


#: A user's flattened shards: 1-D leaves, which the default filter leaves out.
FLAT = {"w": jnp.zeros((4096,)), "b": jnp.zeros((10,))}
# QSVRG compresses every leaf; DiLoCo's (and SparseLoCo's) exchange is the one that filters.
_FILTERED = [n for n in sorted(EXCHANGING) if n not in ("qsvrg", "diloco", "sparseloco")]


@pytest.mark.parametrize("name", _FILTERED)
def test_a_filter_that_leaves_nothing_to_compress_warns(name):
  """Every leaf left out by the filter: the run would average everything dense and say
  nothing; init warns, naming the filter and how to change it. A model with a leaf to
  compress does not warn."""
  tx = EXCHANGING[name](axis_name=None)
  with pytest.warns(UserWarning, match=r"compresses nothing: the default filter \(jc\.default_"):
    tx.init(FLAT)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.init(PARAMS)


def test_the_warning_names_the_filter_passed():
  tx = jc.qsgd(axis_name=None, filter=lambda path, leaf: leaf.size > 10**6)
  with pytest.warns(
    UserWarning,
    match=r"filter=<lambda> leaves out all 2 gradient leaves.*"
    r"filter=lambda path, leaf: True",
  ):
    tx.init(FLAT)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jc.qsgd(axis_name=None, filter=lambda path, leaf: True).init(FLAT)


def test_bad_types_raise_type_error():
  with pytest.raises(TypeError, match="codec"):
    jc.compress("qsgd", axis_name=None)
  with pytest.raises(TypeError, match="floating"):
    jc.codecs.Cast(jnp.int8)
  tx = jc.qsgd(axis_name=None)
  with pytest.raises(TypeError, match="floating-point"):
    tx.init({"steps": jnp.zeros((64, 64), jnp.int32)})
  state = tx.init({"w": jnp.zeros((64, 64))})
  with pytest.raises(TypeError, match="floating-point"):
    tx.update({"w": jnp.zeros((64, 64), jnp.int32)}, state)
  with pytest.raises(TypeError, match="floating-point"):
    jc.codecs.QSGD(7).encode(jnp.arange(10), key=jax.random.key(0))


def test_filter_selects_leaves():
  tx = jc.qsgd(
    bits=2, filter=lambda path, leaf: "w16" in jax.tree_util.keystr(path), axis_name=None
  )
  grads = _random_grads(jax.random.key(2))
  updates, _ = tx.update(grads, tx.init(PARAMS))
  chex.assert_trees_all_equal(updates["w32"], grads["w32"])  # not compressed
  assert not np.array_equal(updates["w16"], grads["w16"])  # compressed
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
  np.testing.assert_array_equal(r2[3], r1[3])  # the bad device keeps its residual
  assert np.all(np.isfinite(r2))
  assert not np.array_equal(r2[0], r1[0])  # the others carry on
  np.testing.assert_array_equal(np.asarray(state2.inner.nonfinite_count), [0, 0, 0, 1, 0, 0, 0, 0])
  for leaf in jax.tree.leaves(state2.inner.chunk_residual):
    assert np.all(np.isfinite(np.asarray(leaf)))  # second stage too
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
  tx = optax.chain(
    jc.per_device_state(jc.onebit_sgd(bucket_size=256, axis_name=AXIS)),
    optax.sgd(lr, momentum=MOMENTUM),
  )
  params = {"w": jnp.zeros((d, o))}
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=K)
  with jax.numpy_dtype_promotion("standard"):  # optax schedules mix int and float
    state = helpers.shard_map_init(tx, params, m)

    def train(params, state, x, y, key):
      x, y = x[0], y[0]

      def body(carry, step_key):
        params, state = carry
        if minibatch:
          idx = jax.random.choice(
            jax.random.fold_in(step_key, lax.axis_index(AXIS)), rows, (8,), replace=False
          )
          xb, yb = x[idx], y[idx]
        else:
          xb, yb = x, y
        # Local gradient: w.r.t. replicated params, jax.grad would psum it (dense).
        grads = jax.grad(lambda p: loss(p["w"], xb, yb))(jc.vary(params, AXIS))
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), None

      (params, state), _ = lax.scan(body, (params, state), jax.random.split(key, steps))
      return params, state

    run = jax.jit(
      jax.shard_map(
        train, mesh=m, in_specs=(P(), specs, P(AXIS), P(AXIS), P()), out_specs=(P(), specs)
      )
    )
    params, _ = run(params, state, helpers.shard(x, m), helpers.shard(y, m), jax.random.key(8))
  return float(loss(params["w"], xa, ya)), optimum


# Per transform: the exchange, and its update for the local gradients x_d = d of the
# harness below (mean 3.5) with its tolerance. QSGD: 4-bit noise on a constant; PowerSGD:
# a rank-1 mean, exact at rank 2; 1-bit Adam: Adam's first step (dense warm-up), -lr.
_REPLICATED_CASES = {
  "qsgd": (lambda: jc.per_device_state(jc.qsgd(axis_name=AXIS, collective="allgather")), 3.5, 0.05),
  "powersgd": (lambda: jc.per_device_state(jc.powersgd(2, axis_name=AXIS)), 3.5, 1e-5),
  "onebit_adam": (lambda: jc.onebit_adam(1e-3, freeze_step=1, axis_name=AXIS), -1e-3, 1e-5),
}


@pytest.mark.parametrize("name", sorted(_REPLICATED_CASES))
def test_already_reduced_gradient_is_a_clear_error(name):
  """jax.grad w.r.t. replicated params in shard_map psums: compressing that is refused,
  and the local gradients (w.r.t. jc.vary(params)) give the expected update."""
  make, expected, rtol = _REPLICATED_CASES[name]
  m = helpers.mesh()
  tx = make()
  params = {"w": jnp.ones((64, 64))}
  specs = jc.state_specs(tx, params, axis_name=AXIS, num_devices=K)
  state = helpers.shard_map_init(tx, params, m)
  x = helpers.shard(jnp.arange(K, dtype=jnp.float32), m)

  def step(params, state, x, use_vary):
    p = jc.vary(params, AXIS) if use_vary else params
    grads = jax.grad(lambda p: jnp.sum(p["w"]) * x[0])(p)
    return tx.update(grads, state, params)

  for use_vary in (True, False):
    run = jax.jit(
      jax.shard_map(
        lambda p, s, x: step(p, s, x, use_vary),
        mesh=m,
        in_specs=(P(), specs, P(AXIS)),
        out_specs=(P(), specs),
      )
    )
    if use_vary:
      updates, _ = run(params, state, x)
      np.testing.assert_allclose(np.asarray(updates["w"]), expected, rtol=rtol)
    else:
      with pytest.raises(ValueError, match="already replicated"):
        run(params, state, x)


@pytest.mark.parametrize("minibatch,steps", [(False, 800), (True, 2000)])
def test_onebit_sgd_converges_on_least_squares(minibatch, steps):
  final, optimum = _least_squares(minibatch, steps)
  assert final <= 1.01 * optimum, (final, optimum)
