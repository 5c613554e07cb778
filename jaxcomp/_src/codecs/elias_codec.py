r"""QSGD with Elias recursive coding on device: a jit-able encoder into a fixed capacity.

The stream is the QSGD string format of :mod:`jaxcomp._src.codecs.elias` (the host codec), bit
for bit: per bucket, 32 bits of the float32 scale, then for each non-zero code
``omega(gap) · sign · omega(s·ξ_i)``, then the sentinel ``omega(b - last)``; bit ``t`` of
the stream is bit ``31 - t % 32`` of word ``t // 32``.

Encoding is data-parallel (no loop over entries):

1. per entry, the gap to the previous non-zero of its bucket (a ``cummax``), and the
   code length ``L(gap) + 1 + L(m)`` (omega lengths from bit lengths);
2. an exclusive prefix sum of the lengths gives every code's bit offset;
3. every code is assembled left-aligned in 64 bits (two uint32) and added into the
   word buffer with three scatter-adds (its bits are disjoint from every other code's,
   so adding is OR-ing).

The buffer has a static capacity; bits beyond it are dropped and the payload says it
overflowed (``encode_with_info``). Never silently: :func:`jaxcomp.compress` then sends
the fixed-width QSGD payload of the *same* quantization instead (see
:class:`EliasQSGD`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.codecs import base as codecs_lib
from jaxcomp._src.codecs import elias
from jaxcomp._src.codecs.base import Array
from jaxcomp._src.codecs.base import Payload

_U32 = jnp.uint32
_MAX_GROUPS = 6  # omega groups of a 32-bit integer: 32 -> 5 -> 2 (+ terminator) ...
_MARGIN = 1.05  # capacity over the expected-length bound (the bound is on the mean)


def bit_length(k: Array) -> Array:
  """Bit length of uint32 values (0 for 0), int32."""
  return (32 - lax.clz(k.astype(_U32))).astype(jnp.int32)


def _or_shifted(hi: Array, lo: Array, v: Array, shift: Array) -> tuple[Array, Array]:
  """(hi, lo) | (v << shift) for a uint32 v and 0 <= shift < 64 (as a 64-bit value)."""
  s = shift.astype(_U32)
  lo_part = jnp.where(s < 32, v << jnp.minimum(s, 31), _U32(0))
  hi_from_lo = jnp.where((s > 0) & (s < 32), v >> (32 - jnp.clip(s, 1, 31)), _U32(0))
  hi_part = jnp.where((s >= 32) & (s < 64), v << jnp.clip(s - 32, 0, 31), _U32(0))
  return hi | hi_from_lo | hi_part, lo | lo_part


def _shl64(hi: Array, lo: Array, shift: Array) -> tuple[Array, Array]:
  """(hi, lo) << shift, 0 <= shift < 64."""
  s = shift.astype(_U32)
  small = s < 32
  ss = jnp.minimum(s, 31)
  hi_small = (hi << ss) | jnp.where(ss > 0, lo >> (32 - jnp.maximum(ss, 1)), _U32(0))
  hi_big = lo << jnp.clip(s - 32, 0, 31)
  return (jnp.where(small, hi_small, hi_big), jnp.where(small, lo << ss, _U32(0)))


def omega_code(
  k: Array, tail: Array | None = None, tail_bits: int = 0
) -> tuple[Array, Array, Array]:
  """Left-aligned 64-bit Elias omega code of ``k >= 1``, optionally followed by bits.

  Returns ``(hi, lo, length)``: the code's first bit is bit 31 of ``hi``. ``tail`` (a
  uint32 of ``tail_bits`` bits) is appended after the code (the sign bit).
  """
  k = k.astype(_U32)
  hi = jnp.zeros_like(k)
  lo = jnp.zeros_like(k)
  length = jnp.full(k.shape, 1 + tail_bits, jnp.int32)  # terminator 0 (+ tail)
  if tail is not None:
    lo = tail.astype(_U32)
  cur = k
  for _ in range(_MAX_GROUPS):
    group = cur > 1
    bl = bit_length(cur)
    new_hi, new_lo = _or_shifted(hi, lo, cur, length)
    hi = jnp.where(group, new_hi, hi)
    lo = jnp.where(group, new_lo, lo)
    length = length + jnp.where(group, bl, 0)
    cur = jnp.where(group, (bl - 1).astype(_U32), _U32(0))
  hi, lo = _shl64(hi, lo, 64 - length)
  return hi, lo, length


def _scatter_code(words: Array, offset: Array, hi: Array, lo: Array, valid: Array) -> Array:
  """Adds left-aligned 64-bit codes at bit offsets into a word buffer (drops overflow)."""
  cap = words.shape[0]
  w = jnp.where(valid, offset // 32, cap).astype(jnp.int32)  # cap = dropped
  r = (offset % 32).astype(_U32)
  rr = jnp.maximum(r, 1)
  w0 = hi >> r
  w1 = jnp.where(r > 0, (hi << (32 - rr)) | (lo >> rr), lo)
  w2 = jnp.where(r > 0, lo << (32 - rr), _U32(0))
  flat = lambda a: a.reshape(-1)
  words = words.at[flat(w)].add(flat(w0), mode="drop")
  words = words.at[flat(w + 1)].add(flat(w1), mode="drop")
  words = words.at[flat(w + 2)].add(flat(w2), mode="drop")
  return words


def stream_words(
  scales: Array, mags: Array, negative: Array, lengths: tuple[int, ...], capacity_words: int
) -> tuple[Array, Array]:
  """Elias-codes a bucketed QSGD quantization: (uint32 words, used bits int32).

  Args:
    scales: ``(nb,)`` float32 bucket scales.
    mags: ``(nb, b)`` uint32 magnitudes (0 on the padding).
    negative: ``(nb, b)`` bool signs.
    lengths: the static length of each bucket (the last may be shorter than b).
    capacity_words: size of the buffer; bits past it are dropped.
  """
  nb, b = mags.shape
  blen = jnp.asarray(np.asarray(lengths, np.int32))
  pos = jnp.arange(b, dtype=jnp.int32)
  nz = mags > 0
  marked = jnp.where(nz, pos[None, :], -1)
  last_incl = lax.cummax(marked, axis=1)
  prev = jnp.concatenate([jnp.full((nb, 1), -1, jnp.int32), last_incl[:, :-1]], axis=1)
  gap = (pos[None, :] - prev).astype(_U32)
  code_hi, code_lo, code_len = omega_code(gap, negative.astype(_U32), 1)
  mag_hi, mag_lo, mag_len = omega_code(jnp.maximum(mags, 1))
  entry_len = jnp.where(nz, code_len + mag_len, 0)
  sentinel = (blen - last_incl[:, -1]).astype(_U32)
  s_hi, s_lo, s_len = omega_code(sentinel)
  body = jnp.sum(entry_len, axis=1)
  bucket_bits = 32 + body + s_len
  starts = jnp.cumsum(bucket_bits) - bucket_bits
  within = jnp.cumsum(entry_len, axis=1) - entry_len
  offset = starts[:, None] + 32 + within
  words = jnp.zeros((capacity_words,), _U32)
  scale_bits = lax.bitcast_convert_type(scales.astype(jnp.float32), _U32)
  valid_bucket = jnp.ones((nb,), bool)
  words = _scatter_code(words, starts, scale_bits, jnp.zeros_like(scale_bits), valid_bucket)
  words = _scatter_code(words, offset, code_hi, code_lo, nz)
  # The magnitude's code follows the gap+sign code; it is written as its own code.
  words = _scatter_code(words, offset + code_len, mag_hi, mag_lo, nz)
  words = _scatter_code(words, starts + 32 + body, s_hi, s_lo, valid_bucket)
  used = jnp.sum(bucket_bits).astype(jnp.int32)
  return words, used


def default_capacity_bits(n: int, levels: int, fixed_bits: int, norm: str = "l2") -> int:
  """Buffer bits of one bucket of n values (the default rule of :class:`EliasQSGD`)."""
  if norm != "l2":  # Theorem 3.2 needs the l2 norm; without a bound, no smaller default
    return int(fixed_bits)
  bound = elias.theorem_3_2_bound(n, levels)
  if levels <= math.sqrt(n):
    # Corollary 3.3's figure: what typical (Gaussian-like) gradients take, not a bound
    # for every input (flat magnitudes take up to elias.dense_bound); those overflow.
    bound = min(bound, 2.8 * n + 32)
  bound *= _MARGIN
  sentinel = int(elias.omega_length(n + 1))
  return int(min(fixed_bits, math.ceil(bound) + sentinel))


@dataclasses.dataclass(frozen=True)
class EliasQSGD(codecs_lib.Codec):
  r"""QSGD whose codes travel Elias-coded (the paper's string format), encoded on device.

  The quantization is :class:`jaxcomp.codecs.QSGD`'s, draw for draw (the same key gives
  the same ``s·ξ_i``); only the wire format differs: the QSGD string of
  :mod:`jaxcomp._src.codecs.elias` (per bucket the 32-bit scale, then
  ``omega(gap) · sign · omega(s·ξ_i)`` per non-zero and a sentinel), written by a
  data-parallel encoder (:func:`stream_words`) into a static buffer.

  Payload: ``words`` (uint32, the buffer, ``capacity`` bits rounded up to words) and
  ``used_bits`` (int32, the stream's length). A collective moves the whole buffer, so
  the wire cost is the capacity.

  Default capacity, per bucket of ``b`` values, with the l2 norm: the smallest of the
  fixed-width size, 1.05x Theorem 3.2's bound on the *expected* length (o(1) dropped)
  and, when ``s <= √b``, 1.05x ``(2.8b + 32)``, plus the sentinel. The ``2.8b + 32`` is
  Corollary 3.3's figure. It sizes the buffer for typical gradients (Gaussian-like
  magnitudes take somewhat less than ``2.8b`` on average at ``s = √b``), and it is *not*
  a bound for every input: every non-zero code costs at least 3 bits (gap, sign, level),
  so inputs whose magnitudes are nearly equal take more. At ``s = √b`` a vector of equal
  magnitudes takes exactly ``3b + 33`` bits, alternating magnitudes ``2, 1, 2, 1, ...``
  about ``3.081b + 33`` on average, and no input more than ``37b/12 + 33`` on average
  (:func:`jaxcomp.elias.dense_bound`; for ``s`` below about ``0.79√b`` that bound is at
  most ``2.8b + 33``). Such inputs overflow the default buffer on every step and take
  the fallback below: the update is the same, the bytes are the fixed width's. Pass
  ``capacity`` (bits per value) to size the buffer otherwise, e.g.
  ``1.05 * dense_bound(b, s) / b`` for room above every input's expected length. With
  ``norm="max"`` (no bound) the default is the fixed-width size, i.e. no saving: pass
  ``capacity``.

  Overflow is never a truncation: :meth:`encode_with_info` reports a stream longer than
  the buffer, and ``jc.compress``'s all-gather exchange then sends the fixed-width
  payload of the same quantization from every device (a ``lax.cond`` on a ``pmax`` of
  the flags; ``jc.wire_report`` lists that path apart as ``fallback_bytes``). Decoding
  an overflowed payload on its own gives NaN.

  Decoding is sequential by nature (each code's length depends on the bits before it);
  it runs on the host through ``jax.pure_callback`` (NumPy,
  :func:`jaxcomp.elias.decode_stream`), so it works under ``jit``/``shard_map``
  but not where host callbacks are unavailable.

  Args:
    levels: QSGD levels ``s``.
    bucket_size: values per bucket (``None``: one per tensor, the paper's setting).
    norm: ``"l2"`` (the paper's, which makes codes sparse) or ``"max"``.
    capacity: buffer bits per value (float), or ``None`` for the default above.

  References:
    Alistarh et al. *QSGD*. NeurIPS 2017, §3.1 (coding), Theorem 3.2, Corollary 3.3.
  """

  levels: int
  bucket_size: int | None = None
  norm: str = "l2"
  capacity: float | None = None

  needs_key = True

  def __post_init__(self):
    _ = self.fallback  # validates levels, bucket_size, norm
    if self.capacity is not None and not self.capacity > 0:
      raise ValueError(
        f"capacity must be a positive number of bits per value, got {self.capacity!r}"
      )

  @property
  def fallback(self) -> codecs_lib.QSGD:
    """The fixed-width codec of the same quantization, sent when a buffer overflows."""
    return codecs_lib.QSGD(self.levels, self.bucket_size, self.norm)

  def bucket_lengths(self, n: int) -> tuple[int, ...]:
    b, nb = codecs_lib.buckets(n, self.bucket_size)
    return tuple(min(b, n - j * b) for j in range(nb)) if n else (0,)

  def capacity_bits(self, n: int) -> int:
    """Bits of the buffer for a tensor of n values (a multiple of 32)."""
    if self.capacity is not None:
      bits = math.ceil(self.capacity * max(n, 1))
    else:
      q = self.fallback
      bits = sum(
        default_capacity_bits(b, self.levels, q.bits * b + 32, self.norm)
        for b in self.bucket_lengths(n)
      )
    return 32 * max(1, -(-bits // 32))

  def encode_with_info(self, x: Array, *, key: Array | None = None) -> tuple[Payload, Array]:
    scales, mags, negative = self.fallback.quantize(x, key=key)
    cap = self.capacity_bits(x.size)
    words, used = stream_words(scales, mags, negative, self.bucket_lengths(x.size), cap // 32)
    payload = Payload({"words": words, "used_bits": used}, tuple(x.shape), jnp.dtype(x.dtype))
    return payload, used > cap

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    return self.encode_with_info(x, key=key)[0]

  def _host_codes(self, words: Array, used: Array, n: int) -> tuple[Array, Array]:
    """(scales, codes) of stacked buffers, decoded on the host (one callback)."""
    nb = len(self.bucket_lengths(n))
    host = functools.partial(
      _host_decode,
      n=n,
      nb=nb,
      levels=self.levels,
      bucket_size=self.bucket_size,
      magnitude_bits=self.fallback.magnitude_bits,
    )
    lead = words.shape[:-1]
    out = (jax.ShapeDtypeStruct((*lead, nb), jnp.float32), jax.ShapeDtypeStruct((*lead, n), _U32))
    return jax.pure_callback(host, out, words, used, vmap_method="sequential")

  def _decode_f32(self, payload: Payload) -> Array:
    n = math.prod(payload.shape)
    scales, codes = self._host_codes(payload.arrays["words"], payload.arrays["used_bits"], n)
    # The fixed-width codec's own arithmetic: bit-identical to decoding its payload.
    return self.fallback.dequantize(codes, scales, n)

  def decode_sum(self, stacked: Payload) -> Array:
    """Sum of K stacked payloads in rank order; the K streams decode in one callback."""
    n = math.prod(stacked.shape)
    scales, codes = self._host_codes(stacked.arrays["words"], stacked.arrays["used_bits"], n)
    deq = lambda s, c: self.fallback.dequantize(c, s, n)
    first = deq(scales[0], codes[0])
    total, _ = lax.scan(lambda acc, sc: (acc + deq(*sc), None), first, (scales[1:], codes[1:]))
    return total.reshape(stacked.shape)


def _host_decode(words, used, *, n, nb, levels, bucket_size, magnitude_bits):
  """NumPy: (scales, codes) of one or more stacked buffers; NaN scales if overflowed."""
  words = np.asarray(words, np.uint32)
  used = np.asarray(used)
  lead = words.shape[:-1]
  words2 = words.reshape(-1, words.shape[-1])
  scales = np.full((words2.shape[0], nb), np.nan, np.float32)
  codes = np.zeros((words2.shape[0], n), np.uint32)
  for i, (w, u) in enumerate(zip(words2, used.reshape(-1))):
    u = int(u)
    if u > 32 * w.size:  # overflowed: the buffer does not hold the stream
      continue
    data = elias.words_to_bytes(w, u)
    sc, mags, signs = elias.decode_stream(data, u, n=n, levels=levels, bucket_size=bucket_size)
    scales[i] = sc
    codes[i] = mags | (signs << np.uint32(magnitude_bits))
  return scales.reshape(*lead, nb), codes.reshape(*lead, n)
