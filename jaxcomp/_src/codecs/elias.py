r"""Elias omega coding and the QSGD paper's variable-length string format, on the host.

QSGD (§3.1 of the paper) sends a quantized vector as a bit string: 32 bits of norm, then
for every non-zero entry the Elias recursive (omega) code of the distance to it, one sign
bit, and the Elias code of its level ``s * xi_i``. This module is the host (NumPy) side:
an exact omega code, and a serializer of a :class:`jaxcomp.codecs.QSGD` payload to
``bytes`` and back, bit-exact. A device encoder must produce the same bits; the format is
therefore specified here completely.

**Elias omega code** of an integer ``k >= 1``: start from ``"0"``; while ``k > 1``,
prepend the binary representation of ``k`` (most significant bit first, so it starts
with ``1``) and set ``k = bit_length(k) - 1``. So ``1 -> 0``, ``2 -> 10 0``,
``3 -> 11 0``, ``4 -> 10 100 0``, ``7 -> 10 111 0``, ``16 -> 10 100 10000 0``. Its length is
``L(1) = 1`` and ``L(k) = bit_length(k) + L(bit_length(k) - 1)``: 1, 3, 3, 6, 6, 6, 6, 7,
... To decode: ``n = 1``; while the next bit is ``1``, read ``n + 1`` bits (that ``1``
included) as the new ``n``; the ``0`` ends the code and ``n`` is the value. This module
handles every ``k < 2**64`` (at most four groups); a group that would be wider than 64
bits is rejected as corrupt.

**Stream of one bucket** (a vector of ``b`` values with ``s`` levels, ``b >= 1``):

1. 32 bits: the IEEE-754 bits of the float32 scale (the norm), most significant first.
   Any pattern is accepted, NaN payloads included.
2. For each entry with magnitude ``m >= 1`` at in-bucket position ``i``, in increasing
   ``i``: ``omega(i - prev)`` (``prev = -1`` before the first non-zero, else the previous
   non-zero's position, so gaps are ``>= 1``), then 1 sign bit (``1`` = negative), then
   ``omega(m)``, ``1 <= m <= s``.
3. A sentinel ``omega(b - prev)``: it points one past the end, which tells the decoder
   that the bucket ended (a bucket of zeros is 32 bits and ``omega(b + 1)``).

Entries with ``m = 0`` send nothing, not even their sign (see :func:`qsgd_to_bytes`).

**Stream of a payload**: the buckets' streams concatenated in bucket order. Buckets are
the codec's: ``bucket_size`` consecutive values of the flattened tensor, the last one
shorter (``n - (nb - 1) * bucket_size`` values, which is its ``b``); ``bucket_size=None``
is one bucket of ``n`` values. A tensor with no values has no bucket and an empty stream.

**Bit numbering**: bits are numbered ``t = 0, 1, ..., L - 1``. Stored as bytes, bit ``t``
is bit ``7 - t % 8`` of byte ``t // 8`` (``np.packbits`` order); stored as uint32 words,
bit ``t`` is bit ``31 - t % 32`` of word ``t // 32``. So the words written big-endian
are the stream's bytes in order (:func:`words_to_bytes`, :func:`bytes_to_words`).
Unused bits of the last byte or word are zero.

**Host container** (:func:`qsgd_to_bytes`): 4 bytes, the total bit length ``L`` as a
big-endian unsigned integer (so ``L < 2**32``), then the ``ceil(L / 8)`` bytes of the
stream, zero-padded.

Decoding is strict: every accepted string is exactly the encoding of what it decodes to
(omega codes are canonical, gaps land inside the bucket, the sentinel lands exactly one
past it, levels are at most ``s``, nothing follows the last bucket, the padding is
zero). So a corrupted or truncated string either raises :class:`ValueError` or decodes to
a different payload whose encoding is that same corrupted string; a truncated one (a
proper prefix, with or without a rewritten length header) always raises.

Encoding is vectorised: code lengths (a table below ``2**16``), prefix sums for the
offsets, and each (gap, sign, level) triple written as one field of at most 64 bits into
uint64 words (``np.bitwise_or.reduceat``). Decoding is sequential by nature. Here the
omega code starting at every bit position is decoded at once (a 16-bit lookup table;
longer codes group by group), which says where the next triple would start if one
started at that position; pointer doubling turns this into jumps of 8 and 64 triples
with the sums of their gaps, so the Python loop that walks the chain takes one step per
64 non-zeros (and a few at the end of each bucket); the values are then decoded again,
vectorised, at the triples' starts. The tables cover ``2**20`` stream bits at a time
(about 70 MB of temporaries), so memory does not grow with the stream.

>>> omega_encode([1, 2, 4]).tolist()  # "0", "10 0", "10 100 0"
[0, 1, 0, 0, 1, 0, 1, 0, 0, 0]
>>> int(omega_length(10**6))
31

References:
  Alistarh, Grubic, Li, Tomioka, Vojnovic. *QSGD: Communication-Efficient SGD via
  Gradient Quantization and Encoding*. NeurIPS 2017. https://arxiv.org/abs/1610.02132
  Elias. *Universal codeword sets and representations of the integers*. IEEE Trans.
  Information Theory 21(2), 1975.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxcomp._src.codecs import base as _codecs
from jaxcomp._src.plumbing import bitpack

_U64 = np.uint64
_ONE = np.uint64(1)
_MAX_GROUPS = 4  # every k < 2**64 has at most four binary groups
_HEADER_BYTES = 4


# ----------------------------------------------------------------------------- omega code


def _bit_length(x: np.ndarray) -> np.ndarray:
  """Exact ``int.bit_length`` of a uint64 array, as int64."""
  e = np.frexp(x.astype(np.float64))[1].astype(np.int64)  # 0 for x = 0
  e = np.minimum(e, 64)
  # The float64 conversion may round x up to the next power of two: correct that.
  over = (e > 0) & ((x >> np.maximum(e - 1, 0).astype(_U64)) == 0)
  return e - over


def _as_positive(k: Any, what: str = "k") -> np.ndarray:
  """``k`` as a flat uint64 array, checking ``1 <= k < 2**64``."""
  arr = np.asarray(k)
  if arr.dtype == object:
    try:
      arr = np.array(arr.tolist(), dtype=_U64)
    except OverflowError as e:
      raise ValueError(f"{what} must be integers in [1, 2**64), got {k!r}") from e
  if arr.dtype.kind not in "iu":
    raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
  arr = arr.reshape(-1)
  if arr.size and arr.min() < 1:
    raise ValueError(f"Elias omega codes integers >= 1; {what} has {arr.min()}")
  return arr.astype(_U64)


def _omega_groups(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The binary groups of ``omega(k)`` in stream order, for a uint64 array ``k >= 1``.

  Returns ``(values, widths)``, each ``(len(k), 4)``: group ``j`` of code ``i`` is the
  ``widths[i, j]``-bit number ``values[i, j]`` (width 0: absent; absent groups come
  first). The code is the groups in order, then one ``0``.
  """
  values = np.zeros((k.size, _MAX_GROUPS), _U64)
  widths = np.zeros((k.size, _MAX_GROUPS), np.int64)
  cur = k
  for slot in range(_MAX_GROUPS - 1, -1, -1):  # innermost group (k itself) last
    active = cur > 1
    bl = _bit_length(cur)
    values[:, slot] = np.where(active, cur, 0)
    widths[:, slot] = np.where(active, bl, 0)
    cur = np.where(active, (bl - 1).astype(_U64), _ONE)
  return values, widths


def omega_length(k: Any) -> np.ndarray:
  """Length in bits of the Elias omega code of each ``k >= 1`` (int64, shape of ``k``).

  ``L(1) = 1`` and ``L(k) = bit_length(k) + L(bit_length(k) - 1)``: the recursion runs
  over bit lengths, at most four levels below ``2**64``.
  """
  shape = np.shape(k)
  cur = _as_positive(k)
  length = np.ones(cur.shape, np.int64)
  for _ in range(_MAX_GROUPS):
    active = cur > 1
    bl = _bit_length(cur)
    length += np.where(active, bl, 0)
    cur = np.where(active, (bl - 1).astype(_U64), _ONE)
  return length.reshape(shape)


_TABLE_BITS = 16  # codes of k < 2**16 come from a table; codes of k < 2**9 are <= 16 bits


@functools.cache
def _code_table() -> tuple[np.ndarray, np.ndarray]:
  """``omega(k)`` as one right-aligned number, and its length, for ``k < 2**16``."""
  k = np.arange(1 << _TABLE_BITS, dtype=_U64)
  k[0] = 1  # unused entry
  return _fold_codes(k)


def _fold_codes(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Whole omega codes as right-aligned uint64 numbers (valid where the length <= 64)."""
  values, widths = _omega_groups(k)
  code = np.zeros(k.size, _U64)
  for j in range(_MAX_GROUPS):
    w = widths[:, j]
    code = np.where(w > 0, _shl(code, w) | values[:, j], code)
  length = widths.sum(axis=1) + 1
  return code << _ONE, length


def _shl(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """``x << w`` for shifts 0..64 (64 gives 0), elementwise."""
  w = w.astype(_U64)
  return (x << np.minimum(w, _U64(63))) << (w == 64).astype(_U64)


def _omega_codes(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``(code, length)`` of each ``k`` (uint64), for codes of at most 64 bits."""
  table_code, table_len = _code_table()
  small = k < (1 << _TABLE_BITS)
  idx = np.where(small, k, 0).astype(np.int64)
  code, length = table_code[idx], table_len[idx]
  if not small.all():
    big = np.flatnonzero(~small)
    code[big], length[big] = _fold_codes(k[big])
    if length[big].max() > 64:
      raise ValueError("an Elias code longer than 64 bits (a gap >= 2**52) in a stream")
  return code, length


def _or_fields(
  words: np.ndarray, offsets: np.ndarray, values: np.ndarray, widths: np.ndarray
) -> None:
  """ORs each ``widths[i]``-bit number ``values[i]`` (1..64 bits) into the MSB-first
  uint64 ``words`` at bit ``offsets[i]``; the offsets must be increasing, the fields
  disjoint."""
  keep = values != 0  # zero fields are already there
  offsets, values, widths = offsets[keep], values[keep], widths[keep]
  if not offsets.size:
    return
  w0 = offsets >> 6
  end = (offsets & 63) + widths  # 1..127: the field's end within words w0, w0 + 1
  span = end > 64
  right = np.where(span, end - 64, 0).astype(_U64)
  left = np.where(span, 0, 64 - end).astype(_U64)
  _or_runs(words, w0, (values >> right) << left)
  _or_runs(words, w0[span] + 1, values[span] << (128 - end[span]).astype(_U64))


def _or_runs(words: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
  """``words[idx] |= vals`` for a non-decreasing ``idx`` with repeats."""
  if not idx.size:
    return
  first = np.flatnonzero(np.concatenate([[True], idx[1:] != idx[:-1]]))
  words[idx[first]] |= np.bitwise_or.reduceat(vals, first)


def _words_to_bits(words: np.ndarray, num_bits: int) -> np.ndarray:
  return np.unpackbits(words.astype(">u8").view(np.uint8))[:num_bits]


def omega_encode(k: Any) -> np.ndarray:
  """Concatenated Elias omega codes of the integers ``k >= 1`` (flattened, in order).

  Returns:
    uint8 array of bits (0 or 1), of length ``omega_length(k).sum()``.
  """
  k = _as_positive(k)
  values, widths = _omega_groups(k)
  lengths = widths.sum(axis=1) + 1
  starts = np.cumsum(lengths) - lengths
  num_bits = int(lengths.sum())
  words = np.zeros(-(-num_bits // 64), _U64)
  offsets = starts[:, None] + np.cumsum(widths, axis=1) - widths
  present = widths.reshape(-1) > 0
  _or_fields(
    words, offsets.reshape(-1)[present], values.reshape(-1)[present], widths.reshape(-1)[present]
  )
  return _words_to_bits(words, num_bits)


@functools.cache
def _decode_table() -> tuple[np.ndarray, np.ndarray]:
  """For every 16-bit pattern: the value and length of the omega code it starts with,
  or length 0 when that code is longer than 16 bits (values >= 2**9)."""
  k = np.arange(1, 1 << 9, dtype=_U64)
  code, length = _omega_codes(k)
  pad = _TABLE_BITS - length
  count = np.int64(1) << pad
  first = (code << pad.astype(_U64)).astype(np.int64)
  total = int(count.sum())
  idx = np.repeat(first - (np.cumsum(count) - count), count) + np.arange(total)
  value = np.zeros(1 << _TABLE_BITS, _U64)
  size = np.zeros(1 << _TABLE_BITS, np.int64)
  value[idx] = np.repeat(k, count)
  size[idx] = np.repeat(length, count)
  return value, size


class _Reader:
  """Random access to the first ``num_bits`` bits of a packed (MSB-first) byte string."""

  def __init__(self, data: np.ndarray, num_bits: int):
    data = np.asarray(data, np.uint8).reshape(-1)
    self.num_bits = int(num_bits)
    pad = np.zeros(data.size + 16, np.uint8)
    pad[: data.size] = data
    m = data.size + 9
    # word[j] = bytes j..j+7 as a big-endian uint64; u24[j] = bytes j..j+2
    word = np.zeros(m, _U64)
    for i in range(8):
      word |= pad[i : i + m].astype(_U64) << _U64(56 - 8 * i)
    self._word = word
    self._u24 = (word >> _U64(40)).astype(np.int32)

  def window(self, pos: np.ndarray) -> np.ndarray:
    """The 64 bits starting at each position (bits past the data read as 0)."""
    j = pos >> 3
    r = (pos & 7).astype(_U64)
    w = self._word
    return (w[j] << r) | ((w[j + 8] >> _ONE) >> (_U64(63) - r))

  def bit(self, pos: np.ndarray) -> np.ndarray:
    return ((self._u24[pos >> 3] >> (23 - (pos & 7))) & 1).astype(np.uint8)

  def omega_at(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decodes an omega code starting at each position, vectorised.

    Returns ``(value, end)``: uint64 values and int64 end positions (one past the code's
    last bit); ``end = -1`` where no valid code starts there (it would run past
    ``num_bits``, or has a group wider than 64 bits).
    """
    pos = pos.astype(np.int64)
    w16 = (self._u24[pos >> 3] >> (8 - (pos & 7)).astype(np.int32)) & 0xFFFF
    return self._omega_from_windows(pos, w16)

  def omega_range(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`omega_at` at every position of ``[lo, hi)``."""
    j0, j1 = lo >> 3, -(-hi // 8)
    shifts = np.arange(8, 0, -1, dtype=np.int32)
    w16 = ((self._u24[j0:j1, None] >> shifts) & 0xFFFF).reshape(-1)[lo - 8 * j0 : hi - 8 * j0]
    return self._omega_from_windows(np.arange(lo, hi, dtype=np.int64), w16)

  def _omega_from_windows(self, pos, w16):
    table_value, table_size = _decode_table()
    size = table_size[w16]
    value = table_value[w16]
    end = pos + size
    end[(size == 0) | (end > self.num_bits)] = -1
    slow = np.flatnonzero((size == 0) & (pos < self.num_bits))
    if slow.size:
      value[slow], end[slow] = self._omega_slow(pos[slow])
    return value, end

  def _omega_slow(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`omega_at` by groups, for any code (64-bit windows, at most five rounds)."""
    m = pos.size
    value = np.zeros(m, _U64)
    end = np.full(m, -1, np.int64)
    idx = np.arange(m)
    p = pos
    n = np.ones(m, _U64)
    for _ in range(_MAX_GROUPS + 1):
      inside = p < self.num_bits
      idx, p, n = idx[inside], p[inside], n[inside]
      if not idx.size:
        break
      w = self.window(p)
      stop = (w >> _U64(63)) == 0
      end[idx[stop]] = p[stop] + 1
      value[idx[stop]] = n[stop]
      go = ~stop
      idx, p, n, w = idx[go], p[go], n[go], w[go]
      # the next group has n + 1 bits (its leading 1 is the bit just peeked)
      fits = (n < 64) & (p + n.astype(np.int64) + 1 <= self.num_bits)
      idx, p, n, w = idx[fits], p[fits], n[fits], w[fits]
      width = n + _ONE
      n = w >> (_U64(64) - width)
      p = p + width.astype(np.int64)
    return value, end


def _to_bytes_of_bits(bits: Any) -> np.ndarray:
  bits = np.asarray(bits)
  if bits.ndim != 1:
    raise ValueError(f"bits must be 1-D, got shape {bits.shape}")
  if bits.size and (bits.dtype.kind not in "biu" or bits.max() > 1):
    raise ValueError("bits must hold only 0 and 1")
  return np.packbits(bits.astype(np.uint8))


def omega_decode(bits: Any, count: int | None = None) -> tuple[np.ndarray, int]:
  """Decodes concatenated Elias omega codes from a bit array.

  Args:
    bits: 1-D array of 0/1 (as from :func:`omega_encode`).
    count: number of codes to read; ``None`` reads codes until the bits are used up
      (and then they must end exactly at the end).

  Returns:
    ``(values, used)``: uint64 values, and the number of bits they took.

  Raises:
    ValueError: a code runs past the end of ``bits`` or has a group wider than 64 bits
      (a value >= 2**64).
  """
  num_bits = int(np.asarray(bits).size)
  rd = _Reader(_to_bytes_of_bits(bits), num_bits)
  value, end = rd.omega_at(np.arange(num_bits, dtype=np.int64))
  endl = end.tolist()
  starts = []
  t = 0
  while (t < num_bits) if count is None else (len(starts) < count):
    if t >= num_bits:
      raise ValueError(
        f"omega_decode: the bits end after {len(starts)} codes, {count} were asked for"
      )
    e = endl[t]
    if e < 0:
      raise ValueError(_omega_error(rd, t, "Elias omega code"))
    starts.append(t)
    t = e
  return value[np.asarray(starts, np.int64)], t


def _omega_error(rd: _Reader, t: int, what: str) -> str:
  """Says why no valid omega code starts at bit ``t``."""
  if t >= rd.num_bits:
    return f"the {what} at bit {t} starts at or past the end of the stream ({rd.num_bits} bits)"
  n, p = 1, t
  while p < rd.num_bits and rd.bit(np.array([p]))[0]:
    if n >= 64:
      return (
        f"the {what} at bit {t} has a group of {n + 1} bits (a value >= 2**64): corrupted stream"
      )
    if p + n + 1 > rd.num_bits:
      break
    n, p = int(rd.window(np.array([p]))[0] >> np.uint64(63 - n)), p + n + 1
  return f"the {what} at bit {t} runs past the end of the stream ({rd.num_bits} bits)"


# ----------------------------------------------------------------------------- streams


def bytes_to_words(data: Any) -> np.ndarray:
  """Stream bytes as uint32 words (bit ``t`` in bit ``31 - t % 32`` of word ``t // 32``)."""
  data = np.asarray(data, np.uint8).reshape(-1)
  pad = np.zeros(-(-data.size // 4) * 4, np.uint8)
  pad[: data.size] = data
  return pad.view(">u4").astype(np.uint32)


def words_to_bytes(words: Any, num_bits: int) -> np.ndarray:
  """The ``ceil(num_bits / 8)`` stream bytes held by MSB-first uint32 ``words``."""
  words = np.asarray(words, np.uint32).reshape(-1)
  nbytes = -(-int(num_bits) // 8)
  if nbytes > 4 * words.size:
    raise ValueError(f"{words.size} words hold {32 * words.size} bits, not {num_bits}")
  return words.astype(">u4").view(np.uint8)[:nbytes].copy()


def _bucket_sizes(n: int, bucket_size: int | None) -> tuple[int, int, np.ndarray]:
  b, nb = _codecs.buckets(n, bucket_size)
  sizes = np.full(nb, b, np.int64)
  if nb:
    sizes[-1] = n - (nb - 1) * b
  return b, nb, sizes


class _Layout:
  """Gaps, levels and signs of the stream of one payload, before writing any bit."""

  def __init__(self, scales: Any, mags: Any, signs: Any, bucket_size: int | None):
    mags = np.asarray(mags).reshape(-1)
    signs = np.asarray(signs).reshape(-1)
    scales = np.asarray(scales).reshape(-1)
    if mags.dtype.kind not in "iu" or signs.dtype.kind not in "biu":
      raise TypeError(f"mags and signs must be integer arrays, got {mags.dtype}, {signs.dtype}")
    if signs.shape != mags.shape:
      raise ValueError(f"signs {signs.shape} and mags {mags.shape} differ in shape")
    if mags.size and mags.min() < 0:
      raise ValueError("mags must be >= 0")
    if signs.size and (signs.min() < 0 or signs.max() > 1):
      raise ValueError("signs must be 0 or 1")
    n = mags.size
    if n >= 2**50:
      raise ValueError(f"{n} values: gaps would need Elias codes longer than 64 bits")
    b, nb, sizes = _bucket_sizes(n, bucket_size)
    if scales.shape != (nb,):
      raise ValueError(f"{n} values in buckets of {b} need {nb} scales, got {scales.shape}")
    if scales.dtype != np.float32:
      raise TypeError(f"scales must be float32, got {scales.dtype}")
    nz = np.flatnonzero(mags)
    bucket = nz // b
    pos = nz - bucket * b
    prev = np.empty_like(pos)
    if nz.size:
      prev[0] = -1
      prev[1:] = np.where(bucket[1:] == bucket[:-1], pos[:-1], -1)
    counts = np.bincount(bucket, minlength=nb).astype(np.int64)
    last = np.full(nb, -1, np.int64)
    has = counts > 0
    last[has] = pos[np.cumsum(counts)[has] - 1]
    self.nb = nb
    self.scale_bits = scales.view(np.uint32).astype(_U64)
    self.counts = counts
    self.bucket = bucket
    self.gaps = (pos - prev).astype(_U64)
    self.levels = mags[nz].astype(_U64)
    self.signs = signs[nz].astype(_U64)
    self.sentinels = (sizes - last).astype(_U64)

  def num_bits(self) -> int:
    return int(
      32 * self.nb
      + self.levels.size
      + omega_length(self.gaps).sum()
      + omega_length(self.levels).sum()
      + omega_length(self.sentinels).sum()
    )


def encode_stream(
  scales: Any, mags: Any, signs: Any, bucket_size: int | None = None
) -> tuple[np.ndarray, int]:
  """Encodes quantized buckets in the QSGD string format (see the module docstring).

  Args:
    scales: float32 ``(nb,)``, the buckets' scales (their bits are sent as they are).
    mags: integer ``(n,)``, the levels ``s * xi_i >= 0`` of the flattened tensor.
    signs: ``(n,)`` of 0/1 (1 = negative); ignored where ``mags`` is 0.
    bucket_size: values per bucket (``None``: one bucket), as in the codec.

  Returns:
    ``(data, num_bits)``: the stream as ``ceil(num_bits / 8)`` uint8 bytes (zero-padded)
    and its length ``L`` in bits.
  """
  lay = _Layout(scales, mags, signs, bucket_size)
  gcode, glen = _omega_codes(lay.gaps)
  mcode, mlen = _omega_codes(lay.levels)
  scode, slen = _omega_codes(lay.sentinels)
  tlen = glen + 1 + mlen
  nb, nnz = lay.nb, lay.levels.size
  # Items in stream order: bucket j is [header, its non-zeros..., sentinel].
  before = np.cumsum(lay.counts) - lay.counts  # non-zeros in earlier buckets
  head_item = 2 * np.arange(nb) + before
  sent_item = head_item + 1 + lay.counts
  trip_item = np.arange(nnz) + 2 * lay.bucket + 1
  lengths = np.empty(2 * nb + nnz, np.int64)
  lengths[head_item] = 32
  lengths[sent_item] = slen
  lengths[trip_item] = tlen
  starts = np.cumsum(lengths) - lengths
  num_bits = int(lengths.sum())
  words = np.zeros(-(-num_bits // 64), _U64)
  _or_fields(words, starts[head_item], lay.scale_bits, np.full(nb, 32, np.int64))
  _or_fields(words, starts[sent_item], scode, slen)
  # A triple (gap, sign, level) is one field when it fits 64 bits, else two.
  t0 = starts[trip_item]
  tail = (lay.signs << mlen.astype(_U64)) | mcode  # sign and level: <= 36 bits
  one = tlen <= 64
  whole = _shl(gcode, np.where(one, 1 + mlen, 0)) | tail
  _or_fields(words, t0[one], whole[one], tlen[one])
  if not one.all():
    two = ~one
    _or_fields(words, t0[two], gcode[two], glen[two])
    _or_fields(words, t0[two] + glen[two], tail[two], 1 + mlen[two])
  data = words.astype(">u8").view(np.uint8)[: -(-num_bits // 8)]
  return data, num_bits


_SEGMENT_BITS = 1 << 20  # stream bits whose chain tables are held at once
_LOOKAHEAD = 192  # > the longest (gap, sign, level) triple: 76 + 1 + 76 bits
_CAP = (1 << 30) - 1  # saturating int32 gap sums (an invalid triple counts as _CAP)
_JUMPS = (64, 8)  # coarse steps of the chain walk, in triples


class _Segment:
  """The chain of (gap, sign, level) triples over stream bits ``[lo, hi)``.

  For each position ``t`` read as the start of a triple: its gap (``gap``) and the end
  of the gap's code (``gap_end``, -1: not a valid code), where the next triple would
  start (``nxt``, -1: no valid triple at ``t``), and, for the coarse steps of
  :func:`decode_stream`, where the chain is after ``k`` triples (``jump[k]``) and the
  sum of their gaps (``sums[k]``, ``_CAP`` when one is invalid or leaves the segment).
  Jump positions are relative to ``lo``, ``hi - lo`` being a sink.
  """

  def __init__(self, rd: _Reader, lo: int):
    self.lo = lo
    self.hi = hi = min(lo + _SEGMENT_BITS, rd.num_bits)
    m = hi - lo
    value, end = rd.omega_range(lo, min(hi + _LOOKAHEAD, rd.num_bits))
    gap_end = end[:m]
    level_at = gap_end + (1 - lo)  # relative; the level's code follows the sign bit
    ok = (gap_end >= 0) & (level_at < end.size)
    nxt = np.where(ok, end[np.where(ok, level_at, 0)], -1)
    self.nxt = nxt
    self.gap_end = gap_end
    # exact below 2**62 (larger gaps are errors in any bucket that fits in memory)
    self.gap = np.where(gap_end >= 0, np.minimum(value[:m], _U64(1 << 62)), 0).astype(np.int64)
    self.pending = {k: [] for k in _JUMPS}
    inside = (nxt >= 0) & (nxt < hi)
    step = np.append(np.where(inside, nxt - lo, m), m).astype(np.int32)
    gap = np.append(np.where(inside, np.minimum(self.gap, _CAP), _CAP), _CAP).astype(np.int32)
    self.step1 = step
    self.jump, self.sums = {}, {}
    k = 1
    for size in sorted(_JUMPS):
      while k < size:
        gap = np.minimum(gap + np.take(gap, step), _CAP)  # two sums < 2**30: no overflow
        step = np.take(step, step)
        k *= 2
      self.jump[size], self.sums[size] = step, gap

  def expand(self, starts: list[int], size: int) -> np.ndarray:
    """The starts of the ``size`` triples of each coarse step that began at ``starts``."""
    cur = (np.asarray(starts, np.int64) - self.lo).astype(np.int32)
    out = np.empty((cur.size, size), np.int64)
    for i in range(size):
      out[:, i] = cur
      cur = np.take(self.step1, cur)
    return out.reshape(-1) + self.lo


class _Walk:
  """The walk along a stream's chain of triples, bucket by bucket: where each bucket's
  header starts (``heads``) and where its triples start (``singles``, one triple at a
  time, and ``coarse``, the expanded coarse steps of each :class:`_Segment`)."""

  def __init__(self, rd: _Reader):
    self.rd = rd
    self.seg: _Segment | None = None
    self.heads: list[int] = []
    self.singles: list[int] = []
    self.coarse: list[np.ndarray] = []

  def segment(self, t: int) -> _Segment:
    """The segment holding bit ``t`` (the current one, or a new one from ``t``)."""
    if self.seg is None or not self.seg.lo <= t < self.seg.hi:
      self.flush()
      self.seg = _Segment(self.rd, t)
    return self.seg

  def flush(self) -> None:
    """Expands the current segment's coarse steps into their triples' starts."""
    if self.seg is not None:
      self.coarse.extend(self.seg.expand(c, k) for k, c in self.seg.pending.items())

  def starts(self) -> np.ndarray:
    """Every triple's start, in stream order (after :meth:`flush`)."""
    return np.sort(np.concatenate([np.asarray(self.singles, np.int64)] + self.coarse))

  def bucket(self, t: int, j: int, nb: int, size: int) -> int:
    """Walks bucket ``j`` of ``nb`` (``size`` values) from its header at bit ``t``;
    returns the bit after its end marker. Coarse steps of whole triples inside the
    bucket first, else one triple, or the end marker."""
    num_bits = self.rd.num_bits
    if t + 32 > num_bits:
      raise ValueError(
        f"truncated QSGD stream: bucket {j} of {nb} starts at bit {t} but "
        f"the stream has {num_bits} bits"
      )
    self.heads.append(t)
    t += 32
    p = -1
    jumps = _JUMPS if size < _CAP else ()  # a sum of _CAP must not pass for valid
    while True:
      if t >= num_bits:
        raise ValueError(
          f"truncated QSGD stream: bucket {j} of {nb} has no end marker before bit {num_bits}"
        )
      seg = self.segment(t)
      i = t - seg.lo
      for k in jumps:  # coarse steps: k whole triples, all inside the bucket
        g = seg.sums[k].item(i)
        if p + g < size:
          seg.pending[k].append(t)
          p += g
          t = seg.jump[k].item(i) + seg.lo
          break
      else:  # one triple, or the end marker
        e = seg.gap_end.item(i)
        if e < 0:
          where = _omega_error(self.rd, t, f"gap of bucket {j}")
          raise ValueError("corrupted QSGD stream: " + where)
        p += seg.gap.item(i)
        if p >= size:
          if p > size:
            raise ValueError(
              f"corrupted QSGD stream: the gap at bit {t} jumps to position {p} of bucket "
              f"{j}, past its end marker at {size}"
            )
          return e
        nt = seg.nxt.item(i)
        if nt < 0:
          raise ValueError("corrupted QSGD stream: " + _triple_error(self.rd, e, j))
        self.singles.append(t)
        t = nt


def _check_stream(data: Any, num_bits: int) -> tuple[np.ndarray, int]:
  """The stream's bytes as flat uint8 and its length, checked: enough bytes, and zero
  padding after the last bit."""
  data = np.asarray(data, np.uint8).reshape(-1)
  num_bits = int(num_bits)
  if num_bits < 0 or 8 * data.size < num_bits:
    raise ValueError(
      f"truncated QSGD stream: {num_bits} bits need {-(-num_bits // 8)} bytes, got {data.size}"
    )
  if num_bits % 8 and data[num_bits // 8] & ((1 << (8 - num_bits % 8)) - 1):
    raise ValueError(f"corrupted QSGD stream: non-zero padding bits after bit {num_bits}")
  return data, num_bits


def _read_triples(rd: _Reader, walk: _Walk, *, n: int, levels: int, b: int, nb: int):
  """``(scales, mags, signs)`` from the walked stream: the triples decoded again
  (vectorised) at their starts, placed in their buckets."""
  st = walk.starts()
  gaps, gap_end = rd.omega_at(st)
  mags, _ = rd.omega_at(gap_end + 1)
  bad = np.flatnonzero(mags > _U64(levels))
  if bad.size:
    i = int(bad[0])
    raise ValueError(
      f"corrupted QSGD stream: level {int(mags[i])} at bit "
      f"{int(gap_end[i]) + 1} is above s = {levels}"
    )
  head_pos = np.asarray(walk.heads, np.int64)
  bucket = np.searchsorted(head_pos, st, side="right") - 1
  csum = np.cumsum(gaps.astype(np.int64))
  first = np.searchsorted(bucket, np.arange(nb))  # index of each bucket's first triple
  base = np.concatenate([np.zeros(1, np.int64), csum])[first]
  flat = bucket * b + (csum - base[bucket] - 1)
  out_mags = np.zeros(n, np.uint32)
  out_signs = np.zeros(n, np.uint32)
  out_mags[flat] = mags.astype(np.uint32)
  out_signs[flat] = rd.bit(gap_end)
  scales = (rd.window(head_pos) >> _U64(32)).astype(np.uint32).view(np.float32)
  return scales, out_mags, out_signs


def decode_stream(
  data: Any, num_bits: int, *, n: int, levels: int, bucket_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Decodes a QSGD string (see the module docstring); the inverse of :func:`encode_stream`.

  Three steps: the input checked (:func:`_check_stream`), the chain of triples walked
  bucket by bucket (:class:`_Walk`), the triples decoded at their starts
  (:func:`_read_triples`).

  Args:
    data: the stream bytes (uint8), at least ``ceil(num_bits / 8)`` of them; bits past
      ``num_bits`` in its last byte must be zero, further bytes are not read.
    num_bits: the stream's length ``L`` in bits.
    n: number of values (the buckets follow from it and ``bucket_size``).
    levels: ``s``; a level above it is an error.
    bucket_size: values per bucket (``None``: one bucket).

  Returns:
    ``(scales, mags, signs)``: float32 ``(nb,)``, uint32 ``(n,)`` and uint32 ``(n,)``
    (signs are 0 where ``mags`` is 0).

  Raises:
    ValueError: the string is not exactly the encoding of ``n`` values in their buckets
      (truncated, trailing bits, a code running past the end, a gap past the bucket's
      end, a level above ``levels``, non-zero padding).
  """
  data, num_bits = _check_stream(data, num_bits)
  b, nb, sizes = _bucket_sizes(int(n), bucket_size)
  rd = _Reader(data[: -(-num_bits // 8)], num_bits)
  walk = _Walk(rd)
  t = 0
  for j in range(nb):
    t = walk.bucket(t, j, nb, int(sizes[j]))
  walk.flush()
  if t != num_bits:
    raise ValueError(
      f"corrupted QSGD stream: {num_bits - t} trailing bits after the last "
      f"bucket (it ends at bit {t} of {num_bits})"
    )
  return _read_triples(rd, walk, n=int(n), levels=levels, b=b, nb=nb)


def _triple_error(rd: _Reader, gap_end: int, j: int) -> str:
  if gap_end >= rd.num_bits:
    return f"the stream ends before the sign bit at {gap_end} (bucket {j})"
  return _omega_error(rd, gap_end + 1, f"level code of bucket {j}")


# ----------------------------------------------------------------------------- payloads


def _check_codec(codec: Any) -> None:
  if not isinstance(codec, _codecs.QSGD):
    raise TypeError(f"the Elias string format is QSGD's; got {type(codec).__name__}")


def _payload_codes(codec: Any, payload: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(scales, mags, signs) of a QSGD payload, as NumPy arrays, checked."""
  _check_codec(codec)
  n = math.prod(payload.shape)
  _, nb = _codecs.buckets(n, codec.bucket_size)
  words = np.asarray(payload.arrays["words"])
  scales = np.asarray(payload.arrays["scales"])
  expected = bitpack.num_words(n, codec.bits)
  if words.shape != (expected,) or scales.shape != (nb,):
    raise ValueError(
      f"expected one payload of {n} values: words ({expected},) and scales ({nb},), got "
      f"{words.shape} and {scales.shape} (stacked payloads: serialize each row)"
    )
  codes = np.asarray(bitpack.unpack_bits(jnp.asarray(words, jnp.uint32), codec.bits, n))
  mags = codes & np.uint32((1 << codec.magnitude_bits) - 1)
  signs = codes >> np.uint32(codec.magnitude_bits)
  if mags.size and mags.max() > codec.levels:
    raise ValueError(f"payload has a level {mags.max()} above s = {codec.levels}")
  return scales.astype(np.float32), mags, signs


def stream_bits(codec: Any, payload: Any) -> int:
  """Length ``L`` in bits of the QSGD string of ``payload`` (without the 4-byte header).

  Computed from the code lengths, without writing the stream.
  """
  scales, mags, signs = _payload_codes(codec, payload)
  return _Layout(scales, mags, signs, codec.bucket_size).num_bits()


def qsgd_to_bytes(codec: Any, payload: Any) -> bytes:
  """Serializes a :class:`jaxcomp.codecs.QSGD` payload as the paper's Elias string.

  The result is the container of the module docstring: a 4-byte big-endian bit length
  ``L``, then the stream's ``ceil(L / 8)`` bytes. Scales keep their exact bits (NaN
  payloads too). Zero levels are not sent, so neither is their sign: the codec may mark
  a negative value that rounded to 0 with a sign bit (it decodes to ``-0.0``), and
  :func:`qsgd_from_bytes` returns it with sign 0 (``+0.0``). Every other bit of the
  payload comes back unchanged.

  Args:
    codec: the :class:`~jaxcomp.codecs.QSGD` codec that made ``payload``.
    payload: one (not stacked) payload from ``codec.encode``.

  >>> import jax
  >>> from jaxcomp.codecs import QSGD
  >>> codec = QSGD(levels=32)  # s = sqrt(n), one l2 bucket: the paper's dense regime
  >>> x = jax.random.normal(jax.random.key(0), (1024,))
  >>> payload = jax.jit(lambda x, k: codec.encode(x, key=k))(x, jax.random.key(1))
  >>> data = qsgd_to_bytes(codec, payload)
  >>> num_bits = stream_bits(codec, payload)
  >>> len(data) == 4 + -(-num_bits // 8), num_bits < 2.9 * 1024 + 32 < codec.wire_bits(x.shape)
  (True, True)
  >>> restored = qsgd_from_bytes(codec, data, x.shape)
  >>> decode = jax.jit(codec.decode)
  >>> bool((decode(restored) == decode(payload)).all())
  True
  """
  scales, mags, signs = _payload_codes(codec, payload)
  data, num_bits = encode_stream(scales, mags, signs, codec.bucket_size)
  if num_bits >= 2**32:
    raise ValueError(f"a stream of {num_bits} bits does not fit the 32-bit length header")
  return struct.pack(">I", num_bits) + data.tobytes()


def qsgd_from_bytes(
  codec: Any, data: bytes, shape: tuple[int, ...], dtype: Any = jnp.float32
) -> Any:
  """Deserializes :func:`qsgd_to_bytes`'s output to a payload of ``codec``.

  Args:
    codec: the :class:`~jaxcomp.codecs.QSGD` codec (levels and buckets must match).
    data: the bytes.
    shape, dtype: shape and dtype of the encoded tensor (not part of the string).

  Returns:
    A :class:`~jaxcomp.codecs.Payload` with NumPy ``"words"`` (uint32) and
    ``"scales"`` (float32) arrays; ``codec.decode`` takes it as it is.

  Raises:
    ValueError: the bytes are not exactly a valid string for this codec and shape.
  """
  _check_codec(codec)
  data = bytes(data)
  if len(data) < _HEADER_BYTES:
    raise ValueError(f"truncated QSGD string: {len(data)} bytes, the header alone has 4")
  (num_bits,) = struct.unpack(">I", data[:_HEADER_BYTES])
  body = np.frombuffer(data, np.uint8, offset=_HEADER_BYTES)
  if body.size != -(-num_bits // 8):
    raise ValueError(
      f"QSGD string length mismatch: the header says {num_bits} bits "
      f"({-(-num_bits // 8)} bytes), {body.size} bytes follow it"
    )
  shape = tuple(int(d) for d in shape)
  n = math.prod(shape)
  scales, mags, signs = decode_stream(
    body, num_bits, n=n, levels=codec.levels, bucket_size=codec.bucket_size
  )
  codes = mags | (signs << np.uint32(codec.magnitude_bits))
  words = np.asarray(bitpack.pack_bits(jnp.asarray(codes), codec.bits))
  return _codecs.Payload({"words": words, "scales": scales}, shape, jnp.dtype(dtype))


# ----------------------------------------------------------------------------- bound


def theorem_3_2_bound(n: int, s: int) -> float:
  r"""Theorem 3.2's bound on the expected QSGD string length, in bits, without the o(1).

  .. math::
    \Bigl(3 + \tfrac{3}{2}\log_2\frac{2(s^2+n)}{s(s+\sqrt n)}\Bigr)\, s(s+\sqrt n) + 32.

  The theorem has ``(3/2 + o(1))``; the ``o(1)`` (from ``|omega(k)| <= (1 + o(1)) log k``)
  is dropped here, so this is the leading-order value, not a proven bound at small n.
  Theorem 3.4 of the NeurIPS text restates it with ``s^2 + sqrt(n)`` in place of
  ``s(s + sqrt(n))``; Theorem 3.2's form is used. At ``s = sqrt(n)`` it gives ``9n + 32``.

  Corollary 3.3's ``2.8n + 32`` at ``s = sqrt(n)`` does not follow from this formula, and
  this string format (like any that spends at least one bit on the gap, one on the sign
  and one on the level of every non-zero, as §3.1 describes) cannot meet it on every
  input: a vector whose entries all have the same magnitude quantizes to ``n`` codes of
  level 1 at ``s = sqrt(n)``, ``3n + 33`` bits. :func:`dense_bound` is this format's bound
  for every input.
  """
  n, s = float(n), float(s)
  if n < 1 or s < 1:
    raise ValueError(f"need n >= 1 and s >= 1, got n={n}, s={s}")
  nnz = s * (s + math.sqrt(n))
  return (3.0 + 1.5 * math.log2(2.0 * (s * s + n) / nnz)) * nnz + 32.0


def dense_bound(n: int, s: float) -> float:
  r"""A bound on the expected length of one bucket's string, for every input (l2 norm).

  Every string of a bucket of ``n`` values with ``N`` non-zero levels ``m_i`` has at most

  .. math:: L \le 33 + 2n - N + 2 \textstyle\sum_i m_i

  bits, because ``|omega(k)| <= 2k - 1`` for every ``k >= 1`` (equality at ``k = 1, 2``)
  and the ``N + 1`` gaps (the sentinel's included) add up to ``n + 1``. With
  ``r_i = s |v_i| / ||v||_2`` the quantizer has ``E[m_i] = r_i`` and
  ``P(m_i >= 1) = min(r_i, 1)``, and ``sum_i r_i^2 = s^2``; maximizing
  ``sum_i (2 r_i - min(r_i, 1))`` under that constraint (a Lagrangian bound) gives

  .. math::
    E[L] \le 33 + 2n + n\,\varphi(s^2/n), \qquad
    \varphi(\rho) = \begin{cases} \sqrt\rho & \rho \le 4/9 \\
                                  3\rho/4 + 1/3 & 4/9 \le \rho \le 16/9 \\
                                  2\sqrt\rho - 1 & \rho \ge 16/9. \end{cases}

  At ``s = sqrt(n)``: ``37n/12 + 33``, about ``3.083n + 33``. It is nearly attained there:
  alternating magnitudes ``2, 1, 2, 1, ...`` take ``(3 + sqrt(10))/2 · n + 33``, about
  ``3.081n + 33``, in expectation, and equal magnitudes exactly ``3n + 33``. In the sparse
  regime (``s`` well below ``sqrt(n)``) it is loose (long gaps cost about ``log2`` of
  their length, not twice it); use :func:`theorem_3_2_bound` there.

  >>> round(dense_bound(4096, 64) / 4096, 4)  # 37/12 + 33/4096
  3.0914
  """
  n, s = float(n), float(s)
  if n < 1 or s <= 0:
    raise ValueError(f"need n >= 1 and s > 0, got n={n}, s={s}")
  rho = s * s / n
  if rho <= 4.0 / 9.0:
    phi = math.sqrt(rho)
  elif rho <= 16.0 / 9.0:
    phi = 0.75 * rho + 1.0 / 3.0
  else:
    phi = 2.0 * math.sqrt(rho) - 1.0
  return 33.0 + 2.0 * n + n * phi
