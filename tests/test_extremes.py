"""Finite in, finite out: codecs at magnitudes up to FLT_MAX, on every implementation.

Large gradients are rare but real (a loss spike, an unnormalised layer). A finite input
must decode to a finite value close to it wherever float32 can hold the result; where
it cannot (an l2 norm or an unbiased estimate beyond FLT_MAX) the payload is flagged
non-finite, never silently wrong.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp._src.codecs import normal
from jaxcomp._src.plumbing import arith

C = jc.codecs
FLT_MAX = float(np.finfo(np.float32).max)
MAGNITUDES = [1e19, 1e30, 1e36, 1e37, 1e38, FLT_MAX]
IMPLS = ["xla", "native", "pallas"]


def _data(mag: float, n: int = 2048, seed: int = 0) -> np.ndarray:
  """Mixed signs, the largest |value| exactly ``mag`` (every bucket near it)."""
  x = np.random.default_rng(seed).standard_normal(n)
  x = x / np.abs(x).max() * mag
  x[::512] = mag  # each bucket of 512 reaches the magnitude
  return np.clip(x, -FLT_MAX, FLT_MAX).astype(np.float32)


def _f64(a) -> np.ndarray:
  return np.asarray(a, np.float64)


@pytest.mark.parametrize("mag", MAGNITUDES)
@pytest.mark.parametrize("impl", IMPLS)
def test_onebit_means_of_large_values(impl, mag):
  """The means of each sign are finite at any magnitude: a bucket's plain sum overflows
  from ~1e36 (512 values), which would give ±inf means (and inf - inf = NaN in a Pallas
  residual), so kernels/arith.side_mean sums such buckets again, scaled by a power of
  two."""
  x = _data(mag)
  codec = C.OneBit(bucket_size=512, implementation=impl)
  payload = codec.encode(jnp.asarray(x))
  buckets = _f64(x).reshape(-1, 512)
  neg = buckets < 0
  want_pos = np.where(~neg, buckets, 0).sum(1) / (~neg).sum(1)
  want_neg = np.where(neg, buckets, 0).sum(1) / neg.sum(1)
  np.testing.assert_allclose(_f64(payload.arrays["pos"]), want_pos, rtol=1e-5)
  np.testing.assert_allclose(_f64(payload.arrays["neg"]), want_neg, rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(codec.decode(payload))))


@pytest.mark.parametrize("impl", IMPLS)
def test_onebit_rescue_leaves_other_buckets_bit_identical(impl):
  """One bucket overflows, the other does not: the second's means are the plain
  ``sum / count`` bits (the rescue is per bucket, and power-of-two scaling is exact)."""
  small = np.random.default_rng(1).standard_normal(512).astype(np.float32)
  x = np.concatenate([_data(1e37, 512), small])
  codec = C.OneBit(bucket_size=512, implementation=impl)
  both = codec.encode(jnp.asarray(x))
  alone = codec.encode(jnp.asarray(small))
  for side in ("pos", "neg"):
    assert np.isfinite(np.asarray(both.arrays[side])[0])
    assert np.asarray(both.arrays[side])[1] == np.asarray(alone.arrays[side])[0]


def test_onebit_side_mean_clips_and_flags():
  """side_mean: a rescued mean never rounds past FLT_MAX; a non-finite input stays
  non-finite (flagged); an empty side is 0."""
  shift = arith.sum_shift(4)
  big = np.float32(FLT_MAX)
  vals = np.full(4, big, np.float32)
  scaled = jnp.sum(jnp.asarray(vals) * np.float32(2.0**-shift))
  total = jnp.sum(jnp.asarray(vals))
  assert np.isinf(total)
  out = arith.side_mean(total, scaled, jnp.float32(4), shift)
  assert float(out) == FLT_MAX
  out = arith.side_mean(jnp.float32(np.inf), jnp.float32(np.inf), jnp.float32(4), shift)
  assert np.isinf(float(out))
  out = arith.side_mean(jnp.float32(np.nan), jnp.float32(np.nan), jnp.float32(4), shift)
  assert np.isnan(float(out))
  assert float(arith.side_mean(jnp.float32(0), jnp.float32(0), jnp.float32(0), shift)) == 0


@pytest.mark.parametrize("impl", ["native", "pallas"])
def test_onebit_fused_feedback_with_large_values(impl):
  """The fused error-feedback kernels: finite means and residuals, equal to the XLA path's
  up to float32 rounding (the sums run in different orders)."""
  x = jnp.asarray(_data(1e37))
  e = jnp.asarray(_data(1e36, seed=3))
  ref_payload, ref_res, ref_ok = C.OneBit(512, implementation="xla").encode_feedback(x, e)
  payload, res, ok = C.OneBit(512, implementation=impl).encode_feedback(x, e)
  assert bool(ok) and bool(ref_ok)
  np.testing.assert_array_equal(payload.arrays["words"], ref_payload.arrays["words"])
  for side in ("pos", "neg"):
    np.testing.assert_allclose(
      _f64(payload.arrays[side]), _f64(ref_payload.arrays[side]), rtol=1e-6
    )
  assert np.all(np.isfinite(np.asarray(res)))
  np.testing.assert_allclose(_f64(res), _f64(ref_res), rtol=1e-5, atol=1e31)


@pytest.mark.parametrize("mag", MAGNITUDES)
def test_qsgd_max_norm_payloads_agree_at_large_values(mag):
  """Max-norm QSGD holds every float32: the payload is bit-identical on all paths and the
  decode is within a level of the input, also where a bucket's plain sum overflows to
  inf - inf (values of both signs, near 1e38)."""
  x = _data(mag)
  key = jax.random.key(7)
  payloads = {
    impl: C.QSGD(7, bucket_size=512, norm="max", implementation=impl).encode(
      jnp.asarray(x), key=key
    )
    for impl in IMPLS
  }
  for impl in ("native", "pallas"):
    for name in ("words", "scales"):
      np.testing.assert_array_equal(
        payloads[impl].arrays[name], payloads["xla"].arrays[name], err_msg=f"{impl} {name}"
      )
  codec = C.QSGD(7, bucket_size=512, norm="max", implementation="xla")
  out = _f64(codec.decode(payloads["xla"]))
  scale = np.repeat(_f64(payloads["xla"].arrays["scales"]), 512)
  assert np.all(np.isfinite(out))
  assert np.all(np.abs(out - _f64(x)) <= scale / 7 * (1 + 1e-6))


@pytest.mark.parametrize("mag", [1e-30, 1e-20, 1.0, 1e19, 1e30, 1e38, FLT_MAX])
def test_normal_quantizer_at_any_magnitude(mag):
  """The decode stays within eq. (10)'s bound of every inlier at every magnitude. The
  plain (x - μ)**2 overflows once |x| passes ~1.8e19 (σ = inf, every value decoding to
  ±inf) and underflows below ~1e-19 (σ = 0), so the moments are taken on ``x · 2**-e``;
  σ >= 2**126 also gets a normal reciprocal (inverse_scale)."""
  x = _data(mag, n=4096)
  q = C.NormalQuantizer(intervals=256)
  payload, overflow = q.encode_with_info(jnp.asarray(x))
  assert not bool(overflow)
  mu, sigma = (float(v) for v in payload.arrays["stats"])
  np.testing.assert_allclose(mu, _f64(x).mean(), rtol=1e-4, atol=1e-6 * mag)
  np.testing.assert_allclose(sigma, _f64(x).std(), rtol=1e-5)
  out = _f64(q.decode(payload))
  assert np.all(np.isfinite(out))
  inlier = np.abs(_f64(x) - mu) <= 3 * sigma
  assert np.all(np.abs(out - _f64(x))[inlier] <= q.max_error * sigma * (1 + 1e-5))


@jax.jit
def _plain_normal(x, codes):
  """The formulas without scaling, as XLA compiles them (``μ + σ p`` becomes an FMA)."""
  count = jnp.float32(x.shape[0])
  mu = jnp.sum(x) / count
  sigma = jnp.sqrt(jnp.sum(jnp.square(x - mu)) / count)
  _, _, proxies = normal.intervals_table(256, 3.0)
  table = jnp.asarray(np.concatenate([proxies, -proxies]), jnp.float32)
  return mu, sigma, mu + sigma * table[codes.astype(jnp.int32)]


@jax.jit
def _scaled_normal(x, codes):
  mu, sigma = normal.moments(x)
  return mu, sigma, normal.proxy_values(codes, mu, sigma, 256, 3.0)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 37.0, 1e5, 1e12])
def test_normal_moments_match_the_plain_formula_bit_for_bit(scale):
  """Where the plain formulas neither overflow nor underflow, the scaled moments and
  proxies are their bits, each compiled in a program of its own (power-of-two scaling
  is exact and commutes with the FMA; inside a larger program XLA:CPU may order the
  sums differently, see normal.moments)."""
  x = jnp.asarray((np.random.default_rng(2).standard_t(3, 5000) * scale).astype(np.float32))
  codes = jnp.arange(256, dtype=jnp.uint32)
  for got, want in zip(_scaled_normal(x, codes), _plain_normal(x, codes)):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("divisor", [8.0, 1000.0])
@pytest.mark.parametrize("mag", [2.0**124, 2.0**127, FLT_MAX])
def test_normal_moments_of_a_mean_computed_in_the_same_program(mag, divisor):
  """``normal.moments`` compiled together with the arithmetic that produced its input (a
  sum divided by the device count, as in an exchange): XLA may fold that constant into
  the power-of-two scale, and the moments still equal those of the same values computed
  apart, to float32 rounding (never (0, 0) for a non-zero input)."""
  total = jnp.asarray(_data(mag, 384))
  got = jax.jit(lambda t: jnp.stack(normal.moments(t / divisor)))(total)
  want = jnp.stack(normal.moments(jax.jit(lambda t: t / divisor)(total)))
  assert float(got[1]) > 0
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(want[1]))


def test_normal_proxies_per_entry_match_the_plain_formula_bit_for_bit():
  """MIPD decodes with per-entry (μ, σ) (its layers' stats gathered per position): the
  plain ``μ + σ p`` bits, as compiled, wherever they are finite."""
  rng = np.random.default_rng(4)
  n = 20000
  codes = jnp.asarray(rng.integers(0, 256, n).astype(np.uint32))
  mu = jnp.asarray((rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(np.float32))
  sigma = jnp.asarray(
    (np.abs(rng.standard_normal(n)) * 10.0 ** rng.integers(-6, 6, n)).astype(np.float32)
  )
  _, _, proxies = normal.intervals_table(256, 3.0)
  table = jnp.asarray(np.concatenate([proxies, -proxies]), jnp.float32)
  plain = jax.jit(lambda c, m, s: m + s * table[c.astype(jnp.int32)])(codes, mu, sigma)
  got = jax.jit(lambda c, m, s: normal.proxy_values(c, m, s, 256, 3.0))(codes, mu, sigma)
  np.testing.assert_array_equal(got, plain)
  big = jnp.full((16,), FLT_MAX / 2, jnp.float32)
  out = normal.proxy_values(jnp.arange(16, dtype=jnp.uint32), big, big, 16, 3.0)
  assert np.all(np.isfinite(np.asarray(out))) and float(jnp.max(out)) == FLT_MAX


def test_normal_proxies_clip_to_the_float32_range():
  """An interval reaching past FLT_MAX: its proxy (μ + σ p) is clipped to ±FLT_MAX, not
  inf, while non-finite stats (a flagged tensor) stay non-finite."""
  codes = jnp.arange(16, dtype=jnp.uint32)
  out = normal.proxy_values(codes, jnp.float32(FLT_MAX / 2), jnp.float32(FLT_MAX / 2), 16, 3.0)
  assert np.all(np.isfinite(np.asarray(out))) and float(jnp.max(out)) == FLT_MAX
  out = normal.proxy_values(codes, jnp.float32(np.inf), jnp.float32(1.0), 16, 3.0)
  assert np.all(np.isinf(np.asarray(out)))


@pytest.mark.parametrize(
  "make",
  [
    lambda: C.TopK(0.1),
    lambda: C.UnbiasedSparsifier(density=0.1),
    lambda: C.ChunkedTopK(0.1, bits=2, chunk_size=64),
  ],
  ids=["topk", "wangni", "chunked_topk"],
)
def test_sparsifiers_at_large_values(make):
  x = _data(FLT_MAX)
  codec = make()
  out = np.asarray(codec.decode(codec.encode(jnp.asarray(x), key=jax.random.key(0))))
  assert np.all(np.isfinite(out))


def test_beyond_float32_is_flagged_not_hidden():
  """Where the true result exceeds FLT_MAX (an l2 norm; RandomK's unbiased n/k scaling),
  the decode is non-finite (NaN or inf), which jc.compress reports as not finite."""
  x = jnp.asarray(_data(1e38))
  l2 = C.QSGD(7, bucket_size=512, norm="l2")
  assert np.all(np.isnan(np.asarray(l2.decode(l2.encode(x, key=jax.random.key(0))))))
  rk = C.RandomK(0.1)
  out = np.asarray(rk.decode(rk.encode(x, key=jax.random.key(0))))
  assert not np.all(np.isfinite(out))


def test_qsgd_top_level_of_a_flt_max_bucket_is_finite_for_every_level_count():
  """Max-norm QSGD decodes code ``q <= s`` as ``q * fl(scale * fl(1/s))``
  (:func:`arith.level_step`). For a bucket whose max is FLT_MAX that is finite only
  if ``fl(s * fl(FLT_MAX * fl(1/s))) <= FLT_MAX``: checked in IEEE float32 for every
  level count a code of at most 16 bits holds (s = 1..32767), and through the codec
  for the code widths 2, 4, 8 and 16."""
  s = np.arange(1, 2**15, dtype=np.float32)
  step = np.float32(FLT_MAX) * (np.float32(1) / s)
  with np.errstate(over="ignore"):
    top = s * step
  assert np.all(np.isfinite(top)), s[~np.isfinite(top)][:10]
  x = np.full(64, FLT_MAX, np.float32)
  x[1::2] = -FLT_MAX
  for levels in (1, 7, 127, 32767):
    codec = C.QSGD(levels, bucket_size=64, norm="max", implementation="xla")
    out = np.asarray(codec.decode(codec.encode(jnp.asarray(x), key=jax.random.key(0))))
    assert np.all(np.isfinite(out)), levels
    np.testing.assert_allclose(_f64(out), _f64(x), rtol=1e-6)
