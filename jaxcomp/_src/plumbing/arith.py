r"""Exact float32 arithmetic shared by the codecs' XLA path and the kernels.

The low layer under both :mod:`jaxcomp._src.codecs.base` (the XLA path) and
:mod:`jaxcomp.kernels` (Pallas on Mosaic GPU and Triton; native CPU): each function here
is the one definition of a piece of a payload that must come out the same bits on every
path. It imports nothing from jaxcomp but :mod:`jax` and :mod:`numpy`.

* Divisions as multiplications by a correctly rounded reciprocal (:func:`level_step`,
  :func:`inverse_scale`, :func:`level_ratio`): what XLA's algebraic simplifier makes of
  a division by a broadcast anyway, spelled out so no path depends on that rewrite.
* Sums that cannot overflow for finite inputs (:func:`sum_shift`, :func:`side_mean`).
* Bucket statistics in one fixed order (:func:`qsgd_scales`, :func:`onebit_means`): a
  sum's float32 bits depend on the order of its additions, and a reduction's order is
  the backend's (XLA's, or a kernel's), so these are computed here, in XLA, for the XLA
  path and for the Pallas kernels alike (the kernels take them as inputs), with pairwise
  sums written out as element-wise additions (:func:`pairwise_sum`) of products that are
  exact (:func:`exact_square`: XLA contracts some products into FMAs, depending on the
  program around them).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def level_step(scale: Array, levels: int) -> Array:
  """QSGD's decode step ``scale / s``, computed as ``scale * fl(1 / s)``.

  XLA's algebraic simplifier rewrites a division by a constant into a multiplication by
  its float32 reciprocal, so that is what the XLA path computes whatever the source
  says (``scale / 7`` and ``scale * fl(1/7)`` differ in the last bit for some scales).
  Every path (XLA, Pallas, the native CPU kernels) spells out the multiplication, so
  they agree bit for bit without depending on that rewrite.
  """
  inverse = np.float32(1) / np.float32(levels)  # IEEE float32 division: correctly rounded
  return scale * inverse


#: Bucket scales from here up have a subnormal float32 reciprocal, which XLA:CPU (it
#: runs with denormals flushed to zero) would turn into 0, and so the bucket into zeros.
BIG_SCALE = np.float32(2.0**126)


def inverse_scale(safe: Array, *, divide=jnp.divide) -> tuple[Array, Array]:
  """``(inv, k)`` for dividing a bucket by its (positive, finite) scale ``safe``.

  ``k`` is 1, or 1/4 where ``safe >= 2**126``; ``inv = fl(1 / (safe * k))``, correctly
  rounded and never subnormal. A bucket's ratio ``|v| / scale`` is then computed as
  ``fl(|v| * inv)``, which is ``|v| / scale`` times ``1/k`` (see :func:`level_ratio`).

  Why not a division: XLA's algebraic simplifier rewrites ``A / broadcast(B)`` into
  ``A * broadcast(1 / B)``, so that multiplication (not a correctly rounded division)
  is what the XLA path computes whatever the source says; every path (XLA, Pallas,
  the native CPU kernels) spells it out, so they agree bit for bit without depending on
  that rewrite. Why ``k``: without it, a bucket whose max is >= 2**126 would get a
  subnormal reciprocal, flushed to zero on XLA:CPU, and be sent as all zeros.
  ``divide`` is a correctly rounded float32 division: ``jnp.divide`` (XLA's), or a
  kernel backend's spelling of it (``jaxcomp.kernels._common.div``). The numerator is a
  scalar, not ``jnp.ones_like(safe)``: under a mesh with explicit axes (``jax.set_mesh``)
  ``ones_like`` is a ``reshard`` of a literal, which Mosaic GPU's lowering cannot take
  inside a kernel.
  """
  k = jnp.where(safe >= BIG_SCALE, np.float32(0.25), np.float32(1.0))
  inv = divide(np.float32(1.0), safe * k)
  return inv, k


def level_ratio(a: Array, inv: Array, k: Array, levels: int) -> Array:
  """QSGD's ``r = a / scale * s`` (``a = |v| <= scale``) as every path computes it:
  ``fl(fl(a * inv) * fl(s * k))`` with :func:`inverse_scale`'s ``inv, k`` broadcast
  against ``a`` (``s * k`` is exact: ``k`` is a power of two). ``r <= s``: for every
  float32 ``m``, ``m * fl(1 / m) <= 1`` (for some mantissas it is ``1 - 2**-24``, for
  none above 1), so the bucket's max maps to ``s`` or just below it, where
  it rounds down with probability at most ``s * 2**-23``."""
  return a * inv * (np.float32(levels) * k)


FLT_MAX = np.float32(np.finfo(np.float32).max)


def sum_shift(count: int) -> int:
  """``c`` with ``2**c >= 2 * count``: ``count`` float32 values scaled by ``2**-c`` sum
  to at most ``FLT_MAX / 2`` (margin for rounding), so the sum cannot overflow."""
  return (max(int(count), 1) - 1).bit_length() + 1


def side_mean(total: Array, scaled_total: Array, count: Array, shift: int) -> Array:
  """OneBit's mean of one sign's values in a bucket, ``total / count`` (0 when empty).

  ``total`` is their float32 sum, which overflows to ``±inf`` once it passes
  ``FLT_MAX`` although every value is finite (512 values of 1e36 do). Where it did,
  the mean comes from ``scaled_total``, the same values summed after scaling by
  ``2**-shift`` (:func:`sum_shift`: it cannot overflow), as
  ``fl(scaled_total / count) * 2**shift`` clipped to ``±FLT_MAX`` (the mean of finite
  values is finite). Where ``scaled_total`` is not finite either, an input was: the
  mean stays non-finite and the bucket is flagged, never hidden. Power-of-two scaling
  is exact, so this changes nothing where ``total`` is finite.
  """
  safe = jnp.maximum(count, 1.0)
  plain = total / safe
  rescued = jnp.clip(scaled_total / safe * np.float32(2.0**shift), -FLT_MAX, FLT_MAX)
  # |t| <= FLT_MAX is isfinite(t) (NaN compares false).
  finite_total, finite_scaled = jnp.abs(total) <= FLT_MAX, jnp.abs(scaled_total) <= FLT_MAX
  mean = jnp.where(~finite_total & ~jnp.isnan(total) & finite_scaled, rescued, plain)
  return jnp.where(count > 0, mean, 0.0)


def is_power_of_two(v: int) -> bool:
  return v > 0 and v & (v - 1) == 0


# ------------------------------------------------- bucket statistics, in one fixed order

F32 = jnp.float32
WORD = 32  # values per uint32 word of 1-bit codes


def to_buckets(flat: Array, b: int, nb: int) -> Array:
  pad = nb * b - flat.shape[0]
  # No pad op when none is needed: XLA:CPU then reduces the input itself (fast path).
  return (jnp.pad(flat, (0, pad)) if pad else flat).reshape(nb, b)


def row_max_min(v: Array) -> tuple[Array, Array]:
  """``(max, min)`` along axis 1 of ``v`` in one variadic reduction (one pass over ``v``).

  The reducer is ``jnp.maximum`` / ``jnp.minimum``, which propagate NaN (HLO's
  ``maximum``), so a row holding a NaN gets NaN in both results and a row holding an
  infinity an infinite one: the same pass tells :func:`row_absmax_finite` whether the
  row is finite. ``jnp.max`` / ``jnp.min`` would not do: XLA:CPU hands a plain max of
  an input to a library kernel that skips NaNs, and as two reductions it reads ``v``
  twice (the XLA:CPU table of ``docs/benchmarks.md``, the per-bucket rows).
  """
  f = v.dtype.type
  return lax.reduce(
    (v, v),
    (f(-jnp.inf), f(jnp.inf)),
    lambda a, b: (jnp.maximum(a[0], b[0]), jnp.minimum(a[1], b[1])),
    (1,),
  )


def row_absmax_finite(v: Array) -> tuple[Array, Array]:
  """Per row of ``v``: ``max |v|`` and whether the row is all finite, in one pass.

  ``max |v| = max(max v, -min v)``: a reduction of ``abs(v)`` would go through XLA:CPU's
  generic loop emitter, several times slower (the XLA:CPU table of ``docs/benchmarks.md``).
  """
  hi, lo = row_max_min(v)
  return jnp.maximum(hi, -lo), jnp.isfinite(hi) & jnp.isfinite(lo)


def onebit_sums(v: Array, words: Array, *, two_level: bool) -> tuple[Array, Array, Array]:
  """Per bucket (row of ``v``): the sums of ``max(v, 0)`` and ``min(v, 0)`` and the
  count of negative values (float32, exact up to 2**24 per bucket; int32 above).

  The sums of each sign, not the total minus one of them: that would cancel
  catastrophically when one sign dominates a bucket. ``words`` are ``v``'s packed signs
  (1-bit lanes layout, the padding of the last bucket not included).

  * ``two_level=False``: one variadic reduction of whole buckets computes the three in a
    single pass over ``v`` (three ``jnp.sum`` calls are three passes on XLA:CPU).
  * ``two_level=True`` (buckets of whole words, ``32 | bucket``): a variadic reduction
    over rows of 32 values, then plain reductions of the partial sums per bucket; the
    count is the popcount of the bucket's sign words (the padding is +0: no bit set).
    XLA:CPU runs this faster (the XLA:CPU table of ``docs/benchmarks.md``, the OneBit rows).
  """
  nb, b = v.shape
  count_dtype = F32 if b <= 2**24 else jnp.int32
  zero = jnp.zeros((), F32)
  if not two_level:
    return lax.reduce(
      (jnp.maximum(v, 0.0), jnp.minimum(v, 0.0), (v < 0).astype(count_dtype)),
      (zero, zero, jnp.zeros((), count_dtype)),
      lambda x, y: tuple(a + c for a, c in zip(x, y)),
      (1,),
    )
  if b % WORD:
    raise ValueError(f"two-level sums need buckets of whole words, got {b} values")
  pos_part, neg_part = lax.reduce(
    (jnp.maximum(v, 0.0).reshape(-1, WORD), jnp.minimum(v, 0.0).reshape(-1, WORD)),
    (zero, zero),
    lambda x, y: (x[0] + y[0], x[1] + y[1]),
    (1,),
  )
  per_bucket = b // WORD
  bucket_words = jnp.pad(words, (0, nb * per_bucket - words.shape[0]))
  neg_count = jnp.sum(
    lax.population_count(bucket_words).reshape(nb, per_bucket), axis=1, dtype=jnp.int32
  )
  return (
    jnp.sum(pos_part.reshape(nb, per_bucket), axis=1),
    jnp.sum(neg_part.reshape(nb, per_bucket), axis=1),
    neg_count.astype(count_dtype),
  )


def valid_counts(n: int, b: int, nb: int, dtype) -> np.ndarray:
  """How many of the ``n`` values each of ``nb`` buckets of ``b`` holds (the last may be
  short), a numpy constant of ``dtype``."""
  valid = np.full((nb,), b, np.dtype(dtype))
  if nb:
    valid[-1] = n - (nb - 1) * b
  return valid


#: Buckets up to this long (the kernels' largest) are summed in one fixed order.
ORDERED_MAX = 65536


def pairwise_sum(a: Array) -> Array:
  """Sum over the last axis in a fixed order, pairwise.

  The axis is zero-padded to a power of two ``p``; then each step adds the second half
  to the first, element by element (``a[..., :h] + a[..., h:]``), until one value is
  left. Element-wise additions, which XLA neither reorders nor reassociates: the result
  is the same bits in every program that calls this (and it is a pairwise sum, its error
  ``O(log p)`` ulp, not ``O(p)``). Padding with zeros to a longer power of two gives the
  same sum (up to the sign of a zero one), so a kernel's padded bucket and the codec's
  short one agree. Written as halvings of a ``(p / 128, 128)`` view while it is longer
  than 128, which is the same order and which XLA:CPU runs faster.
  """
  b = a.shape[-1]
  p = 1 << max(b - 1, 0).bit_length()
  if p != b:
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, p - b)])
  lanes = min(p, 128)
  a = a.reshape(*a.shape[:-1], p // lanes, lanes)
  while a.shape[-2] > 1:
    h = a.shape[-2] // 2
    a = a[..., :h, :] + a[..., h:, :]
  a = a[..., 0, :]
  while a.shape[-1] > 1:
    h = a.shape[-1] // 2
    a = a[..., :h] + a[..., h:]
  return a[..., 0]


def bucket_sum(v: Array) -> Array:
  """Sum of each row of ``v``: :func:`pairwise_sum`'s up to :data:`ORDERED_MAX` values
  (the order the kernels share), an XLA reduction for longer ones (no kernel takes them:
  one bucket per tensor, where a pairwise tree is several times slower on XLA:CPU)."""
  if v.shape[-1] <= ORDERED_MAX:
    return pairwise_sum(v)
  return jnp.sum(v, axis=-1)


def _pow2(e: Array) -> Array:
  """``2**e`` as float32, for integer ``-126 <= e <= 127`` (built from its bits: exact)."""
  return lax.bitcast_convert_type((e + 127) << 23, F32)


def exact_square(w: Array) -> Array:
  """``w * w`` summed from products that are all exact: ``(hi² + 2 hi lo) + lo²``.

  ``hi`` is ``w`` with its 12 low mantissa bits cleared, ``lo = w - hi``: 12
  significant bits each, so every product has at most 24 and is exact in float32 (for
  ``|w|`` above ``2**-51``, below which a product may underflow). Why not ``w * w``: XLA
  contracts a product feeding an addition into an FMA in some fusions and not in others,
  so ``a * a + b * b`` would round differently from program to program; the
  contraction of an exact product changes nothing.
  """
  hi = lax.bitcast_convert_type(
    lax.bitcast_convert_type(w, jnp.uint32) & np.uint32(0xFFFFF000), F32
  )
  lo = w - hi
  return hi * hi + (hi + hi) * lo + lo * lo


def qsgd_scales(v: Array, norm: str) -> Array:
  """QSGD's scale of each bucket (row) of float32 ``v``: ``max |v|`` or ``||v||_2``;
  NaN for a bucket that holds a NaN or an infinity.

  ``||v|| = 2^e ||v 2^-e||`` with ``2^e <= max |v| < 2^(e+1)`` (``e`` clipped to
  ``-126..126``, so both powers are normal): the scaled values are below 2, so their
  squares neither overflow nor (but for negligible ones) underflow, and scaling by a
  power of two is exact. The squares are :func:`exact_square`'s and their sum
  :func:`bucket_sum`'s, so the scale is the same bits in every program that calls this:
  the XLA path and the kernels' wrappers (the kernels take the scales as inputs).
  """
  amax, finite = row_absmax_finite(v)
  if norm == "max":
    scale = amax
  else:
    e = jnp.clip((lax.bitcast_convert_type(amax, jnp.int32) >> 23) - 127, -126, 126)
    w = v * _pow2(-e)[:, None]
    scale = _pow2(e) * jnp.sqrt(bucket_sum(exact_square(w)))
  return jnp.where(finite, scale, jnp.nan)


def _negative_count(v: Array, words: Array | None, count_dtype) -> Array:
  """Per bucket, how many values are negative: the popcount of the bucket's sign words
  where they are given (and buckets are whole words), else a reduction (exact either way)."""
  nb, b = v.shape
  if words is None or b % WORD:
    return jnp.sum((v < 0).astype(count_dtype), axis=1)
  per_bucket = b // WORD
  bucket_words = jnp.pad(words, (0, nb * per_bucket - words.shape[0]))
  count = jnp.sum(
    lax.population_count(bucket_words).reshape(nb, per_bucket), axis=1, dtype=jnp.int32
  )
  return count.astype(count_dtype)


def side_sums(v: Array, words: Array | None) -> tuple[Array, Array, Array]:
  """OneBit's per-bucket ``(sum of max(v, 0), sum of min(v, 0), negative count)``: the
  sums :func:`pairwise_sum`'s up to :data:`ORDERED_MAX` values, else
  :func:`onebit_sums`'s (the count is exact either way)."""
  b = v.shape[1]
  if b > ORDERED_MAX:
    return onebit_sums(v, words, two_level=b % WORD == 0 and words is not None)
  count_dtype = F32 if b <= 2**24 else jnp.int32
  return (
    pairwise_sum(jnp.maximum(v, 0.0)),
    pairwise_sum(jnp.minimum(v, 0.0)),
    _negative_count(v, words, count_dtype),
  )


def onebit_means(flat: Array, words: Array | None, *, b: int, nb: int) -> tuple[Array, Array]:
  """OneBit's ``(pos, neg)`` means of each bucket of ``b`` of the float32 values ``flat``.

  ``words`` are ``flat``'s packed signs where the caller has them (the XLA path: the
  negative counts are then their popcounts), else ``None``. Padding is +0, counted as
  non-negative, so it is taken out of the counts. A sum past ``FLT_MAX`` (finite values
  from ``~FLT_MAX / b``) is taken again scaled by ``2**-shift``, only when some bucket
  overflowed (:func:`side_mean`). The means are the ``cond``'s outputs, so a decode
  fused after them reads two small arrays; fused into the decode, :func:`side_mean`'s
  arithmetic would be redone per value.
  """
  n = flat.shape[0]
  pos_sum, neg_sum, neg_count = side_sums(to_buckets(flat, b, nb), words)
  pos_count = (jnp.asarray(valid_counts(n, b, nb, neg_count.dtype)) - neg_count).astype(F32)
  neg_count = neg_count.astype(F32)
  shift = sum_shift(b)

  def rescued():  # from `flat`, not the buckets: a branch operand is materialised, and
    down = np.float32(2.0**-shift)  # the buckets are otherwise fused into the sums
    scaled = side_sums(to_buckets(flat * down, b, nb), words)
    return (
      side_mean(pos_sum, scaled[0], pos_count, shift),
      side_mean(neg_sum, scaled[1], neg_count, shift),
    )

  def plain():
    return (
      jnp.where(pos_count > 0, pos_sum / jnp.maximum(pos_count, 1.0), 0.0),
      jnp.where(neg_count > 0, neg_sum / jnp.maximum(neg_count, 1.0), 0.0),
    )

  overflow = jnp.any(jnp.isinf(pos_sum)) | jnp.any(jnp.isinf(neg_sum))
  return lax.cond(overflow, rescued, plain)


def encoded_values(x: Array, residual: Array | None) -> Array:
  """The flat float32 values a codec encodes: ``x``, or with an error-feedback residual
  ``fl_{x.dtype}(x + e)`` (``x + e`` in float32), as :func:`jaxcomp.compress` does."""
  flat = x.reshape(-1).astype(F32)
  if residual is None:
    return flat
  return (flat + residual.reshape(-1)).astype(x.dtype).astype(F32)
