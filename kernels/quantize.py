r"""QSGD quantization in one pass: bucket scale, stochastic rounding, sign, bit packing.

Per bucket ``v`` of ``bucket_size`` consecutive values (the last one zero-padded),
with ``s = levels`` and ``m = ceil(log2(s + 1))`` magnitude bits:

.. math::
  \sigma = \max_i |v_i| \;(\texttt{norm="max"}) \quad\text{or}\quad
  \sigma = a \sqrt{\textstyle\sum_i (v_i / a)^2},\; a = \max_i |v_i| \;(\texttt{"l2"}),

  \xi_i = \min\!\big(\lfloor r_i \rfloor + [u_i < r_i - \lfloor r_i \rfloor],\; s\big),
  \quad r_i = |v_i| / \sigma \cdot s, \qquad
  \mathrm{code}_i = \xi_i \,|\, [v_i < 0 \wedge \xi_i > 0] \ll m,

where ``u_i = (h(i) >> 8) 2^{-24}`` is :mod:`jaxcomp._src.plumbing.rng`'s counter hash of the
value's flat index ``i`` under the key: no random numbers are read from memory. Codes
are packed ``32 / (m + 1)`` per uint32 word (the lanes layout of
:mod:`jaxcomp._src.plumbing.bitpack`), so the kernel writes exactly the payload of
:class:`jaxcomp.codecs.QSGD` and its ``decode`` is shared: ``words`` and ``scales`` are
bit-identical to the XLA path's (``QSGD(..., implementation="xla").encode``) for the
same key. The l2 scale is a sum,
whose float32 value depends on the order of its additions: the wrapper computes it in
XLA before the kernel, with the XLA path's own code
(:func:`jaxcomp._src.plumbing.arith.qsgd_scales`: exact squares, a pairwise sum), and the
kernel takes it as an input; the max scale (exact in any order) the kernel takes itself.

Fused error feedback: with ``residual=e``, the kernel quantizes
``v = fl_{dtype}(x + e)`` (``x + e`` in float32, rounded to ``x``'s dtype, as
:func:`jaxcomp.compress` does) and also returns ``e' = (x + e) - Q(v)`` in float32: one
read of ``x`` and ``e``, one write of ``e'`` and of the payload, instead of a separate
add, encode and decode.

A bucket holding NaN or Inf gets a NaN scale (it decodes to NaN, never hidden), its
codes are zero, and its residual is NaN (:func:`jaxcomp.compress` then keeps the old one).

Example (interpret mode, as on a machine without a GPU):

>>> import jax, jax.numpy as jnp, jaxcomp as jc
>>> from jaxcomp.kernels import quantize
>>> x, key = jnp.linspace(-1.0, 1.0, 1000), jax.random.key(0)
>>> words, scales = quantize.quantize(x, key, levels=7, bucket_size=256, interpret=True)
>>> words.shape, scales.shape  # 1000 4-bit codes, 4 buckets
((125,), (4,))
>>> ref = jc.codecs.QSGD(7, 256, "max", implementation="xla").encode(x, key=key).arrays
>>> bool((words == ref["words"]).all() and (scales == ref["scales"]).all())
True

Reference: Alistarh et al., *QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding*, NeurIPS 2017, https://arxiv.org/abs/1610.02132: Section
3.1 (the stochastic quantizer) and Section 4 (buckets, scaling by the bucket's max).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from jaxcomp._src.plumbing import arith
from jaxcomp._src.plumbing import bitpack
from jaxcomp._src.plumbing import rng

from . import _common
from . import _mosaic

Array = jax.Array
_F32 = jnp.float32
_U32 = jnp.uint32

QuantizeConfig = _common.LaunchConfig

DTYPES = _common.DTYPES


def bits_per_value(levels: int) -> int:
  """Bits of one code: ``ceil(log2(levels + 1))`` magnitude bits and a sign bit."""
  return int(levels).bit_length() + 1


def unsupported(n: int, *, levels: int, bucket_size: int | None, dtype) -> str | None:
  """Why the kernel cannot quantize this tensor (``None`` when it can).

  Besides :func:`~jaxcomp.kernels._common.unsupported_bucketing`'s conditions, the
  code width must divide 32 (2, 4, 8 or 16 bits: ``levels`` in 1, 3..7, 15..127,
  32767..).
  """
  bits = bits_per_value(levels)
  if not bitpack.uses_lanes(bits) or bits > 16:
    return f"{bits}-bit codes (the kernel packs 2, 4, 8 or 16 bits)"
  return _common.unsupported_bucketing(n, bucket_size, dtype)


def _quantize_kernel(kw_ref, *refs, n, bucket, rows, levels, norm, exact_asm, has_residual):
  if norm == "l2":  # the scales come in (computed in XLA: arith.qsgd_scales)
    sc_ref, x_ref, *refs = refs
  else:
    x_ref, *refs = refs
  if has_residual:
    e_ref, words_ref, *refs, new_e_ref = refs
  else:
    (words_ref, *refs), e_ref = refs, None
  length = rows * bucket
  mbits = int(levels).bit_length()
  bits = mbits + 1
  per_word = 32 // bits
  s = jnp.float32(levels)

  _, idx, v, x32 = _common.load_buckets(x_ref, e_ref, n=n, rows=rows, bucket=bucket)

  if norm == "l2":
    scale = sc_ref[...]
  else:
    # max |v| as max(max v, -min v); NaN when the bucket is not all finite. NaNs are
    # counted (a max may skip them); not summed: large finite values of both signs can
    # sum to inf - inf = NaN, which would flag a finite bucket as NaN. A max is exact in
    # any order: this is the XLA path's scale, bit for bit.
    vmax = jnp.max(v, axis=1)
    vmin = jnp.min(v, axis=1)
    nans = jnp.sum(jnp.isnan(v).astype(_F32), axis=1)
    finite = (nans == 0) & jnp.isfinite(vmax) & jnp.isfinite(vmin)
    scale = jnp.where(finite, jnp.maximum(vmax, -vmin), jnp.nan)
    [scales_ref] = refs
    scales_ref[...] = scale

  # Stochastic rounding with the counter hash of the flat (padded) index.
  positive = scale > 0
  safe = jnp.where(positive, scale, 1.0)
  inv, k = arith.inverse_scale(safe, divide=functools.partial(_common.div, exact_asm=exact_asm))
  r = jnp.where(
    positive[:, None], arith.level_ratio(jnp.abs(v), inv[:, None], k[:, None], levels), 0.0
  )
  low = jnp.floor(r)
  u24 = rng.hash_bits(idx.astype(_U32), kw_ref[0], kw_ref[1]) >> 8
  up = u24.astype(_F32) < (r - low) * jnp.float32(2.0**24)
  magf = jnp.minimum(low + up.astype(_F32), s)
  mag = magf.astype(_U32)
  neg = (v < 0) & (mag > 0)
  codes = mag | (neg.astype(_U32) << mbits)

  # Lanes packing: per_word consecutive codes per word, code j in bits j*bits...
  lanes = codes.reshape(length // per_word, per_word)
  shifts = lax.broadcasted_iota(_U32, lanes.shape, 1) * jnp.uint32(bits)
  words_ref[...] = jnp.sum(lanes << shifts, axis=1, dtype=_U32)

  if has_residual:
    step = arith.level_step(scale, levels)
    sent = jnp.where(neg, -magf, magf) * step[:, None]
    new_e_ref[...] = (x32 - sent).reshape(length)


@functools.partial(
  jax.jit, static_argnames=("levels", "bucket_size", "norm", "config", "interpret", "backend")
)
def quantize(
  x: Array,
  key: Array,
  residual: Array | None = None,
  *,
  levels: int,
  bucket_size: int,
  norm: str = "max",
  config: QuantizeConfig = QuantizeConfig(),
  interpret: bool | None = None,
  backend: str | None = None,
) -> tuple[Array, ...]:
  """Quantizes ``x`` into QSGD's packed words and per-bucket scales in one pass.

  Args:
    x: float32/bfloat16/float16 array (flattened row-major).
    key: the tensor's PRNG key (typed or raw), as for ``QSGD.encode``.
    residual: optional float32 error-feedback residual of ``x``'s shape.
    levels: ``s``, levels per sign; the code width must divide 32.
    bucket_size: values per bucket, a power of two in 32..65536.
    norm: ``"max"`` or ``"l2"``.
    config: block size and Triton launch parameters (the Triton kernel's).
    interpret: run in Pallas interpret mode (default: unless on a CUDA GPU).
    backend: ``"mosaic_gpu"``, ``"triton"`` or ``None``: Mosaic GPU where it takes the
      shape (:func:`jaxcomp.kernels._mosaic.misfit`) and this jax runs it, else Triton.

  Returns:
    ``(words, scales)`` (uint32 ``(ceil(n * bits / 32),)``, float32
    ``(ceil(n / bucket_size),)``), plus the new float32 residual of ``x``'s shape when
    ``residual`` is given.
  """
  if norm not in ("max", "l2"):
    raise ValueError(f"norm must be 'max' or 'l2', got {norm!r}")
  n = x.size
  why = unsupported(n, levels=levels, bucket_size=bucket_size, dtype=x.dtype)
  if why is not None:
    raise ValueError(f"the quantize kernel does not handle this input: {why}")
  interpret = _common.resolve_interpret(interpret)
  _common.check_interpretable(interpret, x, key, residual)
  _common.check_residual(x, residual)
  bits = bits_per_value(levels)
  scales = None
  if norm == "l2":  # a sum: computed in XLA, in the XLA path's order, by its code
    b = min(bucket_size, n)  # the codec's buckets (one short one when n < bucket_size)
    v = arith.encoded_values(x, residual)
    scales = arith.qsgd_scales(arith.to_buckets(v, b, -(-n // b)), "l2")
  misfit = _mosaic.misfit(n, bits, bucket_size)
  if _common.pick_backend(misfit, interpret=interpret, backend=backend) == "mosaic_gpu":
    outs = _mosaic.quantize(
      x,
      _common.key_words_array(key),
      residual,
      scales,
      levels=levels,
      bucket=bucket_size,
      out_struct=_common.out_struct,
      interpret=interpret,
    )
  else:
    outs = _triton_quantize(x, key, residual, scales, levels, bucket_size, config, interpret)
  if scales is None:
    return outs
  return (outs[0], scales, *outs[1:])


def _triton_quantize(x, key, residual, scales, levels, bucket_size, config, interpret):
  """The Triton kernel's ``(words, [scales if computed inside], [residual])``."""
  n = x.size
  bits = bits_per_value(levels)
  rows = config.rows(bucket_size)
  kernel = functools.partial(
    _quantize_kernel,
    n=n,
    bucket=bucket_size,
    rows=rows,
    levels=levels,
    norm="max" if scales is None else "l2",
    exact_asm=not interpret,
    has_residual=residual is not None,
  )
  outputs = [((bitpack.num_words(n, bits),), _U32, rows * bucket_size * bits // 32)]
  if scales is None:
    outputs.append(((-(-n // bucket_size),), _F32, rows))
  return _common.call_encoder(
    kernel,
    x,
    residual,
    name="jaxcomp_quantize",
    bucket=bucket_size,
    config=config,
    interpret=interpret,
    lead=(_common.key_words_array(key),),
    per_bucket=() if scales is None else (scales,),
    outputs=outputs,
  )
