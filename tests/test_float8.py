"""jc.codecs.Float8: FP8 values (E4M3, E5M2) with an E8M0 power-of-two scale per block.

The references are NumPy's: the scale exponent found by search in float64, the rounding
by ml_dtypes' float8 casts, the means over devices in float64.
"""

import math

import chex
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp._src.tools import wire
from tests import helpers

AXIS, K = helpers.AXIS, helpers.K
ALL = lambda path, leaf: True  # noqa: E731  compress every leaf
# format: (ml_dtypes type, mantissa bits, smallest normal exponent, largest finite)
FORMATS = {
  "e4m3": (ml_dtypes.float8_e4m3fn, 3, -6, 448.0),
  "e5m2": (ml_dtypes.float8_e5m2, 2, -14, 57344.0),
}
F32_EPS = float(np.finfo(np.float32).eps)


def _values(key, n, *, heavy=False):
  """Values over many magnitudes: Gaussian (or Student-t, 2 degrees of freedom) times
  per-32-block scales from 1e-4 to 1e4, so blocks hold values far below their largest."""
  kx, ks = jax.random.split(key)
  x = jax.random.t(kx, 2.0, (n,)) if heavy else jax.random.normal(kx, (n,))
  scale = jnp.repeat(jnp.exp(jax.random.uniform(ks, (-(-n // 32),), minval=-9, maxval=9)), 32)
  return np.array(x * scale[:n], np.float32)


def _ref_exponent(amax, max_finite):
  """The smallest integer e with amax <= max_finite 2^e, by search in float64 (exact)."""
  e = math.ceil(math.log2(amax / max_finite))
  while amax > max_finite * 2.0**e:
    e += 1
  while amax <= max_finite * 2.0 ** (e - 1):
    e -= 1
  return e


def _blocks(x, block):
  n = x.size
  b = n if block is None else min(block, n)
  nb = -(-n // b)
  return np.pad(x.astype(np.float64), (0, nb * b - n)).reshape(nb, b), b


def _per_value(arr, b, n):
  return np.repeat(arr, b)[:n]


def _bound(x, e, fmt, rounding):
  """The documented bound: 2^-(m+1)|x| + 2^(e + e_min - m - 1) at nearest, twice it
  stochastically."""
  _, m, emin, _ = FORMATS[fmt]
  twice = 2.0 if rounding == "stochastic" else 1.0
  return twice * (2.0 ** -(m + 1) * np.abs(x) + 2.0 ** (e + emin - m - 1))


# ----------------------------------------------------------------------------- the codec


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [32, None], ids=["block32", "tensor"])
def test_nearest_is_the_ml_dtypes_cast_of_the_scaled_values(fmt, block):
  """Scales: E8M0 bytes of the smallest exponent fitting the block's max under the
  format's largest finite value; codes: bit for bit ml_dtypes' cast of x / 2^e."""
  dtype, _, _, max_finite = FORMATS[fmt]
  x = _values(jax.random.key(0), 1000)
  x[:6] = [448.0, -57344.0, 2.0**-20, 0.0, -0.0, 1e-30]  # exact maxima, tiny values
  x[32:64] = 0.0  # an all-zero block
  # A block over 16 binades under its largest value: through the subnormals to zero.
  x[64:96] = 448.0 * 2.0 ** -np.linspace(0.0, 16.0, 32) * np.resize([1.0, -1.3], 32)
  codec = jc.codecs.Float8(fmt, block_size=block)
  p = codec.encode(jnp.asarray(x))
  assert p.arrays["codes"].dtype == p.arrays["scales"].dtype == jnp.uint8  # FP8's bytes
  v, b = _blocks(x, block)
  amax = np.max(np.abs(v), axis=1)
  e_ref = np.array([_ref_exponent(a, max_finite) if a > 0 else 0 for a in amax])
  np.testing.assert_array_equal(np.asarray(p.arrays["scales"]).astype(np.int64) - 127, e_ref)
  scaled = (x / _per_value(2.0**e_ref, b, x.size)).astype(np.float32)
  ref = scaled.astype(dtype)
  got = np.asarray(p.arrays["codes"])
  np.testing.assert_array_equal(got, ref.view(np.uint8))
  assert np.all(np.isfinite(got.view(dtype).astype(np.float32)))  # no NaN/inf code
  y = np.asarray(codec.decode(p))
  np.testing.assert_array_equal(y, ref.astype(np.float64) * _per_value(2.0**e_ref, b, x.size))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("heavy", [False, True], ids=["gauss", "student_t"])
def test_error_within_half_an_ulp_nearest_one_ulp_stochastic(fmt, rounding, heavy):
  """Every value within the documented bound of its block's scale, and the bound is
  attained (errors above 40% of it occur)."""
  x = _values(jax.random.key(1), 4096, heavy=heavy)
  codec = jc.codecs.Float8(fmt, rounding=rounding)
  p = codec.encode(jnp.asarray(x), key=jax.random.key(2))
  y = np.asarray(codec.decode(p), np.float64)
  e = _per_value(np.asarray(p.arrays["scales"]).astype(np.float64) - 127, 32, x.size)
  bound = _bound(x, e, fmt, rounding)
  err = np.abs(y - x)
  assert np.all(err <= bound), np.max(err / bound)
  assert np.max(err / bound) > 0.4


def test_bfloat16_in_and_out():
  """bfloat16 values come back bfloat16, within the bound plus bfloat16's rounding of the
  float32 decode (an E4M3 value has 4 significant bits: bfloat16 holds it exactly)."""
  x = jnp.asarray(_values(jax.random.key(3), 1000)).astype(jnp.bfloat16)
  codec = jc.codecs.Float8()
  p = codec.encode(x)
  y = codec.decode(p)
  assert y.dtype == jnp.bfloat16
  chex.assert_trees_all_equal(y, codec.decode(p, jnp.float32).astype(jnp.bfloat16))
  x64 = np.asarray(x.astype(jnp.float32), np.float64)
  e = _per_value(np.asarray(p.arrays["scales"]).astype(np.float64) - 127, 32, 1000)
  err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - x64)
  assert np.all(err <= _bound(x64, e, "e4m3", "nearest"))


def test_stochastic_rounding_is_unbiased():
  """The mean of 4000 decodes (independent keys) of each value is the value, within 5
  standard errors of a two-point draw (at most ulp/2 / sqrt(N)); each decode is one of
  the value's two FP8 neighbours. The negative control: nearest rounding misses that
  tolerance for most values."""
  n_draws = 4000
  base = _values(jax.random.key(4), 256)
  x = jnp.asarray(base.reshape(8, 32) / np.abs(base.reshape(8, 32)).max(1, keepdims=True))
  x = x.reshape(-1) * 100.0  # blocks of max 100: e = -2 in E4M3, values over 2^-9..2^7
  # E4M3's subnormals at this scale: under 2^-6 / 4; the smallest is 2^-9 / 4.
  x = x.at[1:6].set(jnp.array([0.003, -0.0011, 0.0007, 2.0**-12, -0.00013]))
  codec = jc.codecs.Float8("e4m3", rounding="stochastic")
  keys = jax.random.split(jax.random.key(5), n_draws)
  draws = np.asarray(jax.jit(jax.vmap(lambda k: codec.decode(codec.encode(x, key=k))))(keys))
  x64 = np.asarray(x, np.float64)
  scaled = x64 * 4.0  # 2^-e
  ulp = 2.0 ** (np.maximum(np.floor(np.log2(np.abs(scaled))), -6) - 3) / 4.0
  lo = np.floor(x64 / ulp) * ulp
  assert np.all((np.abs(draws - lo) < 1e-12) | (np.abs(draws - (lo + ulp)) < 1e-12))
  tol = 5 * (ulp / 2) / np.sqrt(n_draws) + 2.0**-24 * ulp
  assert np.all(np.abs(draws.mean(0) - x64) <= tol), np.max(np.abs(draws.mean(0) - x64) / tol)
  nearest = jc.codecs.Float8("e4m3")
  y = np.asarray(nearest.decode(nearest.encode(x)), np.float64)
  assert np.mean(np.abs(y - x64) > tol) > 0.5
  # The same key, the same bits; a fresh key, other bits.
  chex.assert_trees_all_equal(codec.encode(x, key=keys[0]), codec.encode(x, key=keys[0]))
  assert np.any(draws[0] != draws[1])


def test_non_finite_zeros_and_bad_input():
  codec = jc.codecs.Float8()
  x = jnp.asarray(_values(jax.random.key(6), 100))
  y = codec.decode(codec.encode(x))
  for bad in (jnp.inf, -jnp.inf, jnp.nan):  # its block decodes to NaN, the others intact
    out = codec.decode(codec.encode(x.at[40].set(bad)))
    assert bool(jnp.all(jnp.isnan(out[32:64]))), bad
    chex.assert_trees_all_equal(out[:32], y[:32])
    chex.assert_trees_all_equal(out[64:], y[64:])
  z = codec.decode(codec.encode(jnp.zeros((70,), jnp.bfloat16)))
  assert z.dtype == jnp.bfloat16 and not bool(jnp.any(z))
  big = jnp.full((33,), jnp.finfo(jnp.float32).max)  # the largest floats: no overflow
  chex.assert_trees_all_equal(codec.decode(codec.encode(big)), big)
  with pytest.raises(ValueError, match="format"):
    jc.codecs.Float8("e3m4")
  with pytest.raises(ValueError, match="rounding"):
    jc.codecs.Float8(rounding="up")
  with pytest.raises(ValueError, match="block_size"):
    jc.codecs.Float8(block_size=0)
  with pytest.raises(TypeError, match="floating-point"):
    codec.encode(jnp.arange(4))
  with pytest.raises(ValueError, match="key"):
    jc.codecs.Float8(rounding="stochastic").encode(x)
  assert not codec.needs_key and jc.codecs.Float8(rounding="stochastic").needs_key


@pytest.mark.parametrize("block", [32, None], ids=["block32", "tensor"])
def test_payload_bytes_and_wire_report(block):
  """n one-byte codes and one scale byte per block: 8.25 bits a value with blocks of 32
  (a ragged tail padded to its block), read off the traced collective by wire_report."""
  codec = jc.codecs.Float8(block_size=block)
  n = 1000
  blocks = 1 if block is None else -(-n // 32)
  assert codec.encode(jnp.ones((n,))).nbytes == n + blocks
  assert codec.wire_bits((n,)) == 8 * (n + blocks)
  params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  big = 1024 * 1024
  report = jc.wire_report(
    jc.compress(codec, axis_name=AXIS, collective="allgather"),
    params,
    axis_name=AXIS,
    num_devices=K,
  )
  per_device = big + (1 if block is None else big // 32)
  assert report.bytes_received == (K - 1) * per_device
  if block == 32:
    assert 8 * per_device / big == 8.25


# ----------------------------------------------------------------------------- gradients


def _mean_bound(grads, fmt, rounding, twice):
  """Per value: the bound of one quantization, averaged over the K devices, with the
  subnormal term taken at the largest block scale any device can have (that of the
  largest value); ``twice``: plus the bound of re-quantizing the average (two-phase)."""
  _, _, _, max_finite = FORMATS[fmt]
  g = np.asarray(grads, np.float64)
  amax = float(np.max(np.abs(g)))
  e = _ref_exponent(amax, max_finite)
  first = np.mean(_bound(g, e, fmt, rounding), axis=0)
  sum_rounding = K * F32_EPS * amax
  if not twice:
    return first + sum_rounding
  a = np.abs(g.mean(0)) + first
  e2 = _ref_exponent(amax * 1.25, max_finite)
  return first + _bound(a, e2, fmt, rounding) + 2 * sum_rounding


def _shard_map_mean(tx, grads):
  """One update of ``tx`` inside shard_map (check_vma on); the mean on every device."""
  m = helpers.mesh()
  tx = jc.per_device_state(tx)
  params = {"w": jnp.zeros(grads.shape[1:], grads.dtype)}
  state = helpers.shard_map_init(tx, params, m)
  out, _ = helpers.shard_map_update(tx, m, params)(helpers.shard({"w": grads}, m), state)
  return out["w"]


@pytest.mark.parametrize("collective", ["allgather", "two_phase", "auto"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_compress_every_collective_within_the_bound(collective, rounding):
  """jc.compress(Float8) under shard_map: the float64 mean within the codec's bound
  (twice over for the two-phase exchange, which quantizes the average again)."""
  g = jnp.asarray(_values(jax.random.key(7), K * 40 * 24).reshape(K, 40, 24))
  codec = jc.codecs.Float8(rounding=rounding)
  tx = jc.compress(codec, axis_name=AXIS, collective=collective, filter=ALL)
  out = np.asarray(_shard_map_mean(tx, g), np.float64)
  ref = np.asarray(g, np.float64).mean(0)
  bound = _mean_bound(g, "e4m3", rounding, twice=collective != "allgather")
  assert np.all(np.abs(out - ref) <= bound), np.max(np.abs(out - ref) / bound)
  assert np.max(np.abs(out - ref)) > 0  # it is quantized


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_reduce_scatter_within_the_bound(fmt, dtype):
  """collective="reduce_scatter" (FSDP/ZeRO shards): each device's shard of the mean,
  one quantization of each device's row, within the bound (plus bfloat16's rounding of
  the result for bfloat16 gradients)."""
  g = jnp.asarray(_values(jax.random.key(8), K * 64 * 24).reshape(K, 64, 24)).astype(dtype)
  codec = jc.codecs.Float8(fmt, rounding="stochastic")
  tx = jc.compress(codec, axis_name=AXIS, collective="reduce_scatter", filter=ALL)
  m = helpers.mesh()
  spec = {"w": P(AXIS)}
  shards = jax.device_put({"w": jnp.zeros((64, 24), dtype)}, jax.NamedSharding(m, P(AXIS)))
  wrapped = jc.per_device_state(tx)

  def step(p, grads):
    out, _ = wrapped.update({"w": grads[0]}, wrapped.init(p), p)
    return out

  f = jax.jit(jax.shard_map(step, mesh=m, in_specs=(spec, P(AXIS)), out_specs=spec))
  out = f(shards, helpers.shard(g, m))["w"]
  assert out.dtype == dtype and out.shape == (64, 24)
  g64 = np.asarray(g.astype(jnp.float32), np.float64)
  ref = g64.mean(0)
  bound = _mean_bound(g64, fmt, "stochastic", twice=False)
  if dtype == jnp.bfloat16:
    bound = bound + 2.0**-8 * (np.abs(ref) + bound)
  err = np.abs(np.asarray(out.astype(jnp.float32), np.float64) - ref)
  assert np.all(err <= bound), np.max(err / bound)


def test_pmap_and_psum_refused():
  """Under jax.pmap the all-gather gives every device the same mean, within the bound;
  collective="psum" is refused (FP8 payloads with their own scales do not add up)."""
  g = jnp.asarray(_values(jax.random.key(9), K * 256).reshape(K, 256))
  tx = jc.compress(jc.codecs.Float8(), axis_name=AXIS, collective="allgather", filter=ALL)
  params = {"w": jnp.zeros((256,))}
  state = jax.pmap(lambda _: tx.init(params), axis_name=AXIS)(jnp.arange(K))
  out, _ = jax.pmap(tx.update, axis_name=AXIS)({"w": g}, state)
  out = np.asarray(out["w"], np.float64)
  assert np.all(out == out[0])
  ref = np.asarray(g, np.float64).mean(0)
  assert np.all(np.abs(out[0] - ref) <= _mean_bound(g, "e4m3", "nearest", twice=False))
  with pytest.raises(ValueError, match="psum"):
    jc.compress(jc.codecs.Float8(), axis_name=AXIS, collective="psum")


# ----------------------------------------------------------------------------- weights


def _gathered(codec, full):
  """Each device's gather_weights of its shard of ``full`` (one array), stacked (K, ...)."""

  def f(shard):
    return jc.gather_weights({"w": shard}, axis_name=AXIS, codec=codec, filter=ALL)["w"][None]

  m = helpers.mesh()
  g = jax.jit(jax.shard_map(f, mesh=m, in_specs=P(AXIS), out_specs=P(AXIS)))
  return np.asarray(g(jax.device_put(full, jax.NamedSharding(m, P(AXIS)))))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_weight_gather_within_the_bound_and_its_bytes(fmt):
  """gather_weights(codec=Float8): every device the same weights, each within half an
  ulp of its block (blocks restart at each shard); the all_gather's operand is the codes
  and scales: n + n/32 bytes per shard, against BlockInt8's n + 4 n/256 (blocks of 256)
  and n + 4 n/32 (blocks of 32)."""
  full = jnp.asarray(_values(jax.random.key(10), 64 * 48).reshape(64, 48))
  codec = jc.codecs.Float8(fmt)
  got = _gathered(codec, full)
  assert np.all(got == got[0])
  x = np.asarray(full, np.float64).reshape(K, -1)  # each device's shard, flat
  amax = np.abs(x).reshape(K, -1, 32).max(2)
  e = np.vectorize(lambda a: _ref_exponent(a, FORMATS[fmt][3]))(amax)
  bound = _bound(x, np.repeat(e, 32, axis=1), fmt, "nearest")
  err = np.abs(got[0].reshape(K, -1) - x)
  assert np.all(err <= bound) and np.max(err / bound) > 0.4

  def operand_bytes(c):
    shard = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    ops = wire.collective_ops(
      lambda s: jc.gather_weights(s, axis_name=AXIS, codec=c), shard, axis_name=AXIS, num_devices=K
    )
    assert [wire.canonical(op.primitive) for op in ops] == ["all_gather"]
    return ops[0].operand_bytes

  n = 16 * 64
  assert operand_bytes(codec) == n + n // 32
  assert operand_bytes(jc.codecs.BlockInt8(256)) == n + 4 * n // 256
  assert operand_bytes(jc.codecs.BlockInt8(32)) == n + 4 * n // 32


def test_fsdp_gather_fp8_both_ways():
  """jc.fsdp_gather with FP8 weights (nearest) and FP8 gradients (stochastic) in the
  reduce-scatter: the loss's gradient of the shards within the bound of the exact
  gradient of the gathered (FP8) weights, every device's shard its own part."""
  m = helpers.mesh()
  w = jnp.asarray(_values(jax.random.key(11), 64 * 32).reshape(64, 32))
  x = jax.random.normal(jax.random.key(12), (K, 4, 64))
  wc, gc = jc.codecs.Float8(), jc.codecs.Float8(rounding="stochastic")

  def step(shard, xs):
    def loss(s):
      full = jc.fsdp_gather(
        s, axis_name=AXIS, key=jax.random.key(13), weight_codec=wc, grad_codec=gc, filter=ALL
      )
      return jnp.sum(jnp.tanh(xs[0] @ full))

    full = jc.gather_weights(shard, axis_name=AXIS, codec=wc, filter=ALL)
    local = jax.grad(lambda f: jnp.sum(jnp.tanh(xs[0] @ f)))(full)
    exact = lax.psum_scatter(local, AXIS, scatter_dimension=0, tiled=True) / K
    return jax.grad(loss)(shard), exact, local[None]

  f = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS),) * 3))
  got, exact, local = f(jax.device_put(w, jax.NamedSharding(m, P(AXIS))), helpers.shard(x, m))
  bound = _mean_bound(np.asarray(local), "e4m3", "stochastic", twice=False)
  err = np.abs(np.asarray(got, np.float64) - np.asarray(exact, np.float64))
  assert np.all(err <= bound), np.max(err / bound)
  assert np.max(err) > 0
