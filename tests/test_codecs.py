"""Tests of the codecs (jaxcomp.codecs): exact properties and the papers' statistics.

Statistical tests draw M keys at once (``jax.vmap`` over keys), estimate the standard
error from the samples, and allow about 5 standard errors. Each comes with an exact
reference computed here in float64 from the papers' formulas (QSGD §3.1, 1-bit SGD §3), so that
plausible bugs (floor instead of stochastic rounding, a lost sign, a wrong scale or level
count, shared randomness) are rejected; the unbiasedness, variance and independence checks
also run on deliberately wrong quantizers (negative controls) to show that they can fail.
"""

import functools
import math

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc

C = jc.codecs
F32_EPS = float(np.finfo(np.float32).eps)


# ----------------------------------------------------------------------------- helpers


def _keys(m: int, seed: int = 0):
  """m distinct default (threefry) keys from random key data, without compiling a split."""
  data = np.random.default_rng(1000 + seed).integers(0, 2**32, size=(m, 2), dtype=np.uint32)
  return jax.random.wrap_key_data(jnp.asarray(data))


# Compilation dominates the run time on 2 cores, so the jitted functions are cached per
# codec and the tests reuse a few codecs and shapes.


@functools.cache
def _sampler(codec):
  """jit(vmap over keys) of decode(encode(x, key))."""
  return jax.jit(jax.vmap(lambda x, k: codec.decode(codec.encode(x, key=k)), in_axes=(None, 0)))


def _samples(codec, x, m: int, seed: int = 0):
  """(m, n) float64 array of decodings of x under m independent keys."""
  out = _sampler(codec)(jnp.asarray(x), _keys(m, seed))
  return np.asarray(out, np.float64).reshape(m, -1)


@functools.cache
def _round_trip_fn(codec):
  return jax.jit(lambda x, k: codec.decode(codec.encode(x, key=k)))


@functools.cache
def _encode_fn(codec):
  return jax.jit(lambda x, k: codec.encode(x, key=k))


def _round_trip(codec, x, seed: int = 0):
  return _round_trip_fn(codec)(jnp.asarray(x), jax.random.key(seed))


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


def _normal(n, seed, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(n).astype(dtype)


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


# ----------------------------------------------------------------------------- wire size


def _qsgd_bits_expected(codec, n):
  bits = math.ceil(math.log2(codec.levels + 1)) + 1
  nb = 1 if codec.bucket_size is None else -(-n // codec.bucket_size)
  # bitpack's layouts: 32 // bits codes per word when bits divides 32, else bit planes.
  words = -(-n * bits // 32) if 32 % bits == 0 else -(-n // 32) * bits
  return 32 * words + 32 * nb


def _onebit_bits_expected(codec, n):
  nb = 1 if codec.bucket_size is None else -(-n // codec.bucket_size)
  return -(-n // 32) * 32 + 64 * nb


WIRE_SHAPES = [(1,), (31,), (32,), (33,), (512,), (1000,), (1300,), (7, 300), (2, 3, 5), (64, 64)]
WIRE_CODECS = [
  C.QSGD(1),
  C.QSGD(3, 128),
  C.QSGD(7, 512, "max"),
  C.QSGD(15, 100),
  C.QSGD(127, 512),
  C.QSGD(255, 1000, "max"),
  C.OneBit(),
  C.OneBit(128),
  C.OneBit(100),
]


@pytest.mark.parametrize("codec", WIRE_CODECS, ids=str)
def test_wire_bits_formula_and_payload_bytes(codec):
  for shape in WIRE_SHAPES:
    n = math.prod(shape)
    expected = (
      _qsgd_bits_expected(codec, n)
      if isinstance(codec, C.QSGD)
      else _onebit_bits_expected(codec, n)
    )
    assert codec.wire_bits(shape) == expected, shape
  # QSGD/OneBit payloads do not depend on the input dtype
  assert codec.wire_bits((7, 300), jnp.bfloat16) == codec.wire_bits((7, 300))


def test_wire_bits_dense_codecs():
  assert C.Identity().wire_bits((1300,)) == 32 * 1300
  assert C.Identity().wire_bits((1300,), jnp.bfloat16) == 16 * 1300
  assert C.Cast(jnp.bfloat16).wire_bits((1300,)) == 16 * 1300
  assert C.Cast(jnp.float16).wire_bits((1300,)) == 16 * 1300 + 32


@hypothesis.given(
  n=st.integers(1, 5000),
  bucket=st.one_of(st.none(), st.integers(1, 700)),
  levels=st.integers(1, 300),
  norm=st.sampled_from(["l2", "max"]),
)
def test_wire_bits_property(n, bucket, levels, norm):
  q = C.QSGD(levels, bucket, norm)
  assert q.bits == math.ceil(math.log2(levels + 1)) + 1
  assert q.wire_bits((n,)) == _qsgd_bits_expected(q, n)
  o = C.OneBit(bucket)
  assert o.wire_bits((n,)) == _onebit_bits_expected(o, n)


@pytest.mark.parametrize(
  "codec, n",
  [
    (C.QSGD(7, 512, "max"), 1300),
    (C.QSGD(3, 100), 250),
    (C.OneBit(100), 777),
    (C.OneBit(), 777),
    (C.OneBit(per_column=True), 777),
    (C.ScaledSign(100), 777),
    (C.Cast(jnp.float16), 777),
    (C.Identity(), 777),
  ],
  ids=str,
)
def test_payload_shapes_do_not_depend_on_data(codec, n):
  datas = [
    _normal(n, seed=9),
    np.zeros(n, np.float32),
    np.full(n, 1e30, np.float32),
    np.where(np.arange(n) % 3 == 0, np.nan, 1.0).astype(np.float32),
    np.where(np.arange(n) < 100, -np.inf, 0.0).astype(np.float32),
  ]
  enc = _encode_fn(codec)
  payloads = [enc(jnp.asarray(d), jax.random.key(i)) for i, d in enumerate(datas)]
  for p in payloads:
    chex.assert_trees_all_equal_shapes_and_dtypes(payloads[0], p)
    assert p.shape == (n,) and p.dtype == jnp.float32
    # wire_bits is what a real payload weighs
    assert codec.wire_bits((n,)) == 8 * p.nbytes == 8 * C.payload_nbytes(p)


# ----------------------------------------------------------------------------- dtypes, jit, vmap

DTYPE_CODECS = [
  C.Identity(),
  C.Cast(jnp.bfloat16),
  C.Cast(jnp.float16),
  C.QSGD(3),
  C.QSGD(7, 64, "max"),
  C.OneBit(),
  C.OneBit(64),
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("codec", DTYPE_CODECS, ids=str)
def test_decode_shape_and_dtype(codec, dtype):
  """decode returns the encoded shape and dtype (abstract evaluation: no compilation)."""
  shape = (5, 30)

  def round_trip(x, out_dtype=None):
    return codec.decode(codec.encode(x, key=jax.random.key(0)), out_dtype)

  spec = jax.ShapeDtypeStruct(shape, dtype)
  out = jax.eval_shape(round_trip, spec)
  assert out.shape == shape and out.dtype == dtype
  out = jax.eval_shape(lambda x: round_trip(x, jnp.float32), spec)
  assert out.shape == shape and out.dtype == jnp.float32
  stacked = jax.eval_shape(
    jax.vmap(lambda x, k: codec.encode(x, key=k)),
    jax.ShapeDtypeStruct((3, *shape), dtype),
    jax.eval_shape(lambda: _keys(3)),
  )
  out = jax.eval_shape(jax.vmap(codec.decode), stacked)
  assert out.shape == (3, *shape) and out.dtype == dtype


@pytest.mark.parametrize(
  "codec, dtype",
  [
    (C.Identity(), jnp.float32),
    (C.Cast(jnp.float16), jnp.bfloat16),
    (C.QSGD(7, 64, "max"), jnp.bfloat16),
    (C.OneBit(64), jnp.float16),
    (C.OneBit(per_column=True), jnp.bfloat16),
    (C.ScaledSign(64), jnp.float16),
  ],
  ids=str,
)
def test_jit_vmap_on_stacked_payload_equals_per_payload(codec, dtype):
  """Under jit: encode several (vmap), decode the stacked payload (vmap) == one by one.

  Also: a low-precision input decodes to its float32 decoding rounded to its dtype.
  """
  k, shape = 3, (5, 30)  # 150 values: not a multiple of 32 nor of the bucket
  xs = jnp.asarray(_normal(k * 150, seed=11).reshape(k, *shape).astype(dtype))

  @jax.jit
  def run(xs, keys):
    stacked = jax.vmap(lambda x, key: codec.encode(x, key=key))(xs, keys)
    singles = [codec.encode(xs[i], key=keys[i]) for i in range(k)]
    return (
      stacked,
      jax.vmap(codec.decode)(stacked),
      singles,
      [codec.decode(p) for p in singles],
      [codec.decode(p, jnp.float32) for p in singles],
    )

  # (compared in numpy: eager indexing of jax arrays would compile more)
  stacked, decoded, singles, single_decoded, single_f32 = jax.tree.map(
    np.asarray, run(xs, _keys(k, seed=12))
  )
  assert decoded.shape == (k, *shape) and decoded.dtype == dtype
  for i in range(k):
    assert singles[i].arrays.keys() == stacked.arrays.keys()
    for name, a in singles[i].arrays.items():
      assert a.dtype == stacked.arrays[name].dtype
      np.testing.assert_array_equal(a, stacked.arrays[name][i], err_msg=name)
    assert single_decoded[i].shape == shape and single_decoded[i].dtype == dtype
    np.testing.assert_array_equal(
      single_decoded[i].astype(np.float32), decoded[i].astype(np.float32)
    )
    assert single_f32[i].dtype == np.float32
    np.testing.assert_array_equal(
      single_decoded[i].astype(np.float32), single_f32[i].astype(dtype).astype(np.float32)
    )
    x64 = np.asarray(xs[i], np.float64)
    err = np.abs(single_f32[i].astype(np.float64) - x64)
    amax = float(np.max(np.abs(x64)))
    if isinstance(codec, C.QSGD):
      assert np.all(err <= amax / codec.levels * (1 + 1e-6))
    elif isinstance(codec, (C.Identity, C.Cast)):
      assert np.all(err <= 2.0**-8 * np.abs(x64))


def test_degenerate_shapes():
  codecs = [
    C.QSGD(3),
    C.QSGD(3, 4, "max"),
    C.OneBit(),
    C.OneBit(4),
    C.Identity(),
    C.Cast(jnp.float16),
  ]
  shapes = [(), (1,), (0,), (3, 0)]

  @jax.jit  # one compilation for all of them
  def run(key):
    return {
      (str(c), s): c.decode(c.encode(jnp.full(s, -0.75, jnp.float32), key=key))
      for c in codecs
      for s in shapes
    }

  for (name, shape), out in run(jax.random.key(0)).items():
    chex.assert_shape(out, shape)
    # a single value is its own bucket: every codec sends it exactly
    np.testing.assert_array_equal(
      np.asarray(out), np.full(shape, -0.75, np.float32), err_msg=f"{name} {shape}"
    )


@pytest.mark.parametrize(
  "codec", [C.QSGD(3), C.OneBit(), C.Identity(), C.Cast(jnp.bfloat16), C.Cast(jnp.float16)], ids=str
)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32, jnp.bool_])
def test_non_float_input_raises_type_error(codec, dtype):
  x = jnp.zeros((10,), dtype)
  with pytest.raises(TypeError):
    codec.encode(x, key=jax.random.key(0))


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


@pytest.mark.parametrize("bucket_size", [0, -1, True, 2.5])
def test_onebit_bad_arguments_raise(bucket_size):
  with pytest.raises(ValueError):
    C.OneBit(bucket_size)


def test_cast_to_non_float_raises():
  with pytest.raises(TypeError):
    C.Cast(jnp.int32)


def test_qsgd_needs_a_key():
  codec = C.QSGD(3)
  assert codec.needs_key and not C.OneBit().needs_key
  with pytest.raises(ValueError, match="key"):
    codec.encode(jnp.ones((10,), jnp.float32))


def test_codecs_are_hashable_static_arguments():
  codecs = [
    C.QSGD(3, 64, "max"),
    C.OneBit(32),
    C.Cast(jnp.float16),
    C.Identity(),
    C.OneBit(per_column=True),
    C.ScaledSign(64),
  ]
  assert (
    len(
      {
        *codecs,
        C.QSGD(3, 64, "max"),
        C.OneBit(32),
        C.Cast(np.float16),
        C.OneBit(per_column=True),
        C.ScaledSign(64),
      }
    )
    == 6
  )
  assert C.Cast(jnp.float16) == C.Cast(np.float16)
  assert C.QSGD(3, 64, "max") != C.QSGD(3, 64, "l2")
  f = jax.jit(lambda x, codec: x * codec.wire_bits(x.shape), static_argnums=1)
  for codec in codecs:
    assert float(f(jnp.ones((), jnp.float32), codec)) == codec.wire_bits(())


# ----------------------------------------------------------------------------- OneBit


def _onebit_reference(x, bucket_size):
  """float64 per-value (pos_mean, neg_mean) of each value's bucket."""
  x = np.asarray(x, np.float64).reshape(-1)
  n = x.size
  b = n if bucket_size is None else min(bucket_size, n)
  pos = np.zeros(n)
  neg = np.zeros(n)
  for start in range(0, n, b):
    v = x[start : start + b]
    pos[start : start + b] = v[v >= 0].mean() if np.any(v >= 0) else 0.0
    neg[start : start + b] = v[v < 0].mean() if np.any(v < 0) else 0.0
  return pos, neg


@hypothesis.settings(max_examples=12)  # each example compiles (~0.3 s on 2 cores)
@hypothesis.given(
  n=st.integers(1, 600),
  bucket=st.one_of(st.none(), st.integers(1, 200)),
  seed=st.integers(0, 2**31 - 1),
  zero_frac=st.sampled_from([0.0, 0.1, 0.5]),
  offset=st.sampled_from([0.0, 1.5, -1.5]),
)
def test_onebit_properties(n, bucket, seed, zero_frac, offset):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3) + offset
  x[rng.random(n) < zero_frac] = 0.0
  x = x.astype(np.float32)
  codec = C.OneBit(bucket)
  out = np.asarray(_round_trip(codec, x), np.float64)
  x64 = x.astype(np.float64)
  b = n if bucket is None else min(bucket, n)
  for start in range(0, n, b):  # including a last partial bucket
    xb, ob = x64[start : start + b], out[start : start + b]
    # the bucket sum is preserved
    assert abs(ob.sum() - xb.sum()) <= 1e-5 * np.abs(xb).sum() + 1e-30
    # at most two values per bucket
    assert len(np.unique(ob)) <= 2
  pos, neg = _onebit_reference(x64, bucket)
  np.testing.assert_allclose(out, np.where(x64 < 0, neg, pos), rtol=2e-6, atol=0)
  # signs: x < 0 -> negative; x >= 0 (zeros included) -> non-negative
  assert np.all(out[x64 < 0] < 0)
  assert np.all(out[x64 >= 0] >= 0)


@pytest.mark.parametrize("bucket", [32, 64, 1024, None, 96, 100])
@pytest.mark.parametrize("n", [1000, 2048 + 7, 4096])
def test_onebit_word_aligned_buckets(bucket, n):
  # Buckets of whole sign words (32 | bucket) take the two-level sums and count the
  # negatives by popcount; the others one reduction. Both must give the reference means,
  # also where one sign dominates a bucket (no cancellation), with a ragged last
  # bucket, and with -0.0 (not negative) in it.
  rng = np.random.default_rng(n + (bucket or 0))
  x = rng.standard_normal(n).astype(np.float32)
  x[:300] = -np.abs(x[:300]) - 1000.0  # all negative but one tiny positive value
  x[17] = 1e-6
  x[300:600] = np.abs(x[300:600])  # all non-negative, with zeros and -0.0
  x[310:320] = 0.0
  x[320:330] = -0.0
  out = np.asarray(_round_trip(C.OneBit(bucket), x), np.float64)
  pos, neg = _onebit_reference(x, bucket)
  want = np.where(x < 0, neg, pos)
  np.testing.assert_allclose(out, want, rtol=2e-6, atol=0)
  assert out[17] > 0 and np.all(out[320:330] >= 0)


def test_onebit_sums_two_levels_match_one_reduction():
  # The two paths of OneBit's bucket statistics on the same word-aligned buckets: equal
  # counts, sums equal up to the order of the float32 additions.
  from jaxcomp._src.plumbing import arith  # pylint: disable=import-outside-toplevel
  from jaxcomp._src.plumbing import bitpack  # pylint: disable=import-outside-toplevel

  x = _normal(64 * 40 - 13, seed=21) + np.float32(0.2)  # a ragged last bucket of 64
  v = jnp.pad(jnp.asarray(x), (0, 13)).reshape(40, 64)
  words = bitpack.pack_bits(jnp.asarray(x < 0).astype(jnp.uint32), 1)
  one = arith.onebit_sums(v, words, two_level=False)  # pylint: disable=protected-access
  two = arith.onebit_sums(v, words, two_level=True)  # pylint: disable=protected-access
  np.testing.assert_array_equal(one[2], two[2])
  np.testing.assert_array_equal(two[2], np.pad(x < 0, (0, 13)).reshape(40, 64).sum(1))
  for a, b in zip(one[:2], two[:2]):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="whole words"):
    arith.onebit_sums(v[:, :48], words, two_level=True)  # pylint: disable=protected-access


def test_onebit_partial_bucket_and_whole_tensor():
  x = _normal(1000, seed=15) + np.float32(0.3)  # 1000 = 7 * 128 + 104
  for bucket in (128, None):
    out = np.asarray(_round_trip(C.OneBit(bucket), x), np.float64)
    pos, neg = _onebit_reference(x, bucket)
    np.testing.assert_allclose(out, np.where(x < 0, neg, pos), rtol=2e-6)
  tail = slice(896, 1000)
  out = np.asarray(_round_trip(C.OneBit(128), x), np.float64)
  np.testing.assert_allclose(out[tail].sum(), x[tail].astype(np.float64).sum(), rtol=1e-5)


def test_onebit_zeros_and_determinism():
  codec = C.OneBit(64)
  np.testing.assert_array_equal(np.asarray(_round_trip(codec, np.zeros(200, np.float32))), 0)
  # all-non-negative bucket with zeros: the zeros join the non-negative group
  x = np.array([0.0, 0.0, 3.0, 1.0], np.float32)
  np.testing.assert_allclose(np.asarray(_round_trip(C.OneBit(), x)), [1.0] * 4)
  # deterministic: no key needed, a key changes nothing
  y = jnp.asarray(_normal(300, seed=16))
  enc = jax.jit(lambda y, key=None: codec.encode(y, key=key))
  no_key = enc(y)
  chex.assert_trees_all_equal(no_key, enc(y, jax.random.key(5)))
  chex.assert_trees_all_equal(no_key, enc(y))


# ----------------------------------------------------------------------------- Identity, Cast


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_identity_exact(dtype):
  x = jnp.asarray(
    np.array([0.0, -0.0, 1.5, -3.25e3, np.inf, -np.inf, np.nan, 1e-3], np.float32).astype(dtype)
  )
  out = _round_trip(C.Identity(), x)
  chex.assert_type(out, dtype)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(x, np.float32))
  assert np.signbit(np.asarray(out, np.float32)[1])


def test_cast_bfloat16_relative_error():
  rng = np.random.default_rng(17)
  x = (rng.standard_normal(4000) * 10.0 ** rng.uniform(-30, 30, 4000)).astype(np.float32)
  out = np.asarray(_round_trip(C.Cast(jnp.bfloat16), x), np.float64)
  x64 = x.astype(np.float64)
  assert np.all(np.abs(out - x64) <= 2.0**-8 * np.abs(x64))
  assert np.any(out != x64)  # it did round


@pytest.mark.parametrize("magnitude", [1.0, 1e6, 1e-8, 3e30, 1e-30])
def test_cast_float16_scaled_relative_error(magnitude):
  rng = np.random.default_rng(18)
  x = (rng.standard_normal(2000) * magnitude).astype(np.float32)
  out = np.asarray(_round_trip(C.Cast(jnp.float16), x), np.float64)
  x64 = x.astype(np.float64)
  amax = np.max(np.abs(x64))
  assert np.all(np.abs(out - x64) <= 2.0**-11 * amax)
  # relative to each value: fp16's 11-bit significand, down to its subnormal range
  assert np.all(np.abs(out - x64) <= 2.0**-11 * np.abs(x64) + 2.0**-24 * amax)
  if magnitude == 1e6:  # a plain fp16 cast would overflow
    with np.errstate(over="ignore"):
      assert np.any(np.isinf(x.astype(np.float16)))
  if magnitude == 1e-8:  # a plain fp16 cast would lose most of the precision
    plain = x.astype(np.float16).astype(np.float64)
    assert np.max(np.abs(plain - x64)) > 2.0**-5 * amax


@pytest.mark.parametrize(
  "codec", [C.Identity(), C.Cast(jnp.bfloat16), C.Cast(jnp.float16)], ids=str
)
def test_cast_nan_and_inf_propagate(codec):
  x = _normal(100, seed=19)
  x[5], x[40] = np.nan, np.inf
  out = np.asarray(_round_trip(codec, x), np.float64)
  assert np.isnan(out[5]) and out[40] == np.inf
  x[40] = 1.0
  out = np.asarray(_round_trip(codec, x), np.float64)
  assert np.isnan(out[5])


# ----------------------------------------------------------------------------- decode_sum


@pytest.mark.parametrize(
  "codec", [C.Identity(), C.QSGD(7, 128, "max"), C.OneBit(64), C.ScaledSign(64)], ids=str
)
def test_decode_sum_equals_sum_of_decodes(codec):
  k, n = 5, 300
  xs = _normal(k * n, seed=20).reshape(k, n) * (10.0 ** np.arange(k, dtype=np.float32))[:, None]
  xs = jnp.asarray(xs)

  @jax.jit
  def run(xs, keys):
    stacked = jax.vmap(lambda x, key: codec.encode(x, key=key))(xs, keys)
    each = jax.vmap(lambda p: codec.decode(p, jnp.float32))(stacked)
    first = jax.tree.map(lambda a: a[:1], stacked)
    return codec.decode_sum(stacked), each, codec.decode_sum(first)

  total, each, first = run(xs, _keys(k, seed=21))
  chex.assert_shape(total, (n,))
  chex.assert_type(total, jnp.float32)
  each = np.asarray(each)
  np.testing.assert_allclose(
    np.asarray(total),
    each.astype(np.float64).sum(axis=0),
    rtol=1e-5,
    atol=1e-6 * float(np.abs(each).max()),
  )
  np.testing.assert_array_equal(np.asarray(first), each[0])  # K = 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_sum_identity_is_sequential_float32_addition(dtype):
  k, n = 8, 4096
  rng = np.random.default_rng(22)
  xs = (rng.standard_normal((k, n)) * 10.0 ** rng.uniform(-4, 4, (k, 1))).astype(np.float32)
  xs_in = xs.astype(dtype)
  xs = xs_in.astype(np.float32)
  total = np.asarray(
    jax.jit(lambda xs: C.Identity().decode_sum(jax.vmap(C.Identity().encode)(xs)))(
      jnp.asarray(xs_in)
    )
  )
  acc = xs[0].copy()
  for i in range(1, k):
    acc = (acc + xs[i]).astype(np.float32)
  np.testing.assert_array_equal(total, acc)
  # The order matters for these values, so the equality above is not vacuous.
  rev = xs[-1].copy()
  for i in range(k - 2, -1, -1):
    rev = (rev + xs[i]).astype(np.float32)
  assert np.any(rev != acc)


# ----------------------------------------------------------------------------- non-finite

NONFINITE_CODECS = [
  C.QSGD(2, 64),
  C.QSGD(7, 64, "max"),
  C.OneBit(64),
  C.OneBit(),
  C.OneBit(per_column=True),
  C.ScaledSign(64),
]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=str)
@pytest.mark.parametrize("codec", NONFINITE_CODECS, ids=str)
def test_non_finite_input_is_never_hidden(codec, bad):
  n, idx = 256, 70
  x = _normal(n, seed=23)
  x[idx] = bad
  out = np.asarray(_round_trip(codec, x, seed=1), np.float64)
  b = n if codec.bucket_size is None else codec.bucket_size
  bucket = slice(idx // b * b, idx // b * b + b)
  assert not np.isfinite(out[idx])
  if np.isnan(bad):
    assert np.isnan(out[idx])
  if isinstance(codec, (C.QSGD, C.ScaledSign)):
    # the bucket's scale carries the NaN/Inf: the whole bucket is non-finite
    assert not np.any(np.isfinite(out[bucket]))
  else:
    # the value's group (its sign group in its bucket) is non-finite
    same_group = (x[bucket] < 0) == (x[idx] < 0)
    assert not np.any(np.isfinite(out[bucket][same_group]))


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


def test_cast_float16_tiny_max_is_finite():
  """max|x| below 2**-113: the fp16 pre-scale must not overflow float32 to inf."""
  x = np.array([1e-36, -5e-37, 0.0, 3e-37], np.float32)
  out = np.asarray(_round_trip(C.Cast(jnp.float16), x), np.float64)
  assert np.all(np.isfinite(out))
  x64 = x.astype(np.float64)
  assert np.all(np.abs(out - x64) <= 2.0**-11 * np.abs(x64))


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
    q = grid_steps(jc.qsgd(bits=bits, levels=levels, filter=every))
    np.testing.assert_allclose(q * levels, np.round(q * levels), atol=1e-4)
    assert len(np.unique(np.round(np.abs(q) * levels))) > 1
  # bits alone: s = 2**(bits-1) - 1 = 7; 16 levels are not a grid of sevenths
  q = grid_steps(jc.qsgd(bits=4, filter=every))
  np.testing.assert_allclose(q * 7, np.round(q * 7), atol=1e-4)
  assert np.max(np.abs(q * 16 - np.round(q * 16))) > 0.1
  # the wire: 16 levels take 5 magnitude bits and a sign
  params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  report = jc.wire_report(
    jc.qsgd(levels=16, bucket_size=512, axis_name="batch"), params, axis_name="batch", num_devices=8
  )
  assert report.bytes_received == 7 * (1024 * 1024 * 6 // 8 + 2048 * 4)
  for bad in (0, -3, 2**24, 1.5, True):
    with pytest.raises(ValueError):
      jc.qsgd(levels=bad)


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
