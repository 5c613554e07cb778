r"""The four kernels on Mosaic GPU (``plgpu.kernel``), jax >= 0.12's maintained backend.

Same payloads and arithmetic as the Triton versions
(:mod:`jaxcomp._src.plumbing.arith`: the counter-hash rounding,
:func:`~.arith.inverse_scale`, :func:`~.arith.level_ratio`, :func:`~.arith.level_step`),
another data layout:

* A flat tensor of ``n`` values is read as a ``(n / p, p)`` array, ``p = 32 / bits``
  codes per uint32 word: row ``w`` holds the values packed into word ``w``. A tile of
  :data:`TILE_WORDS` rows (64: Mosaic GPU's row-reduction register layout, ``WGMMA``,
  takes rows in multiples of 64 and columns in multiples of 8) is one warpgroup's
  registers; a word is the sum over its row of ``code << (bits * column)``, a row
  reduction, so packing needs no reshape and no strided access (Mosaic GPU lowers
  neither).
* Encoders run one program per bucket: for QSGD's max norm a first loop over the
  bucket's tiles takes the scale (max and min, the NaN count), then a loop rounds,
  packs and writes (and the new residual). Statistics that are sums (the l2 scale,
  OneBit's means) come in as inputs, computed before the kernel by the XLA path's code
  (:func:`~jaxcomp._src.plumbing.arith.qsgd_scales`,
  :func:`~jaxcomp._src.plumbing.arith.onebit_means`):
  a sum's bits depend on its order, and a reduction's order inside a kernel is the
  backend's. Decoders run one program per tile and loop over the K payloads.

What they take (:func:`misfit`): codes of 1, 2 or 4 bits (``p`` in 32, 16, 8), buckets of
a whole number of tiles (``64 p`` values: 512 for 4-bit QSGD, 1024 for 2-bit, 2048 for
OneBit), and whole buckets (``n`` a multiple of the bucket). Other shapes go to the Triton
kernels where jax still has them, else to the XLA path.

Why these are exact too: Mosaic GPU divides and takes square roots with correct
rounding unless ``CompilerParams(approx_math=True)`` (not set), so no inline PTX is
needed; ``floor`` (which Mosaic GPU does not lower) of a non-negative ratio is its
truncation to an integer. The payloads are the XLA path's bit for bit.

GPU interpret mode (``InterpretGPUParams``) runs these kernels on a CPU; it is imported in
one place, :func:`interpret_params`.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.plumbing import arith
from jaxcomp._src.plumbing import rng

Array = jax.Array
_F32 = jnp.float32
_U32 = jnp.uint32

#: Words (rows) per tile: a multiple of 64 is what the WGMMA register layout takes.
TILE_WORDS = 64
#: The jax whose ``plgpu.kernel`` these kernels are written against and tested with.
MIN_JAX = (0, 12)
#: Mosaic GPU's documented target: Hopper (sm_90) and newer.
MIN_CAPABILITY = (9, 0)


def _import_plgpu():
  from jax.experimental.pallas import mosaic_gpu

  return mosaic_gpu


def interpret_params():
  """Mosaic GPU's interpret-mode parameters (``InterpretGPUParams()``), ``None`` if missing.

  The one import of GPU interpret mode: public as ``plgpu.InterpretGPUParams`` in jax
  0.12, under ``jax._src.pallas.mosaic_gpu.interpret`` in releases that only had it there.
  """
  try:
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
  except ImportError:
    try:
      from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
      return None
  return InterpretGPUParams()


def unavailable(*, interpret: bool, capability: tuple[int, int] | None = None) -> str | None:
  """Why this jax (and GPU) cannot run the Mosaic GPU kernels (``None``: it can);
  ``capability`` is the GPU's CUDA compute capability (``None``: not known)."""
  version = tuple(int(v) for v in jax.__version_info__[:2])
  if version < MIN_JAX:
    return f"jax {jax.__version__} is older than 0.12 (the Mosaic GPU kernels need its plgpu)"
  try:
    plgpu = _import_plgpu()
  except ImportError as e:
    return f"this jax has no Mosaic GPU backend: {e}"
  if not hasattr(plgpu, "kernel"):
    return "this jax's Mosaic GPU backend has no plgpu.kernel"
  if interpret:
    if interpret_params() is None:
      return "this jax has no Mosaic GPU interpret mode (InterpretGPUParams)"
    return None
  cc = capability
  if cc is not None and cc < MIN_CAPABILITY:
    return (
      f"the GPU has compute capability {cc[0]}.{cc[1]}, Mosaic GPU needs "
      f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer"
    )
  return None


def misfit(n: int, bits: int, bucket: int) -> str | None:
  """Why the Mosaic GPU kernels do not take this shape (``None``: they do)."""
  if 32 % bits or (32 // bits) % 8:
    return f"{bits}-bit codes (the Mosaic GPU kernels pack 1, 2 or 4 bits)"
  tile = TILE_WORDS * (32 // bits)
  if bucket % tile:
    return f"bucket_size {bucket} is not a multiple of {tile} (a Mosaic GPU tile)"
  if n % bucket:
    return f"{n} values are not whole buckets of {bucket}"
  return None


def _call(body, args, out_type, grid: int, interpret: bool, name: str):
  plgpu = _import_plgpu()
  body.__name__ = body.__qualname__ = name  # what the lowered kernel is called
  return plgpu.kernel(
    body,
    out_type=out_type,
    grid=(grid,),
    grid_names=("i",),
    interpret=interpret_params() if interpret else None,
  )(*args)


def _iota(shape, dim, dtype=jnp.int32):
  plgpu = _import_plgpu()
  return plgpu.broadcasted_iota(dtype, shape, dim, layout=plgpu.Layout.WGMMA)


def _tile(ref, rows):
  """A ``(TILE_WORDS, p)`` tile of a 2-D ref, in the row-reduction register layout."""
  plgpu = _import_plgpu()
  return plgpu.layout_cast(ref[rows, :], plgpu.Layout.WGMMA)


def _total(a: Array) -> Array:
  """Sum of a tile: rows first (Mosaic GPU reduces a 2-D tile row by row)."""
  return jnp.sum(jnp.sum(a, axis=1))


def _load(x_ref, e_ref, rows):
  """``(v, x32)`` of a tile, as :func:`._common.load_buckets` (no padding here)."""
  x = _tile(x_ref, rows)
  if e_ref is None:
    return x.astype(_F32), None
  x32 = x.astype(_F32) + _tile(e_ref, rows)
  return x32.astype(x.dtype).astype(_F32), x32


def _pack(codes: Array, bits: int) -> Array:
  """Words of a tile of codes: code ``j`` of a row in bits ``j * bits ...`` of its word."""
  shifts = _iota(codes.shape, 1, _U32) * np.uint32(bits)
  return jnp.sum(codes << shifts, axis=1, dtype=_U32)


def _views(x: Array, residual: Array | None, per_word: int):
  args = [x.reshape(-1, per_word)]
  if residual is not None:
    args.append(residual.reshape(-1, per_word))
  return args


def quantize(x, key_words, residual, scales, *, levels, bucket, out_struct, interpret):
  """:func:`jaxcomp.kernels.quantize.quantize` on Mosaic GPU (shape checked by caller).

  ``scales``: the l2 scales, computed before the kernel
  (:func:`jaxcomp._src.plumbing.arith.qsgd_scales`), or ``None`` for the max norm,
  which the kernel takes itself (a max is exact in any order). Returns ``(words,
  [scales if taken here], [new residual])``.
  """
  n = x.size
  mbits = int(levels).bit_length()
  bits = mbits + 1
  per_word = 32 // bits
  chunks = bucket // (TILE_WORDS * per_word)
  words_per_bucket = bucket // per_word
  s = np.float32(levels)
  has_residual = residual is not None
  given = scales is not None

  def body(kw_ref, *refs):
    if given:
      sc_ref, x_ref, *refs = refs
    else:
      x_ref, *refs = refs
    if has_residual:
      e_ref, words_ref, *refs, new_e_ref = refs
    else:
      (words_ref, *refs), e_ref = refs, None
    b = lax.axis_index("i")

    def rows(c):
      return pl_ds(b * words_per_bucket + c * TILE_WORDS, TILE_WORDS)

    if given:
      scale = sc_ref[b]
    else:
      scale = _max_scale(x_ref, e_ref, rows, chunks)
      [scales_ref] = refs
      scales_ref[b] = scale

    positive = scale > 0
    safe = jnp.where(positive, scale, 1.0)
    inv, k = arith.inverse_scale(safe)
    step = arith.level_step(scale, levels)

    def encode(c, carry):
      v, x32 = _load(x_ref, e_ref, rows(c))
      ratio = arith.level_ratio(jnp.abs(v), inv, k, levels)
      r = jnp.where(jnp.broadcast_to(positive, v.shape), ratio, 0.0)  # no implicit broadcast
      low = r.astype(jnp.int32).astype(_F32)  # floor: r >= 0
      shape = v.shape
      idx = (
        _iota(shape, 0) * per_word + _iota(shape, 1) + (b * bucket + c * (TILE_WORDS * per_word))
      )
      u24 = rng.hash_bits(idx.astype(_U32), kw_ref[0], kw_ref[1]) >> 8
      up = u24.astype(_F32) < (r - low) * np.float32(2.0**24)
      magf = jnp.minimum(low + up.astype(_F32), s)
      mag = magf.astype(_U32)
      neg = (v < 0) & (mag > 0)
      codes = mag | (neg.astype(_U32) << mbits)
      words_ref[rows(c)] = _pack(codes, bits)
      if has_residual:
        new_e_ref[rows(c), :] = x32 - jnp.where(neg, -magf, magf) * step
      return carry

    lax.fori_loop(0, chunks, encode, 0)

  nb = n // bucket
  out_type = [out_struct(x, (n // per_word,), _U32)]
  if not given:
    out_type.append(out_struct(x, (nb,), _F32))
  if has_residual:
    out_type.append(out_struct(x, (n // per_word, per_word), _F32))
  args = [key_words, *([scales] if given else []), *_views(x, residual, per_word)]
  outs = _call(body, args, tuple(out_type), nb, interpret, "jaxcomp_quantize")
  if has_residual:
    return (*outs[:-1], outs[-1].reshape(x.shape))
  return tuple(outs)


def _max_scale(x_ref, e_ref, rows, chunks):
  """A bucket's ``max |v|`` from a loop over its tiles, NaN unless all are finite."""

  def stats(c, carry):
    hi, lo, nans = carry
    v, _ = _load(x_ref, e_ref, rows(c))
    return (
      jnp.maximum(hi, jnp.max(jnp.max(v, axis=1))),
      jnp.minimum(lo, jnp.min(jnp.min(v, axis=1))),
      nans + _total(jnp.isnan(v).astype(_F32)),
    )

  init = (np.float32(-np.inf), np.float32(np.inf), np.float32(0))
  vmax, vmin, nans = lax.fori_loop(0, chunks, stats, init)
  # isfinite as |t| <= FLT_MAX (false for NaN and inf): Mosaic GPU lowers no is_finite.
  finite = (nans == 0) & (jnp.abs(vmax) <= arith.FLT_MAX) & (jnp.abs(vmin) <= arith.FLT_MAX)
  return jnp.where(finite, jnp.maximum(vmax, -vmin), jnp.nan)


def sign_pack(x, residual, pos, neg, *, bucket, out_struct, interpret):
  """:func:`jaxcomp.kernels.sign_pack.sign_pack` on Mosaic GPU (shape checked by caller).

  ``pos``, ``neg``: the bucket means, computed before the kernel
  (:func:`jaxcomp._src.plumbing.arith.onebit_means`). Returns ``(words, [new residual])``.
  """
  n = x.size
  per_word = 32
  chunks = bucket // (TILE_WORDS * per_word)
  words_per_bucket = bucket // per_word
  has_residual = residual is not None

  def body(pos_ref, neg_ref, x_ref, *refs):
    if has_residual:
      e_ref, words_ref, new_e_ref = refs
    else:
      (words_ref,), e_ref = refs, None
    b = lax.axis_index("i")
    pos_b, neg_b = pos_ref[b], neg_ref[b]

    def encode(c, carry):
      r = pl_ds(b * words_per_bucket + c * TILE_WORDS, TILE_WORDS)
      v, x32 = _load(x_ref, e_ref, r)
      words_ref[r] = _pack((v < 0).astype(_U32), 1)
      if has_residual:
        new_e_ref[r, :] = x32 - jnp.where(v < 0, neg_b, pos_b)
      return carry

    lax.fori_loop(0, chunks, encode, 0)

  out_type = [out_struct(x, (n // 32,), _U32)]
  if has_residual:
    out_type.append(out_struct(x, (n // 32, 32), _F32))
  args = [pos, neg, *_views(x, residual, per_word)]
  outs = _call(body, args, tuple(out_type), n // bucket, interpret, "jaxcomp_sign_pack")
  if has_residual:
    return (outs[0], outs[1].reshape(x.shape))
  return tuple(outs)


def decode_sum(decode, words, per_bucket, *, n, bits, bucket, out_struct, interpret, name):
  """Sum of K payloads decoded tile by tile, in rank order (as :func:`._common.call_decoder`).

  ``decode(words_column, *bucket_scalars)`` gives one payload's float32 tile from its
  ``(TILE_WORDS, 1)``-broadcastable words and its bucket's per-bucket scalars.
  """
  k = words.shape[0]
  per_word = 32 // bits
  tile = TILE_WORDS * per_word

  def body(words_ref, *refs):
    *row_refs, out_ref = refs
    i = lax.axis_index("i")
    b = (i * tile) // bucket
    shifts = _iota((TILE_WORDS, per_word), 1, _U32) * np.uint32(bits)

    def one(j):
      w = words_ref[j, pl_ds(i * TILE_WORDS, TILE_WORDS)]
      codes = (w[:, None] >> shifts) & np.uint32((1 << bits) - 1)
      return decode(codes, *(r[j, b] for r in row_refs))

    acc = lax.fori_loop(1, k, lambda j, acc: acc + one(j), one(0))
    out_ref[pl_ds(i * TILE_WORDS, TILE_WORDS), :] = acc

  out = _call(
    body,
    [words, *per_bucket.values()],
    out_struct(words, (n // per_word, per_word), _F32),
    n // tile,
    interpret,
    name,
  )
  return out.reshape(n)


def qsgd_decode(levels: int):
  """A tile of QSGD values from its codes and its bucket's scale."""
  mbits = int(levels).bit_length()

  def decode(codes, scale):
    mag = (codes & np.uint32((1 << mbits) - 1)).astype(_F32)
    q = jnp.where((codes >> mbits) != 0, -mag, mag)
    return q * arith.level_step(scale, levels)

  return decode


def onebit_decode(bits, pos, neg):
  """A tile of OneBit values from its sign bits and its bucket's two means."""
  return jnp.where(bits != 0, neg, pos)


def pl_ds(start, size):
  from jax.experimental import pallas as pl

  return pl.ds(start, size)


__all__ = [
  "MIN_CAPABILITY",
  "MIN_JAX",
  "TILE_WORDS",
  "interpret_params",
  "misfit",
  "unavailable",
]
