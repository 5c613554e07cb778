"""Pallas kernels (jaxcomp.kernels) against their XLA references.

Every kernel runs in interpret mode on CPU (and compiled when a CUDA GPU is present):
payloads bit-identical to the XLA codecs for the same key (the l2 scales and OneBit's
means included), decodes and QSGD's residuals within float32 rounding, ragged shapes,
dispatch and fallback, and a ``jax.export`` for the ``cuda`` platform that lowers the
kernels to Triton IR without a GPU.
"""

import re

import chex
import jax
from jax import export
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp import kernels
from jaxcomp._src.plumbing import arith
from jaxcomp._src.plumbing import bitpack
from tests import helpers
from tests import kernel_references as refs

# every_case: Pallas' interpret mode and Triton lowering differ between jax versions,
# so every case runs on both jax lines (tests/conftest.py).
pytestmark = pytest.mark.every_case

CFG = kernels.LaunchConfig(block_size=256)  # small blocks: several programs per test
EPS = float(jnp.finfo(jnp.float32).eps)

MODES = [
  pytest.param(True, id="interpret"),
  pytest.param(
    False,
    id="compiled",
    marks=pytest.mark.skipif(
      not kernels.cuda_available(), reason="compiled kernels need a CUDA GPU"
    ),
  ),
]


def _x(n, dtype=jnp.float32, seed=1):
  x = jax.random.normal(jax.random.key(seed), (n,), jnp.float32)
  return x.at[3].set(0.0).astype(dtype)  # an exact zero: its code carries no sign


def _codes(words, levels, n):
  return np.asarray(bitpack.unpack_bits(words, kernels.quantize.bits_per_value(levels), n))


# ------------------------------------------------------------------------------ quantize

QUANTIZE_CASES = [
  # n, bucket, levels, dtype (interpret mode compiles per case: keep the list short)
  (2000, 64, 7, jnp.float32),  # 4-bit; ragged: 31.25 buckets, 4 buckets/program
  (1000, 128, 1, jnp.bfloat16),  # 2-bit codes, bf16 input
  (77, 512, 32767, jnp.float16),  # 16-bit codes; one short bucket, past the block
]


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("n,bucket,levels,dtype", QUANTIZE_CASES)
def test_quantize_max_norm_is_bit_identical(interpret, n, bucket, levels, dtype):
  x, key = _x(n, dtype), jax.random.key(7)
  words, scales = kernels.quantize.quantize(
    x, key, levels=levels, bucket_size=bucket, norm="max", config=CFG, interpret=interpret
  )
  ref_words, ref_scales = refs.quantize_reference(
    x, key, levels=levels, bucket_size=bucket, norm="max"
  )
  chex.assert_trees_all_equal((words, scales), (ref_words, ref_scales))
  assert words.shape == (bitpack.num_words(n, kernels.quantize.bits_per_value(levels)),)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
  "n,bucket,levels,dtype,feedback",
  [(4096, 32, 127, jnp.float32, False), (2000, 256, 7, jnp.bfloat16, True)],  # 8-bit; ragged
)
def test_quantize_l2_norm_is_bit_identical(interpret, n, bucket, levels, dtype, feedback):
  """The l2 scale is a sum: the kernel takes it from the XLA path's code (one fixed
  order, arith.qsgd_scales), so scales and words agree bit for bit."""
  x, key = _x(n, dtype), jax.random.key(7)
  e = 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32) if feedback else None
  kw = dict(levels=levels, bucket_size=bucket, norm="l2")
  out = kernels.quantize.quantize(x, key, e, **kw, config=CFG, interpret=interpret)
  ref = refs.quantize_reference(x, key, e, **kw)
  chex.assert_trees_all_equal(out[:2], ref[:2])
  if feedback:
    bound = 2 * EPS * float(jnp.max(jnp.abs(x.astype(jnp.float32) + e)))
    np.testing.assert_allclose(out[2], ref[2], rtol=0, atol=bound)


def _sequential_sum(a):
  acc = np.float32(0)
  for v in a:
    acc = np.float32(acc + v)
  return acc


def test_pairwise_sum_has_one_order():
  """arith.pairwise_sum adds halves element-wise: numpy's float32 bits for the same
  halving, within log2(b) ulp of the exact sum, and not the bits of another order (the
  order is what the kernels and the XLA path share)."""
  rows = np.asarray(jax.random.normal(jax.random.key(4), (64, 256), jnp.float32))
  out = np.asarray(arith.pairwise_sum(jnp.asarray(rows)))

  def halves(a):  # numpy float32: each + rounds once, in this order
    while a.shape[-1] > 1:
      h = a.shape[-1] // 2
      a = a[..., :h] + a[..., h:]
    return a[..., 0]

  np.testing.assert_array_equal(out, halves(rows))
  exact = rows.astype(np.float64).sum(1)
  bound = 8 * EPS * np.abs(rows).astype(np.float64).sum(1)  # log2(256) ulp of sum |a|
  assert np.all(np.abs(out - exact) <= bound)
  assert np.any(out != np.array([_sequential_sum(r) for r in rows]))
  # Another length: zero-padded to a power of two (any: the zeros add nothing).
  short = jnp.asarray(rows[:, :200])
  chex.assert_trees_all_equal(
    arith.pairwise_sum(short), halves(np.pad(rows[:, :200], ((0, 0), (0, 56))))
  )
  chex.assert_trees_all_equal(
    arith.pairwise_sum(short), arith.pairwise_sum(jnp.pad(short, ((0, 0), (0, 312))))
  )


@pytest.mark.xla_optimized
def test_l2_scale_is_the_same_bits_in_every_program():
  """arith.qsgd_scales op by op (no fusion) and jitted inside a larger program (where
  XLA contracts products into FMAs) agree bit for bit; ``w * w`` in place of
  arith.exact_square does not (the negative control), and exact_square is ``w**2``
  within two roundings."""
  v = jax.random.normal(jax.random.key(1), (128, 32), jnp.float32) * 3.0
  fused = jax.jit(lambda v: arith.qsgd_scales(v, "l2") + 0.0 * jnp.sum(v))(v)
  chex.assert_trees_all_equal(arith.qsgd_scales(v, "l2"), fused)

  def naive(v):  # the same sum of plain squares
    return jnp.sqrt(arith.pairwise_sum(v * v))

  assert np.any(np.asarray(naive(v)) != np.asarray(jax.jit(naive)(v)))
  w = np.asarray(v).reshape(-1) / 4
  sq = np.asarray(arith.exact_square(jnp.asarray(w))).astype(np.float64)
  # two roundings (the two additions), each within half an ulp
  np.testing.assert_allclose(sq, w.astype(np.float64) ** 2, rtol=EPS, atol=0)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("n,bucket,levels,dtype", QUANTIZE_CASES[:2])
def test_quantize_fused_error_feedback(interpret, n, bucket, levels, dtype):
  x, key = _x(n, dtype), jax.random.key(5)
  e = 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32)
  words, scales, new_e = kernels.quantize.quantize(
    x, key, e, levels=levels, bucket_size=bucket, norm="max", config=CFG, interpret=interpret
  )
  ref_words, ref_scales, ref_e = refs.quantize_reference(
    x, key, e, levels=levels, bucket_size=bucket, norm="max"
  )
  chex.assert_trees_all_equal((words, scales), (ref_words, ref_scales))
  x32 = x.astype(jnp.float32) + e
  # e' = x32 - q * step: one rounding of the product (or none, with an FMA).
  np.testing.assert_allclose(new_e, ref_e, rtol=0, atol=2 * EPS * float(jnp.max(jnp.abs(x32))))
  # Error feedback's invariant: what was sent plus what is kept is the input.
  sent = jc.codecs.QSGD(levels, bucket, "max").decode(
    jc.codecs.Payload({"words": words, "scales": scales}, (n,), jnp.dtype(dtype)), jnp.float32
  )
  if dtype == jnp.float32:
    np.testing.assert_allclose(
      sent + new_e, x32, rtol=0, atol=2 * EPS * float(jnp.max(jnp.abs(x32)))
    )


@pytest.mark.parametrize("interpret", MODES)
def test_quantize_nonfinite_bucket_is_marked_not_hidden(interpret):
  x = _x(300).at[70].set(jnp.nan).at[200].set(jnp.inf)
  words, scales = kernels.quantize.quantize(
    x, jax.random.key(0), levels=7, bucket_size=64, config=CFG, interpret=interpret
  )
  ref = refs.quantize_reference(x, jax.random.key(0), levels=7, bucket_size=64)
  chex.assert_trees_all_equal((words, scales), ref)
  assert np.isnan(scales[1]) and np.isnan(scales[3])
  assert np.isfinite(np.delete(np.asarray(scales), [1, 3])).all()


def test_quantize_is_unbiased_over_keys():
  """E[decode(quantize(x))] = x: 256 keys in one vmapped (batched-grid) call, 5 SE."""
  n, bucket, levels, draws = 256, 64, 1, 256
  x = _x(n)
  keys = jax.random.split(jax.random.key(11), draws)
  words, scales = jax.vmap(
    lambda k: kernels.quantize.quantize(
      x, k, levels=levels, bucket_size=bucket, config=CFG, interpret=True
    )
  )(keys)
  codec = jc.codecs.QSGD(levels, bucket, "max")
  dec = jax.vmap(
    lambda w, s: codec.decode(
      jc.codecs.Payload({"words": w, "scales": s}, (n,), jnp.dtype(jnp.float32))
    )
  )(words, scales)
  ref = jax.vmap(lambda k: refs.quantize_reference(x, k, levels=levels, bucket_size=bucket))(keys)
  chex.assert_trees_all_equal((words, scales), ref)  # batching keeps the global index
  # Each value is step * (floor(r) + Bernoulli(p)), p = frac(r): its SE is known. The
  # Bernoulli variance is floored at 1/draws, where the normal approximation of a rare
  # event fails (the same floor as test_wangni's unbiasedness test).
  step = jnp.repeat(scales[0] / levels, bucket)
  r = jnp.abs(x) / jnp.repeat(scales[0], bucket) * levels
  p = r - jnp.floor(r)
  var = jnp.where(p > 0, jnp.maximum(p * (1 - p), 1.0 / draws), 0.0)
  se = step * jnp.sqrt(var / draws)
  mean = jnp.mean(dec, 0)
  z = jnp.abs(mean - x) / jnp.where(se > 0, se, 1.0)
  assert float(jnp.max(jnp.where(se > 0, z, 0.0))) < 5.0
  # Values on the grid (p = 0: max |x| of each bucket, the zero) are exact every time.
  np.testing.assert_allclose(jnp.where(se > 0, x, mean), x, rtol=1e-6)


# ---------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("k,n,bucket,levels", [(3, 2000, 64, 7), (5, 300, 32, 127)])
def test_dequantize_sum_is_the_ordered_sum(interpret, k, n, bucket, levels):
  xs = jax.random.normal(jax.random.key(3), (k, n), jnp.float32)
  keys = jax.random.split(jax.random.key(4), k)
  words, scales = jax.vmap(
    lambda x, kk: refs.quantize_reference(x, kk, levels=levels, bucket_size=bucket)
  )(xs, keys)
  out = kernels.dequantize.dequantize_sum(
    words, scales, n=n, levels=levels, bucket_size=bucket, config=CFG, interpret=interpret
  )
  ref = refs.dequantize_sum_reference(words, scales, n=n, levels=levels, bucket_size=bucket)
  # Same decodings, same order; XLA may fuse acc + q * step into one FMA in either
  # path, so each of the k adds may round differently: 2k ulps of sum_k |d_k| <=
  # sum_k scale_k (max norm: every decoded value is at most its bucket's scale).
  bound = 2 * k * EPS * np.repeat(np.asarray(scales).sum(0), bucket)[:n]
  assert np.all(np.abs(np.asarray(out) - np.asarray(ref)) <= bound)


def test_dequantize_sum_checks_its_inputs():
  words = jnp.zeros((2, 63), jnp.uint32)  # 500 4-bit codes
  scales = jnp.zeros((2, 4), jnp.float32)
  with pytest.raises(ValueError, match="words must be uint32"):
    kernels.dequantize.dequantize_sum(words[:, :10], scales, n=500, levels=7, bucket_size=128)
  with pytest.raises(ValueError, match="scales must be float32"):
    kernels.dequantize.dequantize_sum(words, scales[:1], n=500, levels=7, bucket_size=128)
  with pytest.raises(ValueError, match="does not handle"):
    kernels.dequantize.dequantize_sum(words, scales, n=500, levels=7, bucket_size=100)


# ----------------------------------------------------------------------------- sign_pack


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
  "n,bucket,dtype,feedback",
  [(2000, 64, jnp.float32, True), (1000, 128, jnp.bfloat16, False), (77, 512, jnp.float32, True)],
)
def test_sign_pack_is_bit_identical(interpret, n, bucket, dtype, feedback):
  """Sign words, means (summed before the kernel by the XLA path's code) and the
  residual (``x + e - mean``: no product to contract) bit for bit."""
  x = _x(n, dtype)
  e = 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32) if feedback else None
  out = kernels.sign_pack.sign_pack(x, e, bucket_size=bucket, config=CFG, interpret=interpret)
  chex.assert_trees_all_equal(out, refs.sign_pack_reference(x, e, bucket_size=bucket))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("k,n,bucket", [(1, 2000, 64), (6, 77, 512)])
def test_sign_unpack_sum_is_the_ordered_sum(interpret, k, n, bucket):
  xs = jax.random.normal(jax.random.key(3), (k, n), jnp.float32)
  words, pos, neg = jax.vmap(lambda x: refs.sign_pack_reference(x, bucket_size=bucket))(xs)
  out = kernels.sign_pack.sign_unpack_sum(
    words, pos, neg, n=n, bucket_size=bucket, config=CFG, interpret=interpret
  )
  ref = refs.sign_unpack_sum_reference(words, pos, neg, n=n, bucket_size=bucket)
  chex.assert_trees_all_equal(out, ref)


# ------------------------------------------------------------------- dispatch, fallback


def _has_pallas_call(fn, *args) -> bool:
  """Whether ``fn`` calls a kernel: ``pallas_call`` (Triton) or ``mpmd_map`` (Mosaic GPU)."""
  text = str(jax.make_jaxpr(fn)(*args))
  return "pallas_call" in text or "mpmd_map" in text


def test_implementation_dispatch_and_fallback():
  x, key = _x(1024), jax.random.key(0)
  for codec_cls, kw in (
    (jc.codecs.QSGD, dict(levels=7, bucket_size=64, norm="max")),
    (jc.codecs.OneBit, dict(bucket_size=64)),
  ):
    pallas = codec_cls(**kw, implementation="pallas")
    assert _has_pallas_call(lambda x: pallas.encode(x, key=key), x)
    assert not _has_pallas_call(
      lambda x: codec_cls(**kw, implementation="xla").encode(x, key=key), x
    )
    # None: the kernels only on a CUDA GPU.
    assert _has_pallas_call(lambda x: codec_cls(**kw).encode(x, key=key), x) == (
      kernels.cuda_available()
    )
  # Shapes the kernels cannot handle fall back to XLA (and still encode correctly).
  for codec in (
    jc.codecs.QSGD(3, 64, "max", implementation="pallas"),  # 3-bit codes
    jc.codecs.QSGD(7, 100, "max", implementation="pallas"),  # bucket not 2**k
    jc.codecs.QSGD(7, None, "max", implementation="pallas"),  # one bucket
    jc.codecs.OneBit(None, implementation="pallas"),
  ):
    assert not _has_pallas_call(lambda x: codec.encode(x, key=key), x)
    assert jax.eval_shape(lambda x: codec.decode(codec.encode(x, key=key)), x).shape == x.shape
  with pytest.raises(ValueError, match="implementation must be"):
    jc.codecs.QSGD(7, 64, implementation="triton")
  with pytest.raises(ValueError, match="power of two"):
    kernels.LaunchConfig(block_size=1000)
  with pytest.raises(ValueError, match="does not handle"):
    kernels.quantize.quantize(x, key, levels=3, bucket_size=64)


def test_codec_payloads_identical_across_implementations():
  x, key = _x(1500, jnp.bfloat16), jax.random.key(9)
  a = jc.codecs.QSGD(7, 128, "max", implementation="pallas")
  b = jc.codecs.QSGD(7, 128, "max", implementation="xla")
  pa, pb = a.encode(x, key=key), b.encode(x, key=key)
  chex.assert_trees_all_equal(pa, pb)
  chex.assert_trees_all_equal(a.decode(pa), b.decode(pb))
  assert a.wire_bits(x.shape, x.dtype) == b.wire_bits(x.shape, x.dtype)


@pytest.mark.slow
@pytest.mark.parametrize(
  "make",
  [
    lambda impl: jc.codecs.QSGD(7, 64, "max", implementation=impl),
    lambda impl: jc.codecs.OneBit(64, implementation=impl),
  ],
  ids=["qsgd", "onebit"],
)
def test_compress_with_kernels_under_pmap(make):
  """8 devices, fused error feedback + fused decode-sum vs the XLA path, two steps."""
  helpers.kernel_vs_xla_under_pmap(make, "pallas", bitwise_outputs=True)


def test_compress_with_kernels_keeps_residual_on_nonfinite():
  tx = jc.compress(
    jc.codecs.QSGD(7, 64, "max", implementation="pallas"),
    error_feedback=True,
    filter=lambda path, leaf: True,
    axis_name=None,
  )
  params = {"w": jnp.zeros((256,))}
  state = tx.init(params)
  _, state = tx.update({"w": _x(256)}, state)
  kept = state.residual["w"]
  out, state = tx.update({"w": _x(256).at[5].set(jnp.nan)}, state)
  chex.assert_trees_all_equal(state.residual["w"], kept)
  assert int(state.nonfinite_count) == 1 and bool(jnp.isnan(out["w"]).any())


def test_interpret_under_check_vma_raises_clearly():
  m = helpers.mesh()
  codec = jc.codecs.QSGD(7, 64, "max", implementation="pallas")
  f = jax.shard_map(
    lambda x: codec.encode(x[0], key=jax.random.key(0)).arrays["scales"],
    mesh=m,
    in_specs=jax.sharding.PartitionSpec(helpers.AXIS),
    out_specs=jax.sharding.PartitionSpec(helpers.AXIS),
  )
  x = helpers.shard(jnp.ones((8, 256)), m)
  if kernels.cuda_available():
    pytest.skip("compiled kernels run under check_vma")
  with pytest.raises(ValueError, match="check_vma"):
    jax.jit(f)(x)


# ------------------------------------------------------------------- CUDA lowering


_TRITON = "__gpu$xla.gpu.triton"


def _export_cuda(fn, *args):
  """Exports ``fn`` for CUDA with no GPU present: an abstract H100 says which GPU.

  (jax >= 0.11 asks Triton lowering for the target's compute capability; with no GPU it
  reads it from the abstract mesh's device.)
  """
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("export",), abstract_device=h100)
  with jax.sharding.use_abstract_mesh(mesh):
    exp = export.export(
      jax.jit(fn),
      platforms=("cuda",),
      disabled_checks=[export.DisabledSafetyCheck.custom_call(_TRITON)],
    )(*args)
  return exp.mlir_module()


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_kernels_lower_to_triton_for_cuda(norm):
  """Lowers every kernel for CUDA on this (GPU-less) machine: unsupported ops fail here.

  ``backend="triton"``: with jax >= 0.12 the default is Mosaic GPU for these shapes
  (``tests/test_mosaic_kernels.py`` exports those)."""
  s = jax.ShapeDtypeStruct
  n, k = 1000, 6
  cases = {
    "jaxcomp_quantize": (
      lambda x, key, e: kernels.quantize.quantize(
        x, key, e, levels=7, bucket_size=512, norm=norm, interpret=False, backend="triton"
      ),
      (s((n,), jnp.bfloat16), jax.random.key(0), s((n,), jnp.float32)),
    ),
    "jaxcomp_dequantize_sum": (
      lambda w, sc: kernels.dequantize.dequantize_sum(
        w, sc, n=n, levels=7, bucket_size=512, interpret=False, backend="triton"
      ),
      (s((k, 125), jnp.uint32), s((k, 2), jnp.float32)),
    ),
    "jaxcomp_sign_pack": (
      lambda x, e: kernels.sign_pack.sign_pack(
        x, e, bucket_size=512, interpret=False, backend="triton"
      ),
      (s((n,), jnp.float32), s((n,), jnp.float32)),
    ),
    "jaxcomp_sign_unpack_sum": (
      lambda w, p, q: kernels.sign_pack.sign_unpack_sum(
        w, p, q, n=n, bucket_size=512, interpret=False, backend="triton"
      ),
      (s((k, 32), jnp.uint32), s((k, 2), jnp.float32), s((k, 2), jnp.float32)),
    ),
  }
  for name, (fn, args) in cases.items():
    text = _export_cuda(fn, *args)
    assert text.count(_TRITON) == 1, name
    assert re.search(rf'name = "{name}"', text), name


def test_cuda_lowering_check_can_fail():
  """The export above is a real check: a kernel with a non-power-of-two block fails."""

  def bad(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0

  def fn(x):
    return pl.pallas_call(
      bad,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(2,),
      in_specs=[pl.BlockSpec((100,), lambda i: (i,))],
      out_specs=pl.BlockSpec((100,), lambda i: (i,)),
      compiler_params=kernels.LaunchConfig().compiler_params(),
    )(x)

  with pytest.raises(Exception, match="power of 2|power of two"):
    _export_cuda(fn, jax.ShapeDtypeStruct((200,), jnp.float32))
