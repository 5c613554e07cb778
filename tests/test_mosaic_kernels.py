"""The kernels on Mosaic GPU (jaxcomp.kernels._mosaic) against the XLA path.

They run on this CPU in Mosaic GPU's interpret mode (``InterpretGPUParams``, jax >= 0.12;
skipped, saying so, where this jax lacks it): payloads bit-identical to the XLA codecs for
the same key (scales and means included: their sums are computed before the kernel, by
the XLA path's code), decodes in rank order, residuals bit for bit or within the FMA
contraction of ``x - q * step``; on every shape: ragged tensors (1, 31, 1000, 4097
values) and buckets smaller than a tile. A ``jax.export`` for the ``cuda`` platform
lowers all four to Mosaic GPU custom calls, with no Triton, on this GPU-less machine,
with and without a mesh context, and ``jc.compress`` inside ``jax.shard_map``. Dispatch
picks Mosaic GPU for every shape of 1-, 2- and 4-bit codes. The ``compiled`` parameters
run on a Hopper GPU (``scripts/gpu_check.sh``).
"""

import contextlib
import re
import warnings

import chex
import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp import kernels
from jaxcomp.kernels import _common
from jaxcomp.kernels import _mosaic
from tests import kernel_references as refs

_WHY = _mosaic.unavailable(interpret=True)
# every_case: jax 0.10 has no Mosaic GPU interpret mode, so the second jax line
# (tests/conftest.py) is the only one to run these cases.
pytestmark = [
  pytest.mark.skipif(_WHY is not None, reason=f"no Mosaic GPU interpret mode: {_WHY}"),
  pytest.mark.every_case,
]

EPS = float(jnp.finfo(jnp.float32).eps)


def _compiled_unavailable() -> str | None:
  if not kernels.cuda_available():
    return "compiled Mosaic GPU kernels need a CUDA GPU"
  return _mosaic.unavailable(interpret=False, capability=_common.compute_capability())


#: Interpret mode on any machine; compiled on a Hopper (or newer) GPU, where
#: ``scripts/gpu_check.sh`` selects these with ``-k compiled``.
MODES = [
  pytest.param(True, id="interpret"),
  pytest.param(
    False,
    id="compiled",
    marks=pytest.mark.skipif(
      _compiled_unavailable() is not None, reason=str(_compiled_unavailable())
    ),
  ),
]


def _x(n, dtype=jnp.float32, seed=1):
  x = jax.random.normal(jax.random.key(seed), (n,), jnp.float32)
  return x.at[3].set(0.0).astype(dtype)


def _is_mosaic(fn, *args) -> bool:
  text = str(jax.make_jaxpr(fn)(*args))
  return "mpmd_map" in text and "pallas_call" not in text


@pytest.mark.parametrize(
  "n,bucket,levels,dtype,feedback,norm",
  [
    (4096, 1024, 7, jnp.float32, True, "max"),  # 4-bit codes, 2 buckets of 2 tiles each
    (2048, 1024, 1, jnp.bfloat16, False, "max"),  # 2-bit codes, bf16 input
    (4096, 2048, 7, jnp.float32, True, "l2"),  # the l2 scale, 4 tiles per bucket
    (2048, 1024, 1, jnp.float16, True, "l2"),
  ],
)
def test_quantize_is_bit_identical(n, bucket, levels, dtype, feedback, norm):
  """Words and scales bit for bit, the l2 norm's sum of squares included."""
  x, key = _x(n, dtype), jax.random.key(7)
  e = 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32) if feedback else None
  kw = dict(levels=levels, bucket_size=bucket, norm=norm)
  fn = lambda x, e: kernels.quantize.quantize(x, key, e, **kw, interpret=True)
  assert _is_mosaic(fn, x, e)
  out = fn(x, e)
  ref = refs.quantize_reference(x, key, e, **kw)
  chex.assert_trees_all_equal(out[:2], ref[:2])  # words and scales: bit for bit
  if feedback:
    x32 = x.astype(jnp.float32) + e
    # e' = x32 - q * step: one rounding of the product (or none, with an FMA).
    bound = 2 * EPS * float(jnp.max(jnp.abs(x32)))
    np.testing.assert_allclose(out[2], ref[2], rtol=0, atol=bound)


def test_quantize_nonfinite_bucket_is_marked_not_hidden():
  x = _x(2048).at[70].set(jnp.nan).at[1500].set(jnp.inf)
  x = jnp.concatenate([x, _x(1024)])
  out = kernels.quantize.quantize(
    x, jax.random.key(0), levels=7, bucket_size=1024, interpret=True, backend="mosaic_gpu"
  )
  ref = refs.quantize_reference(x, jax.random.key(0), levels=7, bucket_size=1024)
  chex.assert_trees_all_equal(out, ref)
  assert np.isnan(out[1][:2]).all() and np.isfinite(out[1][2])


def _payloads(k: int, n: int, levels: int, bucket: int):
  """K devices' reference QSGD payloads (words, scales) of n Gaussian values each."""
  xs = jax.random.normal(jax.random.key(3), (k, n), jnp.float32)
  keys = jax.random.split(jax.random.key(4), k)
  return jax.vmap(lambda x, kk: refs.quantize_reference(x, kk, levels=levels, bucket_size=bucket))(
    xs, keys
  )


@pytest.mark.parametrize("levels", [7, 1])
def test_dequantize_sum_is_the_ordered_sum(levels):
  k, n, bucket = 3, 4096, 2048
  words, scales = _payloads(k, n, levels, bucket)
  kw = dict(n=n, levels=levels, bucket_size=bucket)
  fn = lambda w, s: kernels.dequantize.dequantize_sum(w, s, **kw, interpret=True)
  assert _is_mosaic(fn, words, scales)
  chex.assert_trees_all_equal(fn(words, scales), refs.dequantize_sum_reference(words, scales, **kw))


@pytest.mark.parametrize("feedback", [False, True])
def test_sign_pack_is_bit_identical(feedback):
  """Sign words, means and residual bit for bit (e' = x + e - mean: no product)."""
  n, bucket = 8192, 4096
  x = _x(n) + 0.3  # more positive values than negative: the two means differ
  e = 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32) if feedback else None
  fn = lambda x, e: kernels.sign_pack.sign_pack(x, e, bucket_size=bucket, interpret=True)
  assert _is_mosaic(fn, x, e)
  chex.assert_trees_all_equal(fn(x, e), refs.sign_pack_reference(x, e, bucket_size=bucket))


def test_sign_unpack_sum_is_the_ordered_sum():
  k, n, bucket = 4, 4096, 2048
  xs = jax.random.normal(jax.random.key(3), (k, n), jnp.float32)
  words, pos, neg = jax.vmap(lambda x: refs.sign_pack_reference(x, bucket_size=bucket))(xs)
  fn = lambda w, p, q: kernels.sign_pack.sign_unpack_sum(
    w, p, q, n=n, bucket_size=bucket, interpret=True
  )
  assert _is_mosaic(fn, words, pos, neg)
  chex.assert_trees_all_equal(
    fn(words, pos, neg),
    refs.sign_unpack_sum_reference(words, pos, neg, n=n, bucket_size=bucket),
  )


def test_codecs_run_mosaic_kernels_and_match_xla():
  """implementation="pallas" on shapes Mosaic GPU takes: the XLA path's payloads."""
  x, key = _x(4096), jax.random.key(9)
  for make in (
    lambda impl: jc.codecs.QSGD(7, 1024, "max", implementation=impl),
    lambda impl: jc.codecs.QSGD(7, 1024, "l2", implementation=impl),
    lambda impl: jc.codecs.OneBit(2048, implementation=impl),
  ):
    a, b = make("pallas"), make("xla")
    assert _is_mosaic(lambda x: a.encode(x, key=key), x)
    pa, pb = a.encode(x, key=key), b.encode(x, key=key)
    chex.assert_trees_all_equal(pa, pb)
    stacked = jax.tree.map(lambda v: jnp.stack([v, v]), pa)
    chex.assert_trees_all_equal(a.decode_sum(stacked), b.decode_sum(stacked))


def test_compress_with_fused_feedback_on_mosaic_matches_xla():
  """Two steps of jc.compress with error feedback: the fused Mosaic GPU encode gives the
  XLA path's outputs and residuals. OneBit's are bit for bit at every step (its residual
  has no product); QSGD's residual is within an ulp (XLA may contract ``x - q * step``
  into an FMA), so its first step's output is bit for bit and the next within float32
  rounding."""
  grads = [{"w": _x(4096, seed=s)} for s in (1, 2)]
  for make in (
    lambda impl: jc.codecs.QSGD(7, 1024, "l2", implementation=impl),
    lambda impl: jc.codecs.OneBit(2048, implementation=impl),
  ):
    assert make("pallas").fuses_feedback(4096, jnp.float32)
    runs = []
    for impl in ("pallas", "xla"):
      tx = jc.compress(
        make(impl), error_feedback=True, filter=lambda path, leaf: True, axis_name=None
      )
      state, outs = tx.init(grads[0]), []
      if impl == "pallas":
        assert _is_mosaic(lambda g: tx.update(g, state)[0], grads[0])
      for g in grads:
        out, state = tx.update(g, state)
        outs.append(out)
      runs.append((outs, state.residual))
    (outs_a, res_a), (outs_b, res_b) = runs
    chex.assert_trees_all_equal(outs_a[0], outs_b[0])
    if isinstance(make("xla"), jc.codecs.OneBit):
      chex.assert_trees_all_equal((outs_a, res_a), (outs_b, res_b))
    chex.assert_trees_all_close(outs_a, outs_b, rtol=0, atol=16 * EPS)
    chex.assert_trees_all_close(res_a, res_b, rtol=0, atol=16 * EPS)


# ------------------------------------------------------------ every shape: ragged, small

# n: one value, less than a word, a ragged last bucket, one value past whole buckets.
RAGGED = [1, 31, 1000, 4097]


@pytest.mark.parametrize(
  "n,bucket,levels,dtype,feedback,norm",
  [
    (1, 512, 7, jnp.float32, False, "max"),  # one value: one short bucket, one word
    (31, 512, 7, jnp.bfloat16, True, "max"),  # the codec's bucket is the 31 values
    (1000, 512, 7, jnp.float32, True, "max"),  # a ragged last bucket (488 values)
    (1000, 512, 7, jnp.float32, False, "l2"),
    (4097, 1024, 1, jnp.float16, True, "max"),  # 2-bit codes; one value past 4 buckets
    (1000, 128, 7, jnp.float32, True, "max"),  # 4 buckets per tile (16 words each)
    (4097, 32, 7, jnp.bfloat16, False, "l2"),  # 16 buckets per tile, ragged
    (1000, 64, 1, jnp.float32, False, "max"),  # 2-bit, 4 words per bucket
  ],
)
@pytest.mark.parametrize("interpret", MODES)
def test_quantize_every_shape_is_bit_identical(interpret, n, bucket, levels, dtype, feedback, norm):
  """Ragged tensors and buckets smaller than a tile: the XLA path's words (the padding
  bits of the last word included) and scales (the partial bucket's included)."""
  x, key = _x(n, dtype), jax.random.key(7)
  e = 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32) if feedback else None
  kw = dict(levels=levels, bucket_size=bucket, norm=norm)
  fn = lambda x, e: kernels.quantize.quantize(x, key, e, **kw, interpret=interpret)
  assert _is_mosaic(fn, x, e)
  out = fn(x, e)
  ref = refs.quantize_reference(x, key, e, **kw)
  chex.assert_trees_all_equal(out[:2], ref[:2])
  if feedback:
    assert out[2].shape == x.shape
    x32 = x.astype(jnp.float32) + e
    bound = 2 * EPS * float(jnp.max(jnp.abs(x32)))
    np.testing.assert_allclose(out[2], ref[2], rtol=0, atol=bound)


def test_ragged_tail_padding_bits_are_the_xla_paths():
  """1001 4-bit codes: the last word holds one code and seven padding codes, zero on the
  XLA path and in the kernel; the comparison sees a padding bit set (it can fail)."""
  x, key = _x(1001), jax.random.key(7)
  words, _ = kernels.quantize.quantize(x, key, levels=7, bucket_size=512, interpret=True)
  ref_words, _ = refs.quantize_reference(x, key, levels=7, bucket_size=512)
  assert words.shape == (126,) and int(ref_words[-1]) >> 4 == 0
  chex.assert_trees_all_equal(words, ref_words)
  with pytest.raises(AssertionError):
    chex.assert_trees_all_equal(words.at[-1].set(words[-1] | np.uint32(1 << 31)), ref_words)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("n", RAGGED)
@pytest.mark.parametrize("bucket", [32, 4096])
def test_sign_pack_every_shape_is_bit_identical(interpret, n, bucket):
  """Ragged tensors, and buckets of one word (32 per tile) and of two tiles."""
  x = _x(n) + 0.3
  e = 0.1 * jax.random.normal(jax.random.key(2), (n,), jnp.float32)
  fn = lambda x, e: kernels.sign_pack.sign_pack(x, e, bucket_size=bucket, interpret=interpret)
  assert _is_mosaic(fn, x, e)
  chex.assert_trees_all_equal(fn(x, e), refs.sign_pack_reference(x, e, bucket_size=bucket))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("n", RAGGED)
@pytest.mark.parametrize("levels,bucket", [(7, 512), (7, 64), (1, 2048)])
def test_dequantize_sum_every_shape(interpret, n, levels, bucket):
  """The ordered sum, bit for bit in interpret mode; compiled, within the FMA the GPU
  may make of ``acc + q * step`` (2 ulps of ``sum_k scale_k`` per add)."""
  k = 3
  words, scales = _payloads(k, n, levels, bucket)
  kw = dict(n=n, levels=levels, bucket_size=bucket)
  fn = lambda w, s: kernels.dequantize.dequantize_sum(w, s, **kw, interpret=interpret)
  assert _is_mosaic(fn, words, scales)
  out, ref = fn(words, scales), refs.dequantize_sum_reference(words, scales, **kw)
  if interpret:
    chex.assert_trees_all_equal(out, ref)
  else:
    bound = 2 * k * EPS * np.repeat(np.asarray(scales).sum(0), bucket)[:n]
    assert np.all(np.abs(np.asarray(out) - np.asarray(ref)) <= bound)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("n", RAGGED)
@pytest.mark.parametrize("bucket", [64, 2048])
def test_sign_unpack_sum_every_shape(interpret, n, bucket):
  k = 2
  xs = jax.random.normal(jax.random.key(3), (k, n), jnp.float32)
  words, pos, neg = jax.vmap(lambda x: refs.sign_pack_reference(x, bucket_size=bucket))(xs)
  fn = lambda w, p, q: kernels.sign_pack.sign_unpack_sum(
    w, p, q, n=n, bucket_size=bucket, interpret=interpret
  )
  assert _is_mosaic(fn, words, pos, neg)
  chex.assert_trees_all_equal(  # sums of the means, no product: no FMA to differ by
    fn(words, pos, neg),
    refs.sign_unpack_sum_reference(words, pos, neg, n=n, bucket_size=bucket),
  )


def test_misfit_is_the_code_width_only():
  """Every n and bucket fit; 8- and 16-bit codes do not (interpret mode runs them on
  Triton's interpreter, asking for Mosaic GPU raises)."""
  assert _mosaic.misfit(1000, 1, 64) is None and _mosaic.misfit(1, 4, 65536) is None
  assert "8-bit" in _mosaic.misfit(4096, 8, 1024)  # 4 codes per word: not a tile
  x = _x(1000)
  fn = lambda x: kernels.quantize.quantize(
    x, jax.random.key(0), levels=127, bucket_size=64, interpret=True
  )
  assert "pallas_call" in str(jax.make_jaxpr(fn)(x))
  with pytest.raises(ValueError, match="mosaic_gpu: 8-bit codes"):
    kernels.quantize.quantize(
      x, jax.random.key(0), levels=127, bucket_size=64, interpret=True, backend="mosaic_gpu"
    )
  with pytest.raises(ValueError, match="backend must be"):
    kernels.sign_pack.sign_pack(x, bucket_size=64, interpret=True, backend="cuda")


# ------------------------------------------------------------------- CUDA lowering

_TRITON = "__gpu$xla.gpu.triton"


_H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")


def _context(mesh: bool):
  """A mesh context as ``jax.set_mesh`` users run (an abstract H100, explicit axes), or
  none."""
  if not mesh:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(
    jax.sharding.AbstractMesh((1,), ("export",), abstract_device=_H100)
  )


def _assert_mosaic_only(text: str, what) -> None:
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"mosaic_gpu_v2"}, what
  assert _TRITON not in text and "triton" not in text.lower(), what


def _kernel_cases(n, bucket, levels, dtype):
  s = jax.ShapeDtypeStruct
  k, bits = 3, kernels.quantize.bits_per_value(levels)
  nw, nb = -(-n * bits // 32), -(-n // bucket)
  key = jax.random.key(0)
  return {
    "jaxcomp_quantize": (
      lambda x, e: kernels.quantize.quantize(
        x, key, e, levels=levels, bucket_size=bucket, interpret=False
      ),
      (s((n,), dtype), s((n,), jnp.float32)),
    ),
    "jaxcomp_quantize l2": (
      lambda x: kernels.quantize.quantize(
        x, key, levels=levels, bucket_size=bucket, norm="l2", interpret=False
      ),
      (s((n,), dtype),),
    ),
    "jaxcomp_dequantize_sum": (
      lambda w, sc: kernels.dequantize.dequantize_sum(
        w, sc, n=n, levels=levels, bucket_size=bucket, interpret=False
      ),
      (s((k, nw), jnp.uint32), s((k, nb), jnp.float32)),
    ),
    "jaxcomp_sign_pack": (
      lambda x, e: kernels.sign_pack.sign_pack(x, e, bucket_size=bucket, interpret=False),
      (s((n,), dtype), s((n,), jnp.float32)),
    ),
    "jaxcomp_sign_unpack_sum": (
      lambda w, p, q: kernels.sign_pack.sign_unpack_sum(
        w, p, q, n=n, bucket_size=bucket, interpret=False
      ),
      (s((k, -(-n // 32)), jnp.uint32), s((k, nb), jnp.float32), s((k, nb), jnp.float32)),
    ),
  }


@pytest.mark.parametrize("mesh", [False, True], ids=["no-mesh", "mesh"])
@pytest.mark.parametrize(
  "n,bucket,levels,dtype",
  [
    (4096, 1024, 7, jnp.bfloat16),  # whole buckets (the mesh case failed before)
    (8192, 2048, 1, jnp.float32),
    (1000, 512, 7, jnp.float32),  # a ragged last bucket
    (50257, 128, 1, jnp.bfloat16),  # 8 buckets per tile, ragged; 2-bit codes of bf16
  ],
)
def test_kernels_lower_to_mosaic_gpu_for_cuda(mesh, n, bucket, levels, dtype):
  """Lowers every kernel for CUDA on this GPU-less machine, with and without a mesh
  context: Mosaic GPU custom calls, no Triton."""
  for name, (fn, args) in _kernel_cases(n, bucket, levels, dtype).items():
    with _context(mesh):
      text = export.export(jax.jit(fn), platforms=("cuda",))(*args).mlir_module()
    _assert_mosaic_only(text, name)
    assert name.split()[0] in text, name


@pytest.mark.parametrize(
  "make",
  [
    lambda: jc.codecs.QSGD(levels=7, bucket_size=512),
    lambda: jc.codecs.OneBit(bucket_size=64),
  ],
  ids=["qsgd", "onebit"],
)
def test_compress_in_shard_map_lowers_to_mosaic_gpu(monkeypatch, make):
  """``jc.compress`` inside ``jax.shard_map`` with the dispatch a Hopper GPU sees, on a
  kernel, a bias and an embedding whose sizes are not whole buckets: every encode and
  decode-sum is a Mosaic GPU kernel, none Triton."""
  monkeypatch.setattr(_common, "cuda_available", lambda: True)
  monkeypatch.setattr(_common, "compute_capability", lambda: (9, 0))
  grads = {
    "w": jax.ShapeDtypeStruct((1000, 300), jnp.float32),
    "b": jax.ShapeDtypeStruct((1000,), jnp.float32),
    "emb": jax.ShapeDtypeStruct((50257, 8), jnp.bfloat16),
  }
  mesh = jax.sharding.AbstractMesh((8,), ("data",), abstract_device=_H100)
  tx = jc.compress(make(), axis_name="data", filter=lambda path, leaf: True)

  def step(g):
    out, _ = tx.update(g, tx.init(g))
    return out

  spec = jax.sharding.PartitionSpec()
  fn = jax.shard_map(step, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False)
  with jax.sharding.use_abstract_mesh(mesh):
    text = export.export(jax.jit(fn), platforms=("cuda",))(grads).mlir_module()
  _assert_mosaic_only(text, "compress")
  for name in ("quantize", "dequantize_sum") if "QSGD" in repr(make()) else ("sign_pack",):
    assert text.count(f"jaxcomp_{name}") >= 3, name  # one kernel per leaf


def test_compress_in_shard_map_eight_bit_codes_lower_to_xla(monkeypatch):
  """Codes Mosaic GPU does not pack (8-bit) go to the XLA path, not Triton, where Mosaic
  GPU runs (one KernelFallbackWarning)."""
  monkeypatch.setattr(_common, "cuda_available", lambda: True)
  monkeypatch.setattr(_common, "compute_capability", lambda: (9, 0))
  monkeypatch.setattr(_common, "_warned", set())
  grads = {"b": jax.ShapeDtypeStruct((1000,), jnp.float32)}
  mesh = jax.sharding.AbstractMesh((8,), ("data",), abstract_device=_H100)
  tx = jc.compress(
    jc.codecs.QSGD(levels=127, bucket_size=512),
    axis_name="data",
    filter=lambda path, leaf: True,
  )
  spec = jax.sharding.PartitionSpec()
  fn = jax.shard_map(
    lambda g: tx.update(g, tx.init(g))[0],
    mesh=mesh,
    in_specs=(spec,),
    out_specs=spec,
    check_vma=False,
  )
  with pytest.warns(kernels.KernelFallbackWarning, match="deprecated Triton"):
    with jax.sharding.use_abstract_mesh(mesh):
      text = export.export(jax.jit(fn), platforms=("cuda",))(grads).mlir_module()
  assert "custom_call" not in text and "triton" not in text.lower()
  assert re.search(r"all_gather.*xui32>", text)  # the codes are exchanged: compressed


def test_mosaic_lowering_check_can_fail():
  """The export above is a real check: a primitive Mosaic GPU does not lower fails it."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def bad(x_ref, o_ref):
    o_ref[...] = jnp.floor(x_ref[...])

  fn = plgpu.kernel(bad, out_type=jax.ShapeDtypeStruct((1024,), jnp.float32))
  with pytest.raises(NotImplementedError, match="floor"):
    export.export(jax.jit(fn), platforms=("cuda",))(jax.ShapeDtypeStruct((1024,), jnp.float32))


# ---------------------------------------------------------------------------- dispatch


@pytest.fixture
def fresh_warnings(monkeypatch):
  monkeypatch.setattr(_common, "_warned", set())


def _missing():
  raise ImportError("No module named 'jax.experimental.pallas.triton' (simulated)")


def test_without_triton_mosaic_shapes_keep_kernels_others_fall_back(monkeypatch, fresh_warnings):
  """A jax without Triton: Mosaic GPU runs the shapes it takes (every shape of 1-, 2- and
  4-bit codes), the others go to XLA with one warning (simulated on a GPU of compute
  capability 9.0)."""
  monkeypatch.setattr(_common, "cuda_available", lambda: True)
  monkeypatch.setattr(_common, "compute_capability", lambda: (9, 0))
  monkeypatch.setattr(_common, "_import_triton", _missing)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert jc.codecs.OneBit(2048).kernel_backend(4096) == "pallas"
    assert jc.codecs.OneBit(64).kernel_backend(1000) == "pallas"  # ragged, small buckets
    for _ in range(2):
      assert jc.codecs.QSGD(127, 64).kernel_backend(1000) is None  # 8-bit codes
  fallbacks = [w for w in caught if issubclass(w.category, kernels.KernelFallbackWarning)]
  assert len(fallbacks) == 1 and "no Pallas Triton backend" in str(fallbacks[0].message)


@pytest.mark.parametrize(
  "capability,mosaic_importable,expected",
  [
    ((9, 0), True, "mosaic_gpu"),
    ((8, 0), True, "triton"),  # Mosaic GPU needs sm_90
    ((9, 0), False, "triton"),  # a jax without Mosaic GPU
  ],
)
def test_compiled_backend_choice(monkeypatch, capability, mosaic_importable, expected):
  monkeypatch.setattr(_common, "cuda_available", lambda: True)
  monkeypatch.setattr(_common, "compute_capability", lambda: capability)
  if not mosaic_importable:
    monkeypatch.setattr(_mosaic, "_import_plgpu", _missing)
  assert _common.pick_backend(None, interpret=False) == expected
