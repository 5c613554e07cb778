"""Bit packing of small unsigned integer codes into uint32 words.

Layout ("bit planes", 32 values per group): the codes are cut into groups of 32
consecutive values; group ``g`` is stored in ``bits`` consecutive words, and word
``g * bits + j`` holds bit ``j`` of the 32 codes of the group, code ``i`` of the group in
bit ``i`` of the word. So a vector of ``n`` codes of ``bits`` bits takes exactly
``ceil(n / 32) * bits`` words (any ``bits`` in 1..32, no code straddles a word), and for
``bits = 1`` this is the usual "32 signs per uint32" layout. Packing and unpacking are
shifts, ands and a reduction that XLA fuses into one pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_LANES = 32


def _check_bits(bits: int) -> None:
  if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 32:
    raise ValueError(f"bits must be an integer in 1..32, got {bits!r}")


def num_words(n: int, bits: int) -> int:
  """Number of uint32 words :func:`pack_bits` produces for ``n`` codes."""
  _check_bits(bits)
  return -(-n // _LANES) * bits


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Packs a 1-D array of codes, each ``< 2**bits``, into uint32 words.

  Args:
    codes: unsigned integer array of shape ``(n,)``; only the low ``bits`` bits are kept.
    bits: bits per code, 1 to 32.

  Returns:
    uint32 array of shape ``(ceil(n / 32) * bits,)``.
  """
  _check_bits(bits)
  if codes.ndim != 1:
    raise ValueError(f"codes must be 1-D, got shape {codes.shape}")
  n = codes.shape[0]
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
        f"expected {num_words(n, bits)} words for {n} codes of {bits} bits, "
        f"got shape {words.shape}")
  groups = words.shape[0] // bits
  w = words.reshape(groups, bits)
  planes = jnp.arange(bits, dtype=jnp.uint32)
  lanes = jnp.arange(_LANES, dtype=jnp.uint32)
  bit = (w[:, :, None] >> lanes[None, None, :]) & jnp.uint32(1)  # (groups, bits, 32)
  codes = jnp.sum(bit << planes[None, :, None], axis=1, dtype=jnp.uint32)
  return codes.reshape(-1)[:n]
