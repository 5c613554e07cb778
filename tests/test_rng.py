"""Tests of jaxcomp._src.plumbing.rng: the counter-based bits of stochastic rounding.

The statistical tests use fixed keys, so they are deterministic; their thresholds are
p-values of 1e-4 (or 5 standard errors), and the power check below shows that the same
tests reject a generator with a known flaw.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxcomp._src.plumbing import rng

N = 2**20


def _mix32_numpy(x: np.ndarray) -> np.ndarray:
  """lowbias32 in NumPy uint64 arithmetic, masked to 32 bits: the spec of rng.mix32."""
  m = np.uint64(0xFFFFFFFF)
  x = x.astype(np.uint64)
  x ^= x >> np.uint64(16)
  x = (x * np.uint64(0x7FEB352D)) & m
  x ^= x >> np.uint64(15)
  x = (x * np.uint64(0x846CA68B)) & m
  x ^= x >> np.uint64(16)
  return x


@functools.partial(jax.jit, static_argnums=1)
def _uniform(key, n, offset=0):
  return rng.uniform(key, (n,), offset)


def test_hash_matches_numpy_specification():
  key = jax.random.key(7)
  k0, k1 = (int(w) for w in rng.key_words(key))
  idx = np.arange(4096, dtype=np.uint64)
  want = _mix32_numpy(_mix32_numpy(idx ^ np.uint64(k0)) ^ np.uint64(k1)).astype(np.uint32)
  got = jax.jit(lambda i: rng.hash_bits(i, *rng.key_words(key)))(jnp.arange(4096, dtype=jnp.uint32))
  np.testing.assert_array_equal(np.asarray(got), want)
  # mix32 is Wellons' lowbias32, written out above (a change breaks the kernels' bits).
  np.testing.assert_array_equal(
    np.asarray(rng.mix32(jnp.arange(8, dtype=jnp.uint32))),
    _mix32_numpy(np.arange(8)).astype(np.uint32),
  )


def test_uniform_grid_range_and_offsets():
  key = jax.random.key(3)
  u = np.asarray(_uniform(key, 1000))
  assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
  np.testing.assert_array_equal(u * 2**24, np.floor(u * 2**24))  # on the 2**-24 grid
  # A slice drawn with its offset equals the same slice of the whole draw.
  np.testing.assert_array_equal(np.asarray(_uniform(key, 300, 500)), u[500:800])
  # The shape only orders the indices (row-major).
  u2 = np.asarray(jax.jit(lambda k: rng.uniform(k, (10, 100)))(key))
  np.testing.assert_array_equal(u2.reshape(-1), u)
  # Raw uint32 key data works like the typed key.
  np.testing.assert_array_equal(np.asarray(_uniform(jax.random.key_data(key), 1000)), u)


def test_key_words_rejects_key_arrays():
  with pytest.raises(ValueError, match="single key"):
    rng.key_words(jax.random.split(jax.random.key(0), 2))


def test_counters_limit():
  with pytest.raises(ValueError, match="2\\*\\*32"):
    rng.counters((2**17, 2**16))


def _chi2_pvalue(samples: np.ndarray, bins: int) -> float:
  counts = np.bincount(samples, minlength=bins)
  return stats.chisquare(counts).pvalue


def _equidistribution_pvalues(u: np.ndarray) -> dict[str, float]:
  """p-values of 1-D (256 bins), pair (16 x 16), KS, and the worst per-bit z-score."""
  cells = (u * 256).astype(np.int64)
  pairs = (u[0::2] * 16).astype(np.int64) * 16 + (u[1::2] * 16).astype(np.int64)
  return {
    "chi2_1d": _chi2_pvalue(cells, 256),
    "chi2_pairs": _chi2_pvalue(pairs, 256),
    "ks": stats.kstest(u, "uniform").pvalue,
  }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_passes_equidistribution_tests(seed):
  u = np.asarray(_uniform(jax.random.key(seed), N)).astype(np.float64)
  for name, p in _equidistribution_pvalues(u).items():
    assert p > 1e-4, (name, p)
  # Each of the 24 bits is a fair coin: |z| < 5 standard errors.
  bits = (u * 2**24).astype(np.uint32)
  ones = np.array([np.sum((bits >> j) & 1) for j in range(24)])
  z = (ones - N / 2) / np.sqrt(N / 4)
  assert np.max(np.abs(z)) < 5, z


def test_streams_of_different_keys_are_uncorrelated():
  key = jax.random.key(11)
  streams = np.stack(
    [np.asarray(_uniform(jax.random.fold_in(key, i), N // 4)) for i in range(4)]
  ).astype(np.float64)
  r = np.corrcoef(streams)
  off = r[~np.eye(4, dtype=bool)]
  assert np.max(np.abs(off)) < 5 / np.sqrt(N // 4), off  # 5 standard errors of r


def test_tests_have_power_against_a_weyl_sequence():
  # u_i = frac(i * golden ratio): perfectly equidistributed in 1-D but its pairs lie on
  # a few lines. The pair test must reject it (else the tests above prove little).
  i = np.arange(N, dtype=np.uint64)
  weyl = ((i * np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF)) >> np.uint64(8)
  p = _equidistribution_pvalues(weyl.astype(np.float64) / 2**24)
  assert p["chi2_pairs"] < 1e-10


def test_bernoulli_round_is_unbiased():
  r = jnp.full((N,), 2.3, jnp.float32)
  out = np.asarray(jax.jit(lambda k: rng.bernoulli_round(r, k))(jax.random.key(5)))
  assert set(np.unique(out)) == {2.0, 3.0}
  frac = 0.3 + (np.float32(2.3) - 2.3)  # the float32 value's fractional part
  se = np.sqrt(frac * (1 - frac) / N)
  assert abs(out.mean() - 2.0 - frac) < 5 * se
  # Integers round to themselves.
  ints = jnp.arange(100, dtype=jnp.float32)
  np.testing.assert_array_equal(rng.bernoulli_round(ints, jax.random.key(0)), ints)
