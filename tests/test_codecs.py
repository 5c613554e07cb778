"""Tests of the codecs (jaxcomp.codecs): the properties they share (wire size from the
payload arrays, dtypes, jit and vmap, decode_sum, non-finite inputs), and OneBit's,
Identity's and Cast's, OneBit's against a float64 reference computed here from the
paper's formulas (1-bit SGD §3). QSGD's own properties (unbiasedness, variance and
independence with negative controls, Lemma 3.1, its levels and extremes) are in
tests/test_qsgd.py.
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
def _round_trip_fn(codec):
  return jax.jit(lambda x, k: codec.decode(codec.encode(x, key=k)))


@functools.cache
def _encode_fn(codec):
  return jax.jit(lambda x, k: codec.encode(x, key=k))


def _round_trip(codec, x, seed: int = 0):
  return _round_trip_fn(codec)(jnp.asarray(x), jax.random.key(seed))


def _normal(n, seed, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(n).astype(dtype)


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
    (C.Float8(), 777),
    (C.Float8("e5m2", None, "stochastic"), 777),
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
  C.Float8(),
  C.Float8("e5m2", None, "stochastic"),
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
    C.Float8(),
    C.Float8("e5m2", None, "stochastic"),
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


@pytest.mark.parametrize("bucket_size", [0, -1, True, 2.5])
def test_onebit_bad_arguments_raise(bucket_size):
  with pytest.raises(ValueError):
    C.OneBit(bucket_size)


def test_cast_to_non_float_raises():
  with pytest.raises(TypeError):
    C.Cast(jnp.int32)


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


# -------------------------------------------------------------------------- extreme inputs
# Finite inputs decode to finite values (neither NaN nor zeros); QSGD's are in
# tests/test_qsgd.py.


def test_cast_float16_tiny_max_is_finite():
  """max|x| below 2**-113: the fp16 pre-scale must not overflow float32 to inf."""
  x = np.array([1e-36, -5e-37, 0.0, 3e-37], np.float32)
  out = np.asarray(_round_trip(C.Cast(jnp.float16), x), np.float64)
  assert np.all(np.isfinite(out))
  x64 = x.astype(np.float64)
  assert np.all(np.abs(out - x64) <= 2.0**-11 * np.abs(x64))
