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
  backend's. So does the max scale of buckets smaller than a tile (a max is exact in
  any order: the same bits). Decoders run one program per tile and loop over the K
  payloads.

What they take (:func:`misfit`): codes of 1, 2 or 4 bits (``p`` in 32, 16, 8), any
``n`` and every bucket the codecs accept: buckets of a whole number of tiles (``64 p``
values: 512 for 4-bit QSGD, 1024 for 2-bit, 2048 for OneBit) get a program each, smaller
ones share a tile and read their scalars per word, and a ragged tail is zero-padded
(:class:`_Layout`). 8- and 16-bit codes go to the Triton kernels where jax < 0.12 or the
GPU needs them, else to the XLA path (:func:`._common.pick_backend`).

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
  """Why the Mosaic GPU kernels do not take this shape (``None``: they do).

  Any ``n`` and any bucket the codecs accept (:func:`._common.unsupported_bucketing`)
  fit: only the code width matters (a tile's row is one word of ``p = 32 / bits`` codes,
  and the register layout takes columns in multiples of 8).
  """
  del n, bucket
  if 32 % bits or (32 // bits) % 8:
    return f"{bits}-bit codes (the Mosaic GPU kernels pack 1, 2 or 4 bits)"
  return None


class _Layout:
  """Where a tensor's buckets fall in the kernel's grid of tiles.

  Buckets of a whole number of tiles (``bucket % tile == 0``, ``tile = 64 p`` values)
  get one program each, which loops over the bucket's tiles and reads its scalars (scale,
  means) at its index. Smaller buckets (32 to ``tile / 2`` values: a power of two, so a
  tile holds a whole number of them and a word never straddles two) get one program
  per tile, which reads each row's scalars from a per-word copy (:meth:`each_word`): a
  tile's rows belong to ``64 p / bucket`` buckets, and Mosaic GPU has no segmented
  reduction or register gather to find a row's bucket inside the kernel.

  A ragged tensor (``n`` not a whole number of programs) is zero-padded up to one
  (:meth:`pad`): a padded value encodes to code 0 (``v = 0``: no sign, no magnitude), as
  the XLA path's padding does, it counts in no scale (``max |v|`` ignores a zero; the l2
  scales and OneBit's means come in computed by the XLA path's code), and the outputs are
  cut back to the payload's length. The padding costs a copy of the tensor (XLA's pad
  and slice around the kernel), where whole buckets cost none.
  """

  def __init__(self, n: int, bits: int, bucket: int):
    self.n, self.bits, self.bucket = n, bits, bucket
    self.per_word = 32 // bits
    self.tile = TILE_WORDS * self.per_word
    self.whole = bucket % self.tile == 0
    self.nb = -(-n // bucket)
    step = bucket if self.whole else self.tile
    self.padded = -(-n // step) * step
    self.grid = self.padded // step
    self.chunks = bucket // self.tile if self.whole else 1
    self.words = self.padded // self.per_word

  def pad(self, flat: Array) -> Array:
    """A flat ``(n,)`` array zero-padded to whole programs, as ``(words, p)`` rows."""
    if self.padded > self.n:
      flat = jnp.pad(flat, (0, self.padded - self.n))
    return flat.reshape(self.words, self.per_word)

  def each_word(self, a: Array) -> Array:
    """Per-bucket scalars (``(..., nb)``) repeated for each word of their bucket."""
    a = jnp.repeat(a, self.bucket // self.per_word, axis=-1)
    extra = self.words - a.shape[-1]
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)]) if extra else a

  def rows(self, program, chunk):
    """The ``TILE_WORDS`` rows (words) of chunk ``chunk`` of program ``program``."""
    if self.whole:
      return pl_ds(program * (self.bucket // self.per_word) + chunk * TILE_WORDS, TILE_WORDS)
    return pl_ds(program * TILE_WORDS, TILE_WORDS)

  def first(self, program, chunk):
    """Flat index of the first value of that tile."""
    return program * (self.chunks * self.tile) + chunk * self.tile

  def scalar(self, ref, program):
    """An encoder program's bucket scalar from ``ref``: the value at its bucket (whole
    buckets), or a ``(TILE_WORDS, p)`` tile of its rows' values (``ref`` then per word)."""
    if self.whole:
      return ref[program]
    row = ref[self.rows(program, 0)]
    return jnp.broadcast_to(row[:, None], (TILE_WORDS, self.per_word))


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


def _load(x_ref, e_ref, rows, dtype):
  """``(v, x32)`` of a tile, as :func:`._common.load_buckets` (padding is zeros here);
  ``dtype`` is the tensor's (``x_ref`` may hold it widened: :func:`_views`)."""
  x = _tile(x_ref, rows).astype(_F32)
  if e_ref is None:
    return x, None
  x32 = x + _tile(e_ref, rows)
  return x32.astype(dtype).astype(_F32), x32


def _pack(codes: Array, bits: int) -> Array:
  """Words of a tile of codes: code ``j`` of a row in bits ``j * bits ...`` of its word."""
  shifts = _iota(codes.shape, 1, _U32) * np.uint32(bits)
  return jnp.sum(codes << shifts, axis=1, dtype=_U32)


def _views(layout: _Layout, x: Array, residual: Array | None):
  """The kernel's ``(words, p)`` views of ``x`` and the residual.

  A 16-bit ``x`` is widened to float32 (exactly) where a row holds 16 or 32 values:
  Mosaic GPU does not lower a load of such a tile of 16-bit values in the row-reduction
  layout ("GMEM transfer does not access a whole number of complete 32 byte sectors"),
  so 1- and 2-bit codes of bfloat16/float16 inputs pay one conversion pass before the
  kernel.
  """
  flat = x.reshape(-1)
  if flat.dtype.itemsize == 2 and layout.per_word >= 16:
    flat = flat.astype(_F32)
  args = [layout.pad(flat)]
  if residual is not None:
    args.append(layout.pad(residual.reshape(-1)))
  return args


def _unpad(layout: _Layout, words: Array, new_residual: Array | None, shape):
  """The payload's words (``ceil(n bits / 32)``) and the residual in ``x``'s shape."""
  words = words[: -(-layout.n * layout.bits // 32)]
  if new_residual is None:
    return words, None
  return words, new_residual.reshape(-1)[: layout.n].reshape(shape)


def quantize(x, key_words, residual, scales, *, levels, bucket, out_struct, interpret):
  """:func:`jaxcomp.kernels.quantize.quantize` on Mosaic GPU (shape checked by caller).

  ``scales``: the l2 scales, computed before the kernel
  (:func:`jaxcomp._src.plumbing.arith.qsgd_scales`), or ``None`` for the max norm,
  which the kernel takes itself (a max is exact in any order) where buckets are whole
  tiles; smaller buckets take it before the kernel, with the same code. Returns
  ``(words, [scales if not given], [new residual])``.
  """
  n = x.size
  mbits = int(levels).bit_length()
  bits = mbits + 1
  layout = _Layout(n, bits, bucket)
  per_word = layout.per_word
  s = np.float32(levels)
  has_residual = residual is not None
  given = scales is not None
  if not given and not layout.whole:
    b = min(bucket, n)  # the codec's buckets (one short one when n < bucket)
    v = arith.encoded_values(x, residual)
    scales = arith.qsgd_scales(arith.to_buckets(v, b, -(-n // b)), "max")
  outside = scales is not None  # the scales come in

  def body(kw_ref, *refs):
    if outside:
      sc_ref, x_ref, *refs = refs
    else:
      x_ref, *refs = refs
    if has_residual:
      e_ref, words_ref, *refs, new_e_ref = refs
    else:
      (words_ref, *refs), e_ref = refs, None
    b = lax.axis_index("i")

    if outside:
      scale = layout.scalar(sc_ref, b)
    else:
      scale = _max_scale(x_ref, e_ref, lambda c: layout.rows(b, c), layout.chunks, x.dtype)
      [scales_ref] = refs
      scales_ref[b] = scale

    positive = scale > 0
    safe = jnp.where(positive, scale, 1.0)
    inv, k = arith.inverse_scale(safe)
    step = arith.level_step(scale, levels)

    def encode(c, carry):
      rows = layout.rows(b, c)
      v, x32 = _load(x_ref, e_ref, rows, x.dtype)
      ratio = arith.level_ratio(jnp.abs(v), inv, k, levels)
      r = jnp.where(jnp.broadcast_to(positive, v.shape), ratio, 0.0)  # no implicit broadcast
      low = r.astype(jnp.int32).astype(_F32)  # floor: r >= 0
      shape = v.shape
      idx = _iota(shape, 0) * per_word + _iota(shape, 1) + layout.first(b, c)
      u24 = rng.hash_bits(idx.astype(_U32), kw_ref[0], kw_ref[1]) >> 8
      up = u24.astype(_F32) < (r - low) * np.float32(2.0**24)
      magf = jnp.minimum(low + up.astype(_F32), s)
      mag = magf.astype(_U32)
      neg = (v < 0) & (mag > 0)
      codes = mag | (neg.astype(_U32) << mbits)
      words_ref[rows] = _pack(codes, bits)
      if has_residual:
        new_e_ref[rows, :] = x32 - jnp.where(neg, -magf, magf) * step
      return carry

    lax.fori_loop(0, layout.chunks, encode, 0)

  out_type = [out_struct(x, (layout.words,), _U32)]
  if not outside:
    out_type.append(out_struct(x, (layout.nb,), _F32))
  if has_residual:
    out_type.append(out_struct(x, (layout.words, per_word), _F32))
  lead = [scales if layout.whole else layout.each_word(scales)] if outside else []
  args = [key_words, *lead, *_views(layout, x, residual)]
  outs = _call(body, args, tuple(out_type), layout.grid, interpret, "jaxcomp_quantize")
  words, new_residual = _unpad(layout, outs[0], outs[-1] if has_residual else None, x.shape)
  taken = [] if given else [outs[1] if not outside else scales]
  return (words, *taken, *([new_residual] if has_residual else []))


def _max_scale(x_ref, e_ref, rows, chunks, dtype):
  """A bucket's ``max |v|`` from a loop over its tiles, NaN unless all are finite."""

  def stats(c, carry):
    hi, lo, nans = carry
    v, _ = _load(x_ref, e_ref, rows(c), dtype)
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
  layout = _Layout(x.size, 1, bucket)
  has_residual = residual is not None

  def body(pos_ref, neg_ref, x_ref, *refs):
    if has_residual:
      e_ref, words_ref, new_e_ref = refs
    else:
      (words_ref,), e_ref = refs, None
    b = lax.axis_index("i")
    pos_b, neg_b = layout.scalar(pos_ref, b), layout.scalar(neg_ref, b)

    def encode(c, carry):
      r = layout.rows(b, c)
      v, x32 = _load(x_ref, e_ref, r, x.dtype)
      words_ref[r] = _pack((v < 0).astype(_U32), 1)
      if has_residual:
        new_e_ref[r, :] = x32 - jnp.where(v < 0, neg_b, pos_b)
      return carry

    lax.fori_loop(0, layout.chunks, encode, 0)

  out_type = [out_struct(x, (layout.words,), _U32)]
  if has_residual:
    out_type.append(out_struct(x, (layout.words, 32), _F32))
  means = [pos, neg] if layout.whole else [layout.each_word(pos), layout.each_word(neg)]
  args = [*means, *_views(layout, x, residual)]
  outs = _call(body, args, tuple(out_type), layout.grid, interpret, "jaxcomp_sign_pack")
  words, new_residual = _unpad(layout, outs[0], outs[1] if has_residual else None, x.shape)
  return (words, new_residual) if has_residual else (words,)


def decode_sum(decode, words, per_bucket, *, n, bits, bucket, out_struct, interpret, name):
  """Sum of K payloads decoded tile by tile, in rank order (as :func:`._common.call_decoder`).

  ``decode(codes, *bucket_scalars)`` gives one payload's float32 ``(TILE_WORDS, p)``
  tile from its codes and its bucket's scalars (scalars for whole-tile buckets, tiles of
  each row's values for smaller ones: :class:`_Layout`). Ragged payloads are padded
  with zero words to whole programs, the sum cut back to ``n``.
  """
  k = words.shape[0]
  layout = _Layout(n, bits, bucket)
  per_word = layout.per_word

  def body(words_ref, *refs):
    *row_refs, out_ref = refs
    i = lax.axis_index("i")  # one program per tile
    rows = pl_ds(i * TILE_WORDS, TILE_WORDS)
    b = (i * layout.tile) // bucket
    shifts = _iota((TILE_WORDS, per_word), 1, _U32) * np.uint32(bits)

    def scalar(ref, j):
      if layout.whole:
        return ref[j, b]
      return jnp.broadcast_to(ref[j, rows][:, None], (TILE_WORDS, per_word))

    def one(j):
      w = words_ref[j, rows]
      codes = (w[:, None] >> shifts) & np.uint32((1 << bits) - 1)
      return decode(codes, *(scalar(r, j) for r in row_refs))

    out_ref[rows, :] = lax.fori_loop(1, k, lambda j, acc: acc + one(j), one(0))

  if words.shape[1] < layout.words:
    words = jnp.pad(words, ((0, 0), (0, layout.words - words.shape[1])))
  rows = [a if layout.whole else layout.each_word(a) for a in per_bucket.values()]
  out = _call(
    body,
    [words, *rows],
    out_struct(words, (layout.words, per_word), _F32),
    layout.words // TILE_WORDS,
    interpret,
    name,
  )
  return out.reshape(-1)[:n]


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
