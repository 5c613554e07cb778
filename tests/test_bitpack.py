"""Tests of jaxcomp._src.plumbing.bitpack: the uint32 bit-plane packing of small codes."""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp._src.plumbing import bitpack


def _random_codes(n: int, bits: int, seed: int) -> np.ndarray:
  """n codes uniform in [0, 2**bits), as uint32 (the extremes included)."""
  rng = np.random.default_rng(seed)
  hi = 2**bits
  codes = rng.integers(0, hi, size=n, dtype=np.uint64)
  if n >= 2:
    codes[0] = hi - 1  # all ones
    codes[1] = 0
  return codes.astype(np.uint32)


@functools.partial(jax.jit, static_argnums=1)
def _round_trip(codes, bits):
  """pack then unpack, in one compiled call (eager dispatch is slow on 2 cores)."""
  words = bitpack.pack_bits(codes, bits)
  return words, bitpack.unpack_bits(words, bits, codes.shape[0])


def _reference_pack(codes: np.ndarray, bits: int) -> np.ndarray:
  """Plain-Python reading of the two documented layouts.

  Lanes (``bits`` divides 32): code ``idx`` sits in word ``idx // (32 // bits)`` at bit
  offset ``bits * (idx % (32 // bits))``. Bit planes (other widths): word ``g * bits + j``
  holds bit ``j`` of the 32 codes of group ``g``, code ``i`` of the group in bit ``i``
  of the word. Bits past the end are zero.
  """
  n = codes.shape[0]
  if 32 % bits == 0:
    per_word = 32 // bits
    words = np.zeros(-(-n // per_word), np.uint64)
    for idx in range(n):
      w, i = divmod(idx, per_word)
      words[w] |= np.uint64(int(codes[idx])) << np.uint64(bits * i)
    return words.astype(np.uint32)
  groups = -(-n // 32)
  words = np.zeros(groups * bits, np.uint64)
  for idx in range(n):
    g, i = divmod(idx, 32)
    for j in range(bits):
      if (int(codes[idx]) >> j) & 1:
        words[g * bits + j] |= np.uint64(1) << np.uint64(i)
  return words.astype(np.uint32)


@hypothesis.given(
  bits=st.integers(1, 32),
  n=st.integers(1, 300),
  seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_property(bits, n, seed):
  codes = _random_codes(n, bits, seed)
  words, back = _round_trip(jnp.asarray(codes), bits)
  chex.assert_shape(words, (bitpack.num_words(n, bits),))
  chex.assert_type(words, jnp.uint32)
  np.testing.assert_array_equal(np.asarray(words), _reference_pack(codes, bits))
  chex.assert_type(back, jnp.uint32)
  np.testing.assert_array_equal(np.asarray(back), codes)


@pytest.mark.parametrize("bits", list(range(1, 33)))
def test_round_trip_every_width_and_layout(bits):
  # 77 = 2 * 32 + 13: a partial last group.
  n = 77
  codes = _random_codes(n, bits, seed=bits)
  words, back = _round_trip(jnp.asarray(codes), bits)
  words = np.asarray(words)
  expected = -(-n * bits // 32) if 32 % bits == 0 else 3 * bits
  assert words.shape == (bitpack.num_words(n, bits),) == (expected,)
  np.testing.assert_array_equal(words, _reference_pack(codes, bits))
  np.testing.assert_array_equal(np.asarray(back), codes)


@pytest.mark.parametrize(
  "n, bits, expected",
  [
    (1, 1, 1),
    (32, 1, 1),
    (33, 1, 2),
    (64, 3, 6),
    (65, 3, 9),
    (100, 4, 13),
    (100, 5, 20),
    (64, 4, 8),
    (1000, 32, 1000),
    (1000, 31, 32 * 31),
    (0, 5, 0),
  ],
)
def test_num_words(n, bits, expected):
  assert bitpack.num_words(n, bits) == expected
  codes = jax.ShapeDtypeStruct((n,), jnp.uint32)
  out = jax.eval_shape(lambda c: bitpack.pack_bits(c, bits), codes)
  assert out.shape == (expected,) and out.dtype == jnp.uint32


def test_one_bit_layout_value_i_in_bit_i():
  n = 70
  codes = np.zeros(n, np.uint32)
  set_idx = [0, 1, 5, 31, 32, 40, 63, 64, 69]
  codes[set_idx] = 1
  words = np.asarray(_round_trip(jnp.asarray(codes), 1)[0])
  expected = np.zeros(3, np.uint64)
  for idx in set_idx:
    expected[idx // 32] |= np.uint64(1) << np.uint64(idx % 32)
  np.testing.assert_array_equal(words, expected.astype(np.uint32))
  # Single values: value i of a group is bit i of its word.
  for i in (0, 7, 31):
    one = np.zeros(32, np.uint32)
    one[i] = 1
    w, back = _round_trip(jnp.asarray(one), 1)
    np.testing.assert_array_equal(np.asarray(back), one)
    w = np.asarray(w)
    assert w.tolist() == [1 << i]


def test_bit_planes_layout_small_example():
  # Two codes of 3 bits: 5 = 0b101 in lane 0, 6 = 0b110 in lane 1.
  words = np.asarray(_round_trip(jnp.asarray([5, 6], jnp.uint32), 3)[0])
  # plane 0: lane0=1, lane1=0 -> 0b01; plane 1: lane0=0, lane1=1 -> 0b10;
  # plane 2: lane0=1, lane1=1 -> 0b11.
  assert words.tolist() == [1, 2, 3]


def test_lanes_layout_small_example():
  # 4-bit codes, 8 per word, code i in bits 4i..4i+3: 0x1, 0x2, ..., 0x9.
  words = np.asarray(_round_trip(jnp.arange(1, 10, dtype=jnp.uint32), 4)[0])
  assert words.tolist() == [0x87654321, 0x9]


def test_high_bits_are_dropped_and_padding_is_zero():
  codes = jnp.asarray([0xFFFFFFFF, 0b1010, 7], jnp.uint32)
  for bits, lanes_used in ((2, 6), (3, 3)):  # lanes layout, then bit planes
    words, back = _round_trip(codes, bits)
    mask = (1 << bits) - 1
    np.testing.assert_array_equal(np.asarray(back), [mask, 0b1010 & mask, 7 & mask])
    # The bits past the last code hold nothing and stay zero.
    assert np.all(np.asarray(words) >> lanes_used == 0)


def test_under_jit_and_vmap():
  bits, n = 5, 45
  codes = np.stack([_random_codes(n, bits, seed=s) for s in range(4)])
  pack = jax.jit(bitpack.pack_bits, static_argnums=1)
  words = jax.vmap(lambda c: pack(c, bits))(jnp.asarray(codes))
  chex.assert_shape(words, (4, bitpack.num_words(n, bits)))
  for row in range(4):
    np.testing.assert_array_equal(
      np.asarray(words[row]), np.asarray(_round_trip(jnp.asarray(codes[row]), bits)[0])
    )
  back = jax.jit(jax.vmap(lambda w: bitpack.unpack_bits(w, bits, n)))(words)
  np.testing.assert_array_equal(np.asarray(back), codes)


@pytest.mark.parametrize("bits", [0, -1, 33, 64])
def test_pack_bits_out_of_range_raise(bits):
  with pytest.raises(ValueError, match="bits"):
    bitpack.pack_bits(jnp.zeros((10,), jnp.uint32), bits)


@pytest.mark.parametrize("bits", [-1, 33, 64])
def test_unpack_bits_out_of_range_with_wrong_word_count_raise(bits):
  with pytest.raises(ValueError):
    bitpack.unpack_bits(jnp.zeros((3,), jnp.uint32), bits, 10)


@pytest.mark.parametrize("bits", [0, 33])
def test_unpack_bits_out_of_range_raise(bits):
  with pytest.raises(ValueError, match="bits"):
    bitpack.num_words(10, bits)
  with pytest.raises(ValueError, match="bits"):
    bitpack.unpack_bits(jnp.zeros((33,), jnp.uint32), bits, 10)


def test_wrong_word_count_raises():
  words = bitpack.pack_bits(jnp.arange(40, dtype=jnp.uint32), 6)  # 12 words
  with pytest.raises(ValueError, match="words"):
    bitpack.unpack_bits(words[:-1], 6, 40)
  with pytest.raises(ValueError, match="words"):
    bitpack.unpack_bits(jnp.concatenate([words, words[:1]]), 6, 40)
  with pytest.raises(ValueError, match="words"):
    bitpack.unpack_bits(words, 6, 65)  # 65 codes need 3 groups
  with pytest.raises(ValueError):
    bitpack.unpack_bits(words.reshape(2, 6), 6, 40)


def test_codes_must_be_1d():
  with pytest.raises(ValueError, match="1-D"):
    bitpack.pack_bits(jnp.zeros((4, 8), jnp.uint32), 3)
