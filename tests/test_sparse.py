"""Sparse codecs: TopK (exact, blocked, DGC's sampled threshold), RandomK, psum exchange."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp._src.codecs import sparse
from tests import helpers
from tests.helpers import AXIS
from tests.helpers import K

C = jc.codecs


@functools.cache
def _encode(codec):
  return jax.jit(lambda x, key: codec.encode(x, key=key))


def _indices(payload):
  idx = np.asarray(payload.arrays["indices"]).astype(np.int64)
  return idx[idx < np.prod(payload.shape)]


def _heavy_tailed(key, n):
  # Student-t with 1.5 degrees of freedom: infinite variance, like real gradient tails.
  return jax.random.t(key, 1.5, (n,), jnp.float32)


# ----------------------------------------------------------------------------- top-k


@hypothesis.settings(max_examples=10)  # each new n compiles lax.top_k afresh
@hypothesis.given(
  n=st.integers(1, 3000),
  density=st.sampled_from([0.001, 0.01, 0.3, 1.0]),
  seed=st.integers(0, 2**16),
)
def test_topk_exact_is_lax_top_k(n, density, seed):
  x = jax.random.normal(jax.random.key(seed), (n,))
  payload = jax.jit(C.TopK(density).encode)(x)  # one compile per n, not one per op
  k = sparse.num_entries(density, n)
  _, want = lax.top_k(jnp.abs(x), k)
  np.testing.assert_array_equal(
    np.asarray(payload.arrays["indices"]).astype(np.int64), np.asarray(want)
  )
  np.testing.assert_array_equal(payload.arrays["values"], np.asarray(x)[np.asarray(want)])
  dense = np.zeros(n, np.float32)
  dense[np.asarray(want)] = np.asarray(x)[np.asarray(want)]
  np.testing.assert_array_equal(jax.jit(C.TopK(density).decode)(payload), dense)


def _numpy_top_k(x, k) -> np.ndarray:
  """Positions of the k largest |x|, decreasing, ties to the lower position."""
  return np.argsort(-np.abs(np.asarray(x, np.float32)), kind="stable")[:k]


def _assert_exact_top_k(codec, x, payload):
  """The payload holds exactly numpy's top-k of |x|: same indices, same order, values."""
  k = codec.num_entries(x.size)
  want = _numpy_top_k(x, k)
  np.testing.assert_array_equal(np.asarray(payload.arrays["indices"]).astype(np.int64), want)
  np.testing.assert_array_equal(payload.arrays["values"], np.asarray(x)[want])


@pytest.mark.parametrize("n", [100, 4096, 100_003])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("method", ["blocked", "sampled"])
def test_topk_blocked_and_sampled_are_exact(n, density, method):
  x = jax.random.normal(jax.random.key(n), (n,))
  codec = C.TopK(density, method)
  _assert_exact_top_k(codec, x, _encode(codec)(x, jax.random.key(0)))


def _tied(key, n, distinct):
  """Values with many exact ties in magnitude (both signs), and some zeros."""
  k1, k2 = jax.random.split(key)
  mag = jax.random.randint(k1, (n,), 0, distinct).astype(jnp.float32) / 4
  return jnp.where(jax.random.bernoulli(k2, 0.5, (n,)), -mag, mag)


# (sample_fraction, max_rounds, capacity_factor): the default; a tiny sample with no
# refinement and no slack (the count rarely lands in [k, k]); a large sample, one round.
_SAMPLED_SETTINGS = [(0.01, 10, 2.0), (0.001, 0, 1.0), (0.3, 1, 1.3)]


@hypothesis.settings(max_examples=10)  # each (density, setting) compiles once
@hypothesis.given(
  density=st.sampled_from([0.002, 0.2]),
  distinct=st.sampled_from([1, 2, 5, 1000]),
  setting=st.sampled_from(_SAMPLED_SETTINGS),
  seed=st.integers(0, 2**16),
)
def test_topk_sampled_equals_numpy_top_k_with_ties(density, distinct, setting, seed):
  """Whatever the sample and the refinement do (rounds used up, buffer overflowing, fewer
  non-zeros than k, magnitudes tied across the threshold), the sampled method returns
  numpy's stable top-k: exactly k entries, ties to the lower position."""
  x = _tied(jax.random.key(seed), 20_000, distinct)
  sample_fraction, max_rounds, capacity_factor = setting
  codec = C.TopK(
    density,
    "sampled",
    sample_fraction=sample_fraction,
    max_rounds=max_rounds,
    capacity_factor=capacity_factor,
  )
  _assert_exact_top_k(codec, x, _encode(codec)(x, jax.random.key(seed + 1)))
  blocked = C.TopK(density, "blocked")
  _assert_exact_top_k(blocked, x, _encode(blocked)(x, jax.random.key(0)))


@pytest.mark.parametrize("dist", ["gaussian", "heavy_tailed"])
@pytest.mark.parametrize("density", [0.001, 0.01])
def test_topk_sampled_is_exact_on_large_vectors(dist, density):
  n = 200_000
  codec = C.TopK(density, "sampled")
  for seed in range(3):
    gen = jax.random.normal if dist == "gaussian" else (lambda kk, s: _heavy_tailed(kk, s[0]))
    x = gen(jax.random.key(seed), (n,))
    _assert_exact_top_k(codec, x, _encode(codec)(x, jax.random.key(100 + seed)))


def test_topk_sampled_with_fewer_nonzeros_than_k():
  """Fewer than k non-zeros: no threshold passes k entries, the exact path returns them
  and then zeros at the lowest positions, as lax.top_k does."""
  n = 5000
  x = jnp.zeros(n).at[jnp.array([3, 700, 4000])].set(jnp.array([1.0, -2.0, 0.5]))
  codec = C.TopK(0.002, "sampled")  # k = 10 > 3 non-zeros
  payload = _encode(codec)(x, jax.random.key(0))
  _assert_exact_top_k(codec, x, payload)
  assert list(_indices(payload)[:3]) == [700, 3, 4000]
  np.testing.assert_array_equal(codec.decode(payload), x)
  zero = _encode(codec)(jnp.zeros(n), jax.random.key(0))
  np.testing.assert_array_equal(codec.decode(zero), jnp.zeros(n))


@pytest.mark.parametrize(
  "max_rounds,capacity_factor,branch",
  [
    (0, 1.0, "overflow"),  # the first threshold, aimed at 1.4k, passes more than k
    (10, 2.0, "buffer"),  # the refinement lands in [k, 2k]: the passing blocks
  ],
)
def test_topk_sampled_takes_each_branch_exactly(max_rounds, capacity_factor, branch):
  n, density = 50_000, 0.01
  x = jax.random.normal(jax.random.key(3), (n,))
  k = sparse.num_entries(density, n)
  capacity = int(np.ceil(capacity_factor * k))
  _, passed = sparse.sampled_threshold_select(
    jnp.abs(x), k, jax.random.key(1), sample_fraction=0.01, max_rounds=max_rounds, capacity=capacity
  )
  assert (int(passed) > capacity) == (branch == "overflow")
  assert (k <= int(passed) <= capacity) == (branch == "buffer")
  idx, _ = jax.jit(
    functools.partial(
      sparse.sampled_threshold_select,
      k=k,
      sample_fraction=0.01,
      max_rounds=max_rounds,
      capacity=capacity,
    )
  )(jnp.abs(x), key=jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(idx), _numpy_top_k(x, k))


def test_topk_nan_is_not_hidden_and_inputs_validated():
  x = jnp.ones(4096).at[7].set(jnp.nan)
  for method in ("exact", "sampled"):
    decoded = C.TopK(0.01, method).decode(_encode(C.TopK(0.01, method))(x, jax.random.key(0)))
    assert not bool(jnp.all(jnp.isfinite(decoded)))
  with pytest.raises(ValueError):
    C.TopK(0.0)
  with pytest.raises(ValueError):
    C.TopK(1.5)
  with pytest.raises(ValueError):
    C.TopK(0.1, "approx")
  with pytest.raises(ValueError):
    C.TopK(0.1, "sampled").encode(jnp.ones(100))  # needs a key
  with pytest.raises(TypeError):
    C.TopK(0.1).encode(jnp.ones(100, jnp.int32))


@pytest.mark.parametrize("size", [1, 7, 40, 200])
def test_compact_is_nonzero_with_padding(size):
  mask = jax.random.bernoulli(jax.random.key(size), 0.1, (300,))
  want = jnp.nonzero(mask, size=size, fill_value=300)[0]
  np.testing.assert_array_equal(sparse.compact(mask, size), want)


_compact = jax.jit(sparse.compact, static_argnums=1)


def _nonzero(mask: np.ndarray, size: int) -> np.ndarray:
  pos = np.flatnonzero(mask)[:size]
  return np.concatenate([pos, np.full(size - pos.size, mask.size)]).astype(np.int32)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
  n=st.integers(1, 700),
  density=st.sampled_from([0.0, 0.02, 0.3, 0.9, 1.0]),
  size_frac=st.sampled_from([0.01, 0.1, 0.125, 0.5, 1.0, 1.5]),
  seed=st.integers(0, 2**16),
)
def test_compact_search_and_scatter_branches(n, density, size_frac, seed):
  """Both branches (binary search for size <= n/8, scatter above) against np.flatnonzero:
  ragged last words, masks with no or every bit set, outputs longer than the count."""
  mask = np.random.default_rng(seed).random(n) < density
  size = max(1, int(size_frac * n))
  np.testing.assert_array_equal(_compact(jnp.asarray(mask), size), _nonzero(mask, size))


@pytest.mark.parametrize("size", [3000, 2**19])
def test_compact_above_the_cumsum_limit(size):
  """2**20 values: 2**15 words, above _CUMSUM_MAX, so the word sums take the
  associative scan; every 32-bit word pattern edge (bit 0, bit 31) is present."""
  n = 2**20
  assert n // 32 > sparse._CUMSUM_MAX
  mask = np.random.default_rng(5).random(n) < 0.01
  mask[[0, 31, 32, 63, n - 1]] = True
  np.testing.assert_array_equal(_compact(jnp.asarray(mask), size), _nonzero(mask, size))


_first_trues = jax.jit(sparse.first_trues)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
  n=st.sampled_from([1, 31, 32, 33, 100, 700]),
  density=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
  count=st.integers(-2, 702),
  seed=st.integers(0, 2**16),
)
def test_first_trues_is_the_cumsum_cut(n, density, count, seed):
  mask = np.random.default_rng(seed).random(n) < density
  want = mask & (np.cumsum(mask) <= count)
  np.testing.assert_array_equal(_first_trues(jnp.asarray(mask), count), want)


def test_select_bit_every_rank():
  words = np.array([0xFFFFFFFF, 0x80000001, 0x12345678, 1, 0x80000000], np.uint32)
  for w in words:
    bits = [i for i in range(32) if (int(w) >> i) & 1]
    got = sparse.select_bit(
      jnp.full(len(bits), w, jnp.uint32), jnp.arange(1, len(bits) + 1, dtype=jnp.int32)
    )
    np.testing.assert_array_equal(got, bits)


@pytest.mark.parametrize(
  "n,dtype",
  [(200, np.uint8), (255, np.uint8), (256, np.uint16), (65535, np.uint16), (65536, np.int32)],
)
def test_index_dtype_is_the_narrowest_that_holds_n(n, dtype):
  codec = C.TopK(0.01)
  payload = jax.eval_shape(lambda x: codec.encode(x), jax.ShapeDtypeStruct((n,), jnp.float32))
  assert payload.arrays["indices"].dtype == dtype
  k = sparse.num_entries(0.01, n)
  assert codec.wire_bits((n,)) == 8 * k * (4 + np.dtype(dtype).itemsize)
  assert codec.wire_bits((n,)) == 8 * payload_nbytes(payload)


def payload_nbytes(p):
  return C.payload_nbytes(p)


def test_decode_sum_adds_every_devices_entries_bf16():
  codec = C.TopK(0.05)
  xs = jax.random.normal(jax.random.key(0), (K, 40, 30), jnp.bfloat16)
  stacked = jax.vmap(codec.encode)(xs)
  want = sum(
    np.asarray(codec.decode(jax.tree.map(lambda a: a[i], stacked)), np.float32) for i in range(K)
  )
  got = codec.decode_sum(stacked)
  assert got.shape == (40, 30) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert codec.decode(jax.tree.map(lambda a: a[0], stacked)).dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- random-k


@pytest.mark.parametrize("n,k", [(10, 3), (12, 4), (7, 7), (1000, 33)])
def test_systematic_sampling_includes_each_index_with_probability_k_over_n(n, k):
  # Exhaustive over the start r: each index is hit by exactly k of the n starts.
  idx = np.asarray(
    jax.vmap(lambda r: sparse.systematic_from_start(r, n, k))(jnp.arange(n, dtype=jnp.int32))
  )
  assert all(len(set(row)) == k for row in idx)  # distinct
  np.testing.assert_array_equal(np.bincount(idx.reshape(-1), minlength=n), np.full(n, k))


def test_systematic_sampling_does_not_overflow_near_int32_limits():
  n = 2**31 - 2
  idx = sparse.systematic_from_start(jnp.int32(n - 1), n, 4)
  np.testing.assert_array_equal(idx, [n - 1, n // 4 - 1, n // 2 - 1, 3 * n // 4 - 1])


def test_randomk_is_unbiased_with_the_formula_variance():
  n, density, m = 64, 0.125, 20_000
  codec = C.RandomK(density)
  x = jax.random.normal(jax.random.key(0), (n,))
  keys = jax.random.split(jax.random.key(1), m)
  q = np.asarray(jax.vmap(lambda kk: codec.decode(codec.encode(x, key=kk)))(keys), np.float64)
  xs = np.asarray(x, np.float64)
  var = xs**2 * (n / 8 - 1)  # per coordinate, k = 8
  se = np.sqrt(var / m)
  assert np.all(np.abs(q.mean(0) - xs) < 5 * se)
  # E||Q - x||^2 = (n/k - 1)||x||^2; its sample mean within 5 standard errors.
  err = np.sum((q - xs) ** 2, axis=1)
  assert abs(err.mean() - var.sum()) < 5 * err.std() / np.sqrt(m)
  # Negative control: without the n/k scale the same test fails.
  assert not np.all(np.abs(q.mean(0) * 8 / n - xs) < 5 * se)


def test_randomk_shared_indices_through_psum():
  m = helpers.mesh()
  params = {"w": jnp.zeros((64, 64))}
  tx = jc.per_device_state(
    jc.compress(C.RandomK(0.05, shared=True), axis_name=AXIS, collective="psum")
  )
  state = helpers.shard_map_init(tx, params, m)
  grads = helpers.per_device_grads(jax.random.key(0), {"w": (64, 64)})
  update = helpers.shard_map_update(tx, m, params)
  out, _ = update(helpers.shard(grads, m), state)
  out = np.asarray(out["w"]).reshape(-1)
  support = np.flatnonzero(out)
  k = sparse.num_entries(0.05, 64 * 64)
  assert len(support) == k
  g = np.asarray(grads["w"]).reshape(K, -1)
  np.testing.assert_allclose(out[support], g[:, support].mean(0) * (4096 / k), rtol=1e-5, atol=1e-6)
  # Only the k values cross the wire, all-reduced: 2(K-1)/K · 4k bytes, flat in K.
  for kk in (2, 8, 64):
    report = jc.wire_report(tx, params, axis_name=AXIS, num_devices=kk)
    sizes = sorted(op.operand_bytes for op in report.ops)
    assert sizes[-1] == 4 * k
    assert report.bytes_received == pytest.approx(2 * (kk - 1) / kk * 4 * k)


def test_psum_needs_a_summable_codec():
  with pytest.raises(ValueError, match="summed"):
    jc.compress(C.TopK(0.1), axis_name=AXIS, collective="psum")
  with pytest.raises(ValueError, match="summed"):
    jc.compress(C.RandomK(0.1), axis_name=AXIS, collective="psum")  # indices differ


def test_topk_through_compress_allgather_with_error_feedback():
  m = helpers.mesh()
  params = {"w": jnp.zeros((64, 64))}
  tx = jc.per_device_state(
    jc.compress(
      C.TopK(0.01, "sampled"), axis_name=AXIS, error_feedback=True, collective="allgather"
    )
  )
  state = helpers.shard_map_init(tx, params, m)
  update = helpers.shard_map_update(tx, m, params)
  grads = helpers.per_device_grads(jax.random.key(0), {"w": (64, 64)})
  out, state = update(helpers.shard(grads, m), state)
  g = np.asarray(grads["w"]).reshape(K, -1)
  res = np.asarray(state.inner.residual["w"]).reshape(K, -1)
  sent = g - res  # error feedback: what was sent plus what is held is what came in
  assert np.all(np.sum(sent != 0, axis=1) == 41)
  np.testing.assert_allclose(np.asarray(out["w"]).reshape(-1), sent.mean(0), atol=1e-6)


# ----------------------------------------------------------------------------- sparsify


def test_sparsify_under_shard_map_counts_overflow_and_bytes():
  m = helpers.mesh()
  params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros((64,))}
  shapes = {"w": (64, 64), "b": (64,)}
  grads = helpers.per_device_grads(jax.random.key(0), shapes)
  for capacity, overflows in ((None, 0), (0.002, 1)):
    tx = jc.per_device_state(jc.sparsify(density=0.05, axis_name=AXIS, capacity=capacity))
    state = helpers.shard_map_init(tx, params, m)
    out, state = helpers.shard_map_update(tx, m, params)(helpers.shard(grads, m), state)
    np.testing.assert_array_equal(state.inner.overflow_count, np.full((K,), overflows))
    # The dense leaf is a plain pmean; the sparse one has at most K * capacity entries.
    np.testing.assert_allclose(out["b"], np.asarray(grads["b"]).mean(0), rtol=1e-6)
    codec = jc.codecs.UnbiasedSparsifier(density=0.05, capacity=capacity)
    slots, _ = codec.capacities(64 * 64)
    assert 0 < np.sum(np.asarray(out["w"]) != 0) <= K * slots
    report = jc.wire_report(tx, params, axis_name=AXIS, num_devices=K)
    gathered = sum(op.bytes_received for op in report.ops if "all_gather" in op.primitive)
    assert gathered == (K - 1) * codec.wire_bits((64, 64)) / 8


def test_sparsify_is_unbiased_over_steps():
  # One device (axis None): the average of many steps' updates converges to g.
  tx = jc.sparsify(density=0.1, filter=lambda p, x: True, axis_name=None)
  g = {"w": jax.random.normal(jax.random.key(1), (256,))}
  state = tx.init(g)

  def body(state, _):
    out, state = tx.update(g, state)
    return state, out["w"]

  _, outs = jax.jit(lambda s: jax.lax.scan(body, s, None, length=4000))(state)
  outs = np.asarray(outs, np.float64)
  t, gw = outs.shape[0], np.abs(np.asarray(g["w"], np.float64))
  # out_i = g_i Z_i / p_i, Z_i ~ Bernoulli(p_i): Var = g_i^2 (1 - p_i) / p_i. An entry
  # kept in none of the T steps (p_i ~ 1/T or less) has an empirical SE of 0, so the SE
  # takes the Bernoulli form with p_i estimated as max(keep frequency, 1/T).
  p_hat = np.maximum((outs != 0).mean(0), 1.0 / t)
  se = np.maximum(outs.std(0), gw * np.sqrt((1 - p_hat) / p_hat)) / np.sqrt(t)
  assert np.all(np.abs(outs.mean(0) - np.asarray(g["w"])) < 5 * se + 1e-6)
  assert np.mean(np.sum(outs != 0, axis=1)) == pytest.approx(25.6, rel=0.05)
