"""QSGD (``jc.codecs.QSGD``, ``jc.qsgd``, docs/methods/qsgd.md): stochastic quantization
to s levels per sign, bucket by bucket (§3.1, §4).

Statistical tests draw M keys at once (``jax.vmap`` over keys), estimate the standard
error from the samples, and allow about 5 standard errors. Each comes with an exact
reference computed here in float64 from the paper's formulas (§3.1), so that plausible
bugs (floor instead of stochastic rounding, a lost sign, a wrong scale or level count,
shared randomness) are rejected; the unbiasedness, variance and independence checks also
run on deliberately wrong quantizers (negative controls) to show that they can fail.
The codecs' shared properties (wire size, dtypes, jit and vmap, decode_sum, non-finite
inputs) are in tests/test_codecs.py, ``jc.qsgd`` in the transforms' harness in
tests/test_transforms.py.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from tests.test_codecs import F32_EPS
from tests.test_codecs import _encode_fn
from tests.test_codecs import _keys
from tests.test_codecs import _normal
from tests.test_codecs import _round_trip

C = jc.codecs


# ----------------------------------------------------------------------------- helpers


@functools.cache
def _sampler(codec):
  """jit(vmap over keys) of decode(encode(x, key))."""
  return jax.jit(jax.vmap(lambda x, k: codec.decode(codec.encode(x, key=k)), in_axes=(None, 0)))


def _samples(codec, x, m: int, seed: int = 0):
  """(m, n) float64 array of decodings of x under m independent keys."""
  out = _sampler(codec)(jnp.asarray(x), _keys(m, seed))
  return np.asarray(out, np.float64).reshape(m, -1)


def _rounding_reference(x, levels, bucket_size=None, norm="l2"):
  """QSGD's stochastic rounding (the paper's §3.1) in float64: per value ``l``, ``p`` and ``step``.

  ``r = |v_i| s / scale``, ``l = floor(r)``, ``p = r - l`` (probability of rounding up),
  ``step = scale / s``; so ``E[Q_i] = sgn(v_i) (l + p) step = v_i`` and
  ``Var[Q_i] = p (1 - p) step^2``.
  """
  x = np.asarray(x, np.float64).reshape(-1)
  n = x.size
  b = n if bucket_size is None else min(bucket_size, n)
  nb = -(-n // b)
  v = np.zeros(nb * b)
  v[:n] = x
  v = v.reshape(nb, b)
  if norm == "max":
    scale = np.max(np.abs(v), axis=1)
  else:
    scale = np.sqrt(np.sum(v * v, axis=1))
  step = scale / levels
  with np.errstate(divide="ignore", invalid="ignore"):
    r = np.where(scale[:, None] > 0, np.abs(v) * levels / scale[:, None], 0.0)
  low = np.floor(r)
  p = r - low
  step = np.repeat(step, b)
  return low.reshape(-1)[:n], p.reshape(-1)[:n], step[:n]


def _bucketed_normal(n, bucket_size, seed, zeros=True):
  """Normal values whose buckets have magnitudes 1e-3..1e3, with some exact zeros."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n)
  nb = -(-n // bucket_size)
  x *= np.repeat(10.0 ** rng.uniform(-3, 3, size=nb), bucket_size)[:n]
  if zeros:
    x[rng.choice(n, size=max(n // 50, 1), replace=False)] = 0.0
  return x.astype(np.float32)


def _random_signs(n, seed):
  """Values of equal magnitude 1 with random signs (||x|| = sqrt(n) exactly)."""
  return np.where(np.random.default_rng(seed).random(n) < 0.5, -1.0, 1.0).astype(np.float32)


# ----------------------------------------------------------------------------- unbiasedness


def _unbiasedness_check(samples, x, p, z_max=5.0):
  """Whether the per-coordinate sample means are consistent with E[Q(x)] = x.

  Two tests, both on standard errors estimated from the samples:
  * aggregate: ``T = ||mean - x||^2`` has ``E[T] = sum(var)/M`` and
    ``sd[T] ~ sqrt(2 sum(var^2))/M``; a bias vector b adds ``||b||^2`` to T;
  * per coordinate, where the rounding-up probability p is in [0.05, 0.95] (so that the
    normal approximation holds with M = 4000): ``|mean_i - x_i| <= z_max SE_i``.
  Returns (ok, message).
  """
  x = np.asarray(x, np.float64).reshape(-1)
  m = samples.shape[0]
  mean = samples.mean(axis=0)
  var = samples.var(axis=0, ddof=1)
  err = mean - x
  t = float(np.sum(err**2))
  et = float(var.sum() / m)
  sd_t = float(np.sqrt(2.0 * np.sum(var**2)) / m)
  fp_tol = float(np.sum((4 * F32_EPS * x) ** 2))  # float32 resolution of the grid values
  agg_ok = t <= et + z_max * sd_t + fp_tol
  sel = (p > 0.05) & (p < 0.95)
  assert sel.sum() >= 10, "test vector has too few coordinates with 0.05 < p < 0.95"
  se = np.sqrt(var[sel] / m)
  coord_ok = bool(np.all(np.abs(err[sel]) <= z_max * se))
  with np.errstate(divide="ignore", invalid="ignore"):
    worst_z = float(np.max(np.abs(err[sel]) / se))
  msg = (
    f"T={t:.4g} vs E[T]={et:.4g} + {z_max}*sd {sd_t:.4g}; "
    f"max per-coordinate |z|={worst_z:.3g} over {sel.sum()} coordinates"
  )
  return bool(agg_ok and coord_ok), msg


UNBIASED_CASES = {
  # name: (codec, x)
  "l2-2levels-n512": (C.QSGD(2), _normal(512, seed=1)),
  "l2-3levels-buckets100-n250": (C.QSGD(3, bucket_size=100), _normal(250, seed=2)),
  "max-7levels-buckets512-n1300": (
    C.QSGD(7, bucket_size=512, norm="max"),
    _bucketed_normal(1300, 512, seed=3),
  ),
}


M_STAT = 4000


@pytest.mark.parametrize("name", list(UNBIASED_CASES))
def test_qsgd_unbiased(name):
  codec, x = UNBIASED_CASES[name]
  samples = _samples(codec, x, M_STAT)
  _, p, _ = _rounding_reference(x, codec.levels, codec.bucket_size, codec.norm)
  ok, msg = _unbiasedness_check(samples, x, p)
  assert ok, msg


HANDMADE_KINDS = ("correct", "floor", "nearest", "p+0.02", "no_sign", "scale*1.1")


@functools.cache
def _handmade_quantizer(levels: int):
  """A jnp re-implementation of one-bucket l2 QSGD: correct or deliberately wrong.

  Returns jit(vmap over keys) of (x, keys, kind index) -> samples; the kind is a traced
  index into HANDMADE_KINDS so that all kinds share one compilation.
  """
  s = float(levels)

  def q(x, key, kind):
    scale = jnp.sqrt(jnp.sum(x * x))
    r = jnp.abs(x) * (s / scale)
    low = jnp.floor(r)
    u = jax.random.uniform(key, x.shape, jnp.float32)
    up = lambda prob: (u < prob).astype(jnp.float32)
    sign = jnp.sign(x)
    variants = [
      sign * scale * (low + up(r - low)) / s,  # correct
      sign * scale * low / s,  # floor
      sign * scale * jnp.round(r) / s,  # round to nearest
      # stochastic, but rounded up slightly too often
      sign * scale * (low + up(jnp.clip(r - low + 0.02, 0.0, 1.0))) / s,
      scale * (low + up(r - low)) / s,  # sign forgotten
      sign * (1.1 * scale) * (low + up(r - low)) / s,  # wrong scale
    ]
    return jnp.stack(variants)[kind]

  return jax.jit(jax.vmap(q, in_axes=(None, 0, None)))


@pytest.mark.parametrize("kind", HANDMADE_KINDS)
def test_unbiasedness_check_rejects_biased_quantizers(kind):
  """Negative control: the check of test_qsgd_unbiased rejects biased quantizers.

  The ``correct`` re-implementation passes the very same check, so the others fail
  because of their bias, not because they differ from the codec in some other way.
  """
  x = UNBIASED_CASES["l2-2levels-n512"][1]
  samples = np.asarray(
    _handmade_quantizer(2)(jnp.asarray(x), _keys(M_STAT), HANDMADE_KINDS.index(kind)), np.float64
  )
  _, p, _ = _rounding_reference(x, 2)
  ok, msg = _unbiasedness_check(samples, x, p)
  assert ok == (kind == "correct"), msg


# ----------------------------------------------------------------------------- variance


def _variance_check(samples, x, p, step, z_max=5.0):
  """Per-coordinate E[(Q_i - x_i)^2] = p (1 - p) step^2, and its sum, within z_max SE.

  Per coordinate the squared error takes two values, so its sample mean is a linear
  function of the fraction rounded up and its SE (from the samples) is that of a
  proportion: a plain z-test (on coordinates with 0.05 < p < 0.95).
  """
  x = np.asarray(x, np.float64).reshape(-1)
  m = samples.shape[0]
  sq = (samples - x) ** 2
  exact = p * (1 - p) * step**2
  # aggregate: the squared error of the whole vector, one number per key
  tot = sq.sum(axis=1)
  tot_se = tot.std(ddof=1) / np.sqrt(m)
  fp_tol = 1e-5 * float(np.sum(step**2))  # p is known to float32 resolution only
  agg_z = abs(tot.mean() - exact.sum()) / tot_se
  agg_ok = abs(tot.mean() - exact.sum()) <= z_max * tot_se + fp_tol
  sel = (p > 0.05) & (p < 0.95)
  mse = sq[:, sel].mean(axis=0)
  se = sq[:, sel].std(axis=0, ddof=1) / np.sqrt(m)
  coord_ok = bool(np.all(np.abs(mse - exact[sel]) <= z_max * se + 1e-5 * step[sel] ** 2))
  msg = (
    f"E||Q-x||^2: empirical {tot.mean():.5g} vs exact {exact.sum():.5g} "
    f"(z={agg_z:.3g}); per-coordinate ok={coord_ok}"
  )
  return bool(agg_ok and coord_ok), msg


@pytest.mark.parametrize("name", list(UNBIASED_CASES))
def test_qsgd_variance_matches_stochastic_rounding_formula(name):
  codec, x = UNBIASED_CASES[name]
  samples = _samples(codec, x, M_STAT, seed=1)
  _, p, step = _rounding_reference(x, codec.levels, codec.bucket_size, codec.norm)
  ok, msg = _variance_check(samples, x, p, step)
  assert ok, msg


def test_variance_check_rejects_wrong_level_count():
  """Negative control: QSGD with s-1 levels is unbiased but has the wrong variance."""
  x = UNBIASED_CASES["l2-2levels-n512"][1]
  wrong = _samples(C.QSGD(3), x, M_STAT, seed=1)
  _, p, _ = _rounding_reference(x, 3)
  assert _unbiasedness_check(wrong, x, p)[0]  # unbiased: the mean alone cannot tell
  _, p4, step4 = _rounding_reference(x, 4)
  ok, msg = _variance_check(wrong, x, p4, step4)
  assert not ok, msg


def _independence_z(samples, x, exact_var_sum):
  """z of Var(sum_i (Q_i - x_i)) against sum_i Var(Q_i) (independent coordinates)."""
  m = samples.shape[0]
  s = (samples - np.asarray(x, np.float64)).sum(axis=1)
  ratio = s.var(ddof=1) / exact_var_sum
  return (ratio - 1.0) / np.sqrt(2.0 / (m - 1))


def test_qsgd_rounding_independent_across_values_and_buckets():
  # Four identical buckets: shared randomness between buckets (or between values)
  # would correlate their errors and inflate the variance of the total error.
  y = _normal(256, seed=4)
  x = np.tile(y, 4)
  codec = C.QSGD(3, bucket_size=256)
  samples = _samples(codec, x, M_STAT, seed=2)
  _, p, step = _rounding_reference(x, 3, 256)
  exact = float(np.sum(p * (1 - p) * step**2))
  assert abs(_independence_z(samples, x, exact)) <= 5.0
  # Negative control: the same marginals with the four buckets rounded identically.
  correlated = np.tile(samples[:, :256], (1, 4))
  assert _independence_z(correlated, x, exact) > 5.0
  # Different buckets with equal contents are rounded differently for (almost) every key.
  differ = np.any(samples[:, :256] != samples[:, 256:512], axis=1)
  assert differ.mean() > 0.99


# ----------------------------------------------------------------------------- Lemma 3.1


# (n, s, vector kind): which term of min(n/s^2, sqrt(n)/s) is active is noted.
BOUND_CASES = [
  (1024, 2, "signs"),  # sqrt(n)/s = 16 active (n/s^2 = 256); exact ratio 15: near tight
  (4096, 1, "normal"),  # sqrt(n)/s = 64 active
  (16, 8, "normal"),  # n/s^2 = 0.25 active (sqrt(n)/s = 0.5)
  (64, 12, "signs"),  # n/s^2 = 0.44 active; every p = 1/2 (r = 1.5)
]


M_BOUND = 2000


def _vector(n, kind, seed):
  return _random_signs(n, seed) if kind == "signs" else _normal(n, seed)


@pytest.mark.parametrize("n, s, kind", BOUND_CASES)
def test_qsgd_lemma_3_1_variance_bound(n, s, kind):
  x = _vector(n, kind, seed=n + s)
  samples = _samples(C.QSGD(s), x, M_BOUND, seed=3)
  x64 = x.astype(np.float64)
  norm2 = float(np.sum(x64**2))
  ratio = np.sum((samples - x64) ** 2, axis=1) / norm2  # ||Q(v) - v||^2 / ||v||^2 per key
  emp, se = ratio.mean(), ratio.std(ddof=1) / np.sqrt(M_BOUND)
  bound = min(n / s**2, math.sqrt(n) / s)
  assert emp <= bound + 4 * se, (emp, se, bound)
  # ... and the empirical value is the exact one (so the bound is really being tested).
  _, p, step = _rounding_reference(x, s)
  exact = float(np.sum(p * (1 - p) * step**2)) / norm2
  assert exact <= bound
  # (+ float32 resolution: with every p = 1/2 the squared error is constant, se ~ 0)
  assert abs(emp - exact) <= 5 * se + 1e-5 * exact, (emp, exact, se)
  if kind == "signs" and s * s < n:
    assert exact == pytest.approx(math.sqrt(n) / s - 1, rel=1e-9)


# (the same codecs and shapes as BOUND_CASES: no new compilation)
@pytest.mark.parametrize(
  "n, s, kind", [(4096, 1, "signs"), (4096, 1, "normal"), (1024, 2, "signs"), (1024, 2, "normal")]
)
def test_qsgd_lemma_3_1_sparsity_bound(n, s, kind):
  bound = s * (s + math.sqrt(n))
  assert bound < n / 10  # informative (the l0 norm could be up to n)
  x = _vector(n, kind, seed=7 * n + s)
  samples = _samples(C.QSGD(s), x, M_BOUND, seed=4)
  nnz = np.count_nonzero(samples, axis=1).astype(np.float64)
  emp, se = nnz.mean(), nnz.std(ddof=1) / np.sqrt(M_BOUND)
  assert emp <= bound + 4 * se, (emp, se, bound)
  # exact expectation: P(xi_i > 0) = 1 if l_i >= 1 else p_i
  low, p, _ = _rounding_reference(x, s)
  exact = float(np.sum(np.where(low >= 1, 1.0, p)))
  assert abs(emp - exact) <= 5 * se, (emp, exact, se)


# ----------------------------------------------------------------------------- exact QSGD


@pytest.mark.parametrize("name", list(UNBIASED_CASES))
def test_qsgd_of_zero_is_zero(name):
  codec, x = UNBIASED_CASES[name]  # the same codecs and shapes: no new compilation
  n = x.size
  zeros = _samples(codec, np.zeros(n, np.float32), M_STAT)
  assert np.all(zeros == 0.0)
  # A zero bucket among non-zero ones decodes to zeros (no 0/0), exact zeros stay zero.
  x = x.copy()
  b = codec.bucket_size or n
  if b < n:
    x[:b] = 0.0
  x[b + 7 if b < n else 7] = 0.0
  out = _samples(codec, x, M_STAT)
  assert np.all(np.isfinite(out))
  assert np.all(out[:, x == 0] == 0.0)


MAX_CASES = [
  (C.QSGD(7, bucket_size=512, norm="max"), 1300),
  (C.QSGD(1, bucket_size=128, norm="max"), 1000),
]


@pytest.mark.parametrize("codec, n", MAX_CASES, ids=lambda v: str(v))
def test_qsgd_max_norm_exact_properties(codec, n):
  s, b = codec.levels, codec.bucket_size
  x = _bucketed_normal(n, b, seed=3 if s == 7 else s)  # s = 7: the unbiasedness vector
  x64 = x.astype(np.float64)
  m = M_STAT  # (the sampler compiled for test_qsgd_unbiased)
  out = _samples(codec, x, m, seed=5)
  nb = -(-n // b)
  bucket_of = np.arange(n) // b
  bmax = np.array([np.max(np.abs(x64[bucket_of == j])) for j in range(nb)])
  step = (bmax / s)[bucket_of]
  err = np.abs(out - x64)
  # every decoded value within bucket_max / s of its input, for every key
  assert np.all(err <= step * (1 + 4 * F32_EPS)), float(np.max(err / step))
  # on the grid step * k, |k| <= s
  k = out / step
  assert np.all(np.abs(k - np.round(k)) <= 1e-5)
  assert np.all(np.abs(np.round(k)) <= s)
  # signs preserved; zeros stay zero
  assert np.all(out * x64 >= 0)
  assert np.all(out[:, x64 == 0] == 0)
  # the bucket's max entry is reconstructed (up to float32 rounding of s * (max / s))
  arg = np.array([np.argmax(np.where(bucket_of == j, np.abs(x64), -1)) for j in range(nb)])
  if s == 1:
    np.testing.assert_array_equal(out[:, arg], np.broadcast_to(x64[arg], (m, nb)))
  else:
    np.testing.assert_allclose(
      out[:, arg], np.broadcast_to(x64[arg], (m, nb)), rtol=2 * F32_EPS, atol=0
    )
  # the payload's scales are the bucket maxima, exactly
  payload = _encode_fn(codec)(jnp.asarray(x), jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(payload.arrays["scales"], np.float64), bmax)


def test_qsgd_l2_payload_scales_are_bucket_norms():
  codec, x = UNBIASED_CASES["l2-3levels-buckets100-n250"]
  payload = _encode_fn(codec)(jnp.asarray(x), jax.random.key(0))
  x64 = np.pad(x.astype(np.float64), (0, 50)).reshape(3, 100)
  np.testing.assert_allclose(
    np.asarray(payload.arrays["scales"]), np.sqrt(np.sum(x64**2, axis=1)), rtol=1e-6
  )


def test_qsgd_reproducible_and_key_dependent():
  codec, x = UNBIASED_CASES["max-7levels-buckets512-n1300"]  # (compiled already)
  x = jnp.asarray(x)
  enc = _encode_fn(codec)
  p1, p2 = enc(x, jax.random.key(3)), enc(x, jax.random.key(3))
  chex.assert_trees_all_equal(p1, p2)
  p3 = enc(x, jax.random.key(4))
  assert not np.array_equal(np.asarray(p1.arrays["words"]), np.asarray(p3.arrays["words"]))
  # Raw uint32 key data is accepted and means the same key.
  raw = enc(x, jax.random.PRNGKey(3))
  typed = enc(x, jax.random.wrap_key_data(jax.random.PRNGKey(3)))
  chex.assert_trees_all_equal(raw, typed)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(levels=0),
    dict(levels=-1),
    dict(levels=1.5),
    dict(levels=True),
    dict(levels=2.0),
    dict(levels=None),
    dict(levels=3, bucket_size=0),
    dict(levels=3, bucket_size=-4),
    dict(levels=3, bucket_size=True),
    dict(levels=3, bucket_size=64.0),
    dict(levels=3, norm="l1"),
    dict(levels=3, norm="L2"),
  ],
)
def test_qsgd_bad_arguments_raise(kwargs):
  with pytest.raises(ValueError):
    C.QSGD(**kwargs)


def test_qsgd_needs_a_key():
  codec = C.QSGD(3)
  assert codec.needs_key and not C.OneBit().needs_key
  with pytest.raises(ValueError, match="key"):
    codec.encode(jnp.ones((10,), jnp.float32))


# ----------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("norm", ["max", "l2"])
@pytest.mark.parametrize("bucket", [37, 128, 512, 1024])
def test_qsgd_scale_is_nan_for_a_non_finite_value_at_any_position(bucket, norm):
  """One pass computes both the bucket's max |v| and its finiteness (a NaN-propagating
  max/min). XLA:CPU's plain row max skips NaNs at some positions, so a NaN is put at
  every position of a bucket (and an infinity at a few): each must give that bucket, and
  only it, a NaN scale, and the other buckets their exact float64 scale."""
  codec = C.QSGD(7, bucket, norm)
  n = 3 * bucket - 5  # a ragged last bucket
  x = _normal(n, seed=bucket)
  cases = [(pos, np.nan) for pos in range(bucket)]
  cases += [(pos, bad) for pos in (0, bucket // 2, bucket - 1) for bad in (np.inf, -np.inf)]
  cases += [(2 * bucket + pos, np.nan) for pos in (0, bucket - 6)]  # the ragged bucket
  xs = np.repeat(x[None], len(cases), axis=0)
  for row, (pos, bad) in enumerate(cases):
    xs[row, pos] = bad
  v = jnp.asarray(xs)

  @jax.jit
  def all_scales(v):
    return jax.vmap(lambda row: codec.encode(row, key=jax.random.key(0)).arrays["scales"])(v)

  scales = np.asarray(all_scales(v))
  clean = np.pad(x.astype(np.float64), (0, 3 * bucket - n)).reshape(3, bucket)
  want = np.max(np.abs(clean), axis=1) if norm == "max" else np.sqrt(np.sum(clean * clean, axis=1))
  for row, (pos, _) in enumerate(cases):
    hit = pos // bucket
    assert np.isnan(scales[row, hit]), (pos, scales[row])
    others = [b for b in range(3) if b != hit]
    np.testing.assert_allclose(scales[row, others], want[others], rtol=2e-6)


# -------------------------------------------------------------------------- extreme inputs
# Finite inputs decode to finite values (neither NaN nor zeros), and level counts that
# float32 cannot represent are rejected.


@pytest.mark.parametrize("magnitude", [3e19, 1e-20])
def test_qsgd_l2_finite_extreme_magnitudes(magnitude):
  """The l2 norm neither overflows (NaN for finite input) nor underflows (all zeros)."""
  x = np.array([1.0, -1.0, 0.5, 0.25], np.float32) * np.float32(magnitude)
  x64 = x.astype(np.float64)
  out = _samples(C.QSGD(4), x, 64)
  assert np.all(np.isfinite(out))
  step = np.linalg.norm(x64) / 4
  assert np.all(np.abs(out - x64) <= step * (1 + 1e-5))
  assert np.all(out * x64 >= 0)
  assert np.any(out != 0)


@pytest.mark.parametrize("levels", [2**24, 2**31 - 1, 2**31, 2**40])
def test_qsgd_levels_beyond_float32_rejected(levels):
  """Level counts float32 cannot hold are rejected: float32(2**31 - 1) = 2**31 would
  overflow the magnitude code into the sign bit."""
  with pytest.raises(ValueError, match="levels"):
    C.QSGD(levels)


def test_qsgd_largest_levels_round_trip():
  codec = C.QSGD(2**24 - 1, norm="max")
  x = np.array([1.0, -0.5, 0.25, -1.0 / 3.0], np.float32)
  out = np.asarray(_round_trip(codec, x), np.float64)
  assert codec.bits == 25
  assert np.all(np.abs(out - x) <= 1.0 / (2**24 - 1) * (1 + 1e-6))
  assert np.all(np.sign(out) == np.sign(x))


def test_reciprocal_times_value_never_exceeds_one():
  """m · fl(1/m) <= 1 for every float32 mantissa (all of [1, 2); powers of two scale
  out): QSGD's r = |v|·fl(1/max)·s never exceeds s, so no path needs its clamp to s.
  It is 1 − 2^-24 for about 15% of them: there the max rounds down with probability
  at most s·2^-23 (arith.level_ratio)."""
  m = (np.arange(2**23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
  p = m * (np.float32(1) / m)
  assert p.dtype == np.float32 and p.max() == 1.0
  assert p.min() == np.float32(1) - np.float32(2.0**-24)
  assert 0.1 < np.mean(p < 1) < 0.2


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_qsgd_huge_bucket_is_not_sent_as_zeros(norm):
  """A bucket whose scale is >= 2**126 has a subnormal reciprocal, which XLA:CPU flushes
  to zero; arith.inverse_scale scales it, so the bucket is not sent as zeros."""
  if norm == "max":
    big = np.float32(np.finfo(np.float32).max)
    x = np.array([big, -big / 2, big / 3, 1e38, -(2.0**126), 1.0, 0.0, -1e37], np.float32)
  else:  # an l2 norm that float32 holds: 2**126 * 1.17
    x = np.array(
      [2.0**126, -(2.0**125), 2.0**124, 3e37, -(2.0**120), 1.0, 0.0, 2.0**125], np.float32
    )
  x64 = x.astype(np.float64)
  codec = C.QSGD(7, norm=norm)
  payload = codec.encode(jnp.asarray(x), key=jax.random.key(3))
  scale = float(payload.arrays["scales"][0])
  want = np.abs(x64).max() if norm == "max" else np.linalg.norm(x64)
  np.testing.assert_allclose(scale, want, rtol=1e-6)
  assert scale >= 2.0**126
  out = np.asarray(codec.decode(payload), np.float64)
  assert np.all(np.abs(out - x64) <= scale / 7 * (1 + 1e-6)), out
  assert np.count_nonzero(out[:5]) >= 3, out  # not all zeros (the large values survive)
  assert np.all(out * x64 >= 0)


def test_qsgd_max_entry_never_rounds_down():
  """|v|/max·s is exactly s at the bucket max here (the product form s/max·|v| can fall
  below); with r = |v|·fl(1/max)·s that holds for about 85% of the mantissas."""
  x = jnp.array([0.38036475, 0.19018237], jnp.float32)
  out = C.QSGD(7, norm="max").decode(C.QSGD(7, norm="max").encode(x, key=jax.random.key(5991920)))
  np.testing.assert_allclose(np.asarray(out)[0], 0.38036475, rtol=3e-7)


# ----------------------------------------------------------------------------- QSGD levels


def test_qsgd_levels_argument():
  """jc.qsgd(levels=s) quantizes to s levels per sign (and wins over bits)."""
  x = jnp.asarray(_normal(2048, seed=31).reshape(32, 64))
  every = lambda path, leaf: True  # noqa: E731

  def grid_steps(tx):
    out, _ = jax.jit(tx.update)({"w": x}, tx.init({"w": x}))
    v = np.asarray(out["w"], np.float64).reshape(-1, 512)
    amax = np.max(np.abs(np.asarray(x, np.float64).reshape(-1, 512)), axis=1, keepdims=True)
    return v / amax  # multiples of 1/s

  for levels, bits in [(16, 4), (5, 2), (127, 3)]:
    q = grid_steps(jc.qsgd(bits=bits, levels=levels, filter=every, axis_name=None))
    np.testing.assert_allclose(q * levels, np.round(q * levels), atol=1e-4)
    assert len(np.unique(np.round(np.abs(q) * levels))) > 1
  # bits alone: s = 2**(bits-1) - 1 = 7; 16 levels are not a grid of sevenths
  q = grid_steps(jc.qsgd(bits=4, filter=every, axis_name=None))
  np.testing.assert_allclose(q * 7, np.round(q * 7), atol=1e-4)
  assert np.max(np.abs(q * 16 - np.round(q * 16))) > 0.1
  # the wire: 16 levels take 5 magnitude bits and a sign
  params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  report = jc.wire_report(
    jc.qsgd(levels=16, bucket_size=512, axis_name="batch", collective="allgather"),
    params,
    axis_name="batch",
    num_devices=8,
  )
  assert report.bytes_received == 7 * (1024 * 1024 * 6 // 8 + 2048 * 4)
  for bad in (0, -3, 2**24, 1.5, True):
    with pytest.raises(ValueError):
      jc.qsgd(levels=bad, axis_name=None)


def test_qsgd_docs_table_is_the_codecs():
  """docs/methods/qsgd.md's table: each row's s, bits and wire bits per value are the
  codec's (from its payload arrays), and the bound is Lemma 3.1's min(d/s^2, sqrt(d)/s)."""
  import os  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel

  path = os.path.join(os.path.dirname(__file__), "..", "docs", "methods", "qsgd.md")
  with open(path, encoding="utf-8") as f:
    rows = re.findall(
      r"^\| `(.+?)` \| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \|$", f.read(), re.MULTILINE
    )
  assert len(rows) >= 6
  n = 2**20
  for arg, s, bits, wire, bound in rows:
    kwargs = dict(kv.split("=") for kv in arg.split(", "))
    d = int(kwargs["bucket_size"])
    levels = int(kwargs["levels"]) if "levels" in kwargs else 2 ** (int(kwargs["bits"]) - 1) - 1
    codec = C.QSGD(levels, d, "max")
    assert levels == int(s), arg
    assert codec.bits == int(bits), arg
    assert codec.wire_bits((n,)) / n == pytest.approx(float(wire), abs=1e-4), arg
    assert min(d / levels**2, math.sqrt(d) / levels) == pytest.approx(float(bound), rel=1e-3), arg
