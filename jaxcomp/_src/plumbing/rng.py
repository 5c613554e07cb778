r"""Counter-based random bits for stochastic rounding: one RNG for XLA and Pallas.

The random bit of element ``i`` of a tensor is a pure function of the tensor's key and
of ``i``::

  k0, k1 = key_words(key)                        # 2 uint32 drawn once per tensor
  h(i)   = mix(mix(i ^ k0) ^ k1)                 # uint32
  u(i)   = (h(i) >> 8) * 2**-24                  # float32 in [0, 1), 24 random bits

where ``mix`` is Wellons' ``lowbias32`` integer finaliser (two multiply/xor-shift
rounds). No state is read or written per element: a Pallas
kernel computes the same ``h(i)`` from its global element index with no extra memory
traffic, so the XLA path and the kernels give bit-identical payloads for the same key.

Everything else that makes the bits independent lives in the key: :func:`jaxcomp.compress`
and the transforms split the state's key per step and fold in the device index and the
leaf index (and the two-phase exchange the chunk index), so ``key`` already stands for
``(seed, step, device, tensor)`` and ``i`` is the element's index within the tensor.

Why not ``jax.random.uniform``: threefry-2x32 is 20 rounds per pair of outputs, far more
arithmetic per value than the rest of a QSGD encode (a scale, a rounding, a shift), so
on a CPU it would dominate the encode; ``python -m benchmarks.codecs`` times both
(``docs/benchmarks.md#codec-throughput-on-cpu``, its "random bits" rows).

Quality: :func:`uniform`'s 24-bit outputs pass chi-square tests of equidistribution
(1-D, and of pairs of neighbours), a Kolmogorov-Smirnov test, and per-bit balance tests
(``tests/test_rng.py``). Two keys whose second words coincide (probability 2**-32 per
pair) give streams that are index-permuted copies of each other; with 64-bit keys from
threefry this is the only structural weakness, and it does not bias any single stream.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

Array = jax.Array
_U32 = jnp.uint32

#: The two multipliers of ``lowbias32`` (C. Wellons, "Prospecting for hash functions").
MULTIPLIERS = (0x7FEB352D, 0x846CA68B)


def mix32(x: Array) -> Array:
  """Wellons' ``lowbias32`` finaliser: a bijection of uint32 with strong avalanche."""
  x = x ^ (x >> 16)
  x = x * _U32(MULTIPLIERS[0])
  x = x ^ (x >> 15)
  x = x * _U32(MULTIPLIERS[1])
  return x ^ (x >> 16)


def key_words(key: Array) -> tuple[Array, Array]:
  """The two uint32 words that seed :func:`hash_bits`, drawn from ``key`` (any impl).

  Accepts a typed key (``jax.random.key``) or raw ``uint32`` key data.
  """
  if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)
  if key.shape:
    raise ValueError(f"expected a single key, got a key array of shape {key.shape}")
  words = jax.random.bits(key, (2,), _U32)
  return words[0], words[1]


def hash_bits(index: Array, k0: Array, k1: Array) -> Array:
  """32 random bits of element ``index`` (uint32) under the key words ``(k0, k1)``."""
  return mix32(mix32(index.astype(_U32) ^ k0) ^ k1)


def counters(shape: tuple[int, ...], offset: int | Array = 0) -> Array:
  """Row-major element indices of ``shape`` (plus ``offset``), as uint32.

  Indices wrap modulo 2**32: a tensor of more than 2**32 elements reuses bits.
  """
  size = 1
  for d in shape:
    size *= int(d)
  if size > 2**32:
    raise ValueError(f"counter-based bits need fewer than 2**32 elements, got {size}")
  idx = lax.iota(_U32, size).reshape(shape) if shape else jnp.zeros((), _U32)
  return idx + jnp.asarray(offset, _U32)


def bits24(key: Array, shape: tuple[int, ...], offset: int | Array = 0) -> Array:
  """24 random bits per element (uint32 in ``[0, 2**24)``), element ``i`` from ``h(i)``."""
  k0, k1 = key_words(key)
  return hash_bits(counters(shape, offset), k0, k1) >> 8


def uniform(key: Array, shape: tuple[int, ...], offset: int | Array = 0) -> Array:
  """Uniform float32 in ``[0, 1)`` on the grid ``j / 2**24`` (exact in float32).

  ``uniform(key, shape)[idx]`` depends only on ``key`` and the row-major index of
  ``idx`` (plus ``offset``): slicing a tensor and passing the slice's ``offset`` gives the
  same values as drawing for the whole tensor.
  """
  return bits24(key, shape, offset).astype(jnp.float32) * jnp.float32(2.0**-24)


def bernoulli_round(r: Array, key: Array, offset: int | Array = 0) -> Array:
  r"""Stochastic rounding of non-negative float32 ``r``: ``floor(r) + Bernoulli(r - floor(r))``.

  Unbiased: ``E[out] = r`` up to the 2**-24 grid of the uniform draw. Returned as
  float32 (an integer value).
  """
  low = jnp.floor(r)
  # u < frac  <=>  u24 < frac * 2**24: an exact power-of-two scaling, no division.
  up = bits24(key, r.shape, offset).astype(jnp.float32) < (r - low) * jnp.float32(2.0**24)
  return low + up.astype(jnp.float32)
