"""Bit packing of small unsigned integer codes into uint32 words.

Two layouts, chosen by the width ``bits``; both take exactly the words they need:

* **Lanes** (``bits`` divides 32: 1, 2, 4, 8, 16, 32): ``32 // bits`` consecutive codes
  per word, code ``i`` of word ``w`` (the code at index ``w * 32 // bits + i``) in bits
  ``bits*i .. bits*i + bits - 1``. A vector of ``n`` codes takes
  ``ceil(n * bits / 32)`` words. For ``bits = 1`` this is the usual "32 signs per
  uint32", bit ``i`` of word ``g`` holding code ``32 g + i``.
* **Bit planes** (any other width, 3, 5, 6, 7, ...): the codes are cut into groups of 32
  consecutive values; group ``g`` is stored in ``bits`` consecutive words, and word
  ``g * bits + j`` holds bit ``j`` of the 32 codes of the group, code ``i`` of the group
  in bit ``i`` of the word. ``ceil(n / 32) * bits`` words; no code straddles a word.

Both pack with shifts and one sum over the codes of a word (distinct bits, so the sum
is an OR), which XLA fuses with the code computation into a single pass: each code is
read once in the lanes layout, ``bits`` times in the planes layout. The lanes layout is
the fast one on XLA:CPU (``python -m benchmarks.codecs``), and what a Pallas kernel
writes for 1-, 2-, 4- and 8-bit codecs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_LANES = 32


def _check_bits(bits: int) -> None:
  if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 32:
    raise ValueError(f"bits must be an integer in 1..32, got {bits!r}")


def uses_lanes(bits: int) -> bool:
  """Whether ``bits``-bit codes use the lanes layout (``bits`` divides 32)."""
  _check_bits(bits)
  return _LANES % bits == 0


def num_words(n: int, bits: int) -> int:
  """Number of uint32 words :func:`pack_bits` produces for ``n`` codes."""
  _check_bits(bits)
  if uses_lanes(bits):
    return -(-n * bits // _LANES)
  return -(-n // _LANES) * bits


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Packs a 1-D array of codes, each ``< 2**bits``, into uint32 words.

  Args:
    codes: unsigned integer array of shape ``(n,)``; only the low ``bits`` bits are kept.
    bits: bits per code, 1 to 32.

  Returns:
    uint32 array of shape ``(num_words(n, bits),)``.
  """
  _check_bits(bits)
  if codes.ndim != 1:
    raise ValueError(f"codes must be 1-D, got shape {codes.shape}")
  n = codes.shape[0]
  mask = jnp.uint32(0xFFFFFFFF if bits == 32 else (1 << bits) - 1)
  if uses_lanes(bits):
    per_word = _LANES // bits
    words = num_words(n, bits)
    c = codes.astype(jnp.uint32) & mask
    if words * per_word != n:
      c = jnp.pad(c, (0, words * per_word - n))
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * jnp.uint32(bits)
    return jnp.sum(c.reshape(words, per_word) << shifts, axis=1, dtype=jnp.uint32)
  groups = -(-n // _LANES)
  c = jnp.pad(codes.astype(jnp.uint32), (0, groups * _LANES - n)).reshape(groups, _LANES)
  planes = jnp.arange(bits, dtype=jnp.uint32)
  lanes = jnp.arange(_LANES, dtype=jnp.uint32)
  bit = (c[:, None, :] >> planes[None, :, None]) & jnp.uint32(1)  # (groups, bits, 32)
  words = jnp.sum(bit << lanes[None, None, :], axis=-1, dtype=jnp.uint32)
  return words.reshape(-1)


def unpack_bits(words: jax.Array, bits: int, n: int) -> jax.Array:
  """Inverse of :func:`pack_bits`: returns the ``n`` codes as uint32 of shape ``(n,)``."""
  _check_bits(bits)
  if words.ndim != 1 or words.shape[0] != num_words(n, bits):
    raise ValueError(
      f"expected {num_words(n, bits)} words for {n} codes of {bits} bits, got shape {words.shape}"
    )
  if uses_lanes(bits):
    per_word = _LANES // bits
    mask = jnp.uint32(0xFFFFFFFF if bits == 32 else (1 << bits) - 1)
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * jnp.uint32(bits)
    codes = (words[:, None] >> shifts[None, :]) & mask
    return codes.reshape(-1)[:n]
  groups = words.shape[0] // bits
  w = words.reshape(groups, bits)
  planes = jnp.arange(bits, dtype=jnp.uint32)
  lanes = jnp.arange(_LANES, dtype=jnp.uint32)
  bit = (w[:, :, None] >> lanes[None, None, :]) & jnp.uint32(1)  # (groups, bits, 32)
  codes = jnp.sum(bit << planes[None, :, None], axis=1, dtype=jnp.uint32)
  return codes.reshape(-1)[:n]
