"""Tests of UnbiasedSparsifier (Wangni, Wang, Liu, Zhang, NeurIPS 2018).

Statistical tests draw M keys at once (``jax.vmap`` over keys) and allow 5 standard
errors. Where the keep probabilities are known, the standard errors come from the exact
per-coordinate variance ``x_i^2 (1/p_i - 1)``; on the overflow path (whose variance is
larger) from the samples. Negative controls (a 3% scale error, a silent truncation at the
capacity) show that the checks can fail. The optimisation itself is checked without
sampling: the variance constraint on p, Algorithm 2 against a sort-based reference and a
generic convex solver (scipy), Algorithm 3's density, Lemma 3 and Theorem 4.
"""

import functools
import math

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from jaxcomp._src.codecs import wangni

# (the defining module: its helpers exact_lambda, exact_lambda_sorted and
# capacity_tail_bound are tested too)
from jaxcomp._src.codecs.wangni import UnbiasedSparsifier
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.plumbing import rng

M = 4000  # Monte Carlo draws
Z = 5.0  # standard errors allowed
N = 400  # length of the sampled vectors


# ----------------------------------------------------------------------------- helpers


def _keys(m: int, seed: int = 0):
  data = np.random.default_rng(2000 + seed).integers(0, 2**32, size=(m, 2), dtype=np.uint32)
  return jax.random.wrap_key_data(jnp.asarray(data))


def _heavy(n, seed, zeros=8):
  """Heavy-tailed values (normal times lognormal), with a few exact zeros."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n) * np.exp(1.5 * rng.standard_normal(n))
  x[rng.choice(n, size=zeros, replace=False)] = 0.0
  return x.astype(np.float32)


def _normal(n, seed):
  return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


# Compilation dominates on 2 cores: the jitted functions are cached per codec and the
# tests share a few codecs and one length N.


@functools.cache
def _sampler(codec):
  """jit(vmap over keys): (decoded float32, overflowed) for each key."""

  def one(x, key):
    payload, overflowed = codec.encode_with_info(x, key=key)
    return codec.decode(payload, jnp.float32), overflowed

  return jax.jit(jax.vmap(one, in_axes=(None, 0)))


def _samples(codec, x, m=M, seed=0):
  out, ov = _sampler(codec)(jnp.asarray(x), _keys(m, seed))
  return np.asarray(out, np.float64).reshape(m, -1), np.asarray(ov)


def _encode(codec, x, key):
  """codec.encode_with_info: one jitted program, cached per (codec, shape, dtype)."""
  return codec.encode_with_info(jnp.asarray(x), key=key)


@functools.cache
def _decode_fn(codec):
  return jax.jit(lambda payload: codec.decode(payload, jnp.float32))


def _round_trip(codec, x, key):
  """float32 decoding of x (compiles only the codec's encode and decode)."""
  payload, _ = _encode(codec, x, key)
  return np.asarray(_decode_fn(codec)(payload))


@functools.cache
def _probs_fn(codec):
  return jax.jit(codec.probabilities)


def _probs(codec, x):
  p, lam = _probs_fn(codec)(jnp.asarray(x))
  return np.asarray(p, np.float64), float(lam)


def _unbiasedness_check(samples, x, var, min_hits=30.0, p=None):
  """Whether the sample means are consistent with E[Q(x)] = x, within Z standard errors.

  ``var`` is the per-coordinate variance of one draw (exact, or estimated). Coordinates
  with zero variance (p = 1, or x = 0) must be exact; the others are z-tested one by one
  and in aggregate (``sum z^2`` against its chi-square mean and sd) where enough draws
  keep them (``M p >= min_hits``, where the normal approximation holds).
  """
  x = np.asarray(x, np.float64)
  m = samples.shape[0]
  err = samples.mean(axis=0) - x
  se = np.sqrt(var / m)
  hits = (samples != 0).sum(axis=0) if p is None else m * p
  # (with an estimated variance, a coordinate never kept has variance 0 too: skipped)
  exact = (se == 0) & ((x == 0) | (hits > 0))
  exact_ok = bool(np.all(np.abs(err[exact]) <= 1e-6 * np.abs(x[exact])))
  sel = (se > 0) & (hits >= min_hits)
  assert sel.sum() >= 20, "too few coordinates to test"
  zs = err[sel] / se[sel]
  k = int(sel.sum())
  t = float(np.sum(zs**2))
  agg_ok = t <= k + Z * math.sqrt(2 * k)
  coord_ok = bool(np.all(np.abs(zs) <= Z))
  msg = (
    f"exact coords ok={exact_ok}; sum z^2={t:.1f} vs {k} + {Z}*{math.sqrt(2 * k):.1f}; "
    f"max |z|={float(np.max(np.abs(zs))):.2f} over {k} coordinates"
  )
  return exact_ok and agg_ok and coord_ok, msg


def _exact_var(x, p):
  x = np.asarray(x, np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(p > 0, x * x * (1.0 / p - 1.0), 0.0)


GREEDY = UnbiasedSparsifier(density=0.1)
EXACT = UnbiasedSparsifier(method="exact", epsilon=0.5)
X_HEAVY = _heavy(N, seed=1)
X_NORMAL = _normal(N, seed=2)
CASES = {
  "greedy-heavy": (GREEDY, X_HEAVY),
  "exact-heavy": (EXACT, X_HEAVY),
  "exact-normal": (EXACT, X_NORMAL),
}


# ----------------------------------------------------------------------------- unbiasedness


@pytest.mark.parametrize("name", list(CASES))
def test_unbiased(name):
  codec, x = CASES[name]
  samples, ov = _samples(codec, x)
  assert not ov.any()  # the default capacity holds (P(overflow) < 1.6e-8 per draw)
  p, _ = _probs(codec, x)
  assert 0 < np.sum(p >= 1) < N or name == "exact-normal"  # dense entries exercised
  ok, msg = _unbiasedness_check(samples, x, _exact_var(x, p), p=p)
  assert ok, msg
  # zeros stay zero, signs are kept, dense entries are sent exactly
  assert np.all(samples[:, x == 0] == 0)
  assert np.all(samples * x >= 0)
  dense = p >= 1
  np.testing.assert_array_equal(samples[:, dense], np.broadcast_to(x[dense], (M, dense.sum())))


def test_unbiasedness_check_rejects_biased_variants():
  """Negative controls: the same samples with a 3% scale error on the sign entries, and
  a silent drop of the kept entries beyond the first 30 (by position), both fail."""
  samples, _ = _samples(GREEDY, X_HEAVY)
  p, _ = _probs(GREEDY, X_HEAVY)
  var = _exact_var(X_HEAVY, p)
  assert _unbiasedness_check(samples, X_HEAVY, var, p=p)[0]
  scaled = np.where(p < 1, 1.03 * samples, samples)
  ok, msg = _unbiasedness_check(scaled, X_HEAVY, var, p=p)
  assert not ok, msg
  truncated = np.where(np.cumsum(samples != 0, axis=1) <= 30, samples, 0.0)
  assert (truncated != samples).any(axis=1).mean() > 0.5
  ok, msg = _unbiasedness_check(truncated, X_HEAVY, var, p=p)
  assert not ok, msg


# ----------------------------------------------------------------------------- Algorithm 2


@pytest.mark.parametrize("name", ["exact-heavy", "exact-normal"])
def test_exact_variance_budget_is_met_and_matches_samples(name):
  codec, x = CASES[name]
  x64 = x.astype(np.float64)
  p, lam = _probs(codec, x)
  norm2 = float(np.sum(x64**2))
  nz = x64 != 0
  second = float(np.sum(x64[nz] ** 2 / p[nz]))  # E||Q(x)||^2
  eps = codec.epsilon
  # the optimum uses the whole budget: equality, up to float32 rounding
  assert second == pytest.approx((1 + eps) * norm2, rel=2e-6)
  assert second <= (1 + eps) * norm2 * (1 + 2e-6)
  # p = min(λ|x|, 1), λ in the units of x
  np.testing.assert_allclose(p, np.minimum(lam * np.abs(x64), 1.0), rtol=2e-6, atol=1e-7)
  samples, _ = _samples(codec, x, seed=1)
  sq = np.sum(samples**2, axis=1)
  se = sq.std(ddof=1) / math.sqrt(M)
  assert abs(sq.mean() - second) <= Z * se, (sq.mean(), second, se)
  assert sq.mean() <= (1 + eps) * norm2 + Z * se


def _tied(n):
  return np.repeat(np.array([3.0, -2.0, 1.0, 0.5], np.float32), n // 4)


EXACT_LAMBDA_VECTORS = {
  "heavy": _heavy(N, 1),
  "normal": _normal(N, 2),
  "ties": _tied(N),
  "one-big": np.concatenate([[1000.0], np.full(N - 1, 0.01)]).astype(np.float32),
  "all-equal": np.full(N, -0.25, np.float32),
  "sparse": np.where(np.arange(N) % 50 == 0, 5.0, 0.0).astype(np.float32),
}


@pytest.mark.parametrize("eps", [0.05, 0.5, 4.0])
def test_exact_bisection_equals_sorting_reference(eps):
  """exact_lambda (bisection, no sort) finds the λ of Algorithm 2 as written."""

  @jax.jit
  def both(a):
    a = a / jnp.max(a)
    return wangni.exact_lambda(a, eps), wangni.exact_lambda_sorted(a, eps)

  for name, x in EXACT_LAMBDA_VECTORS.items():
    lam, ref = both(jnp.abs(jnp.asarray(x)))
    np.testing.assert_allclose(float(lam), float(ref), rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("seed", range(4))
def test_exact_is_the_optimum_of_the_convex_problem(seed):
  """min Σp s.t. Σ x²/p <= (1+ε)Σx², 0 < p <= 1, solved by scipy (SLSQP): same p.

  The solver works on q = 1/p over the non-zero entries (p = 0 where x = 0): min Σ 1/q
  s.t. Σ x² q <= (1+ε)Σx², q >= 1, a smooth convex problem with a linear constraint.
  """
  rng = np.random.default_rng(seed)
  n = 12
  x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)
  x[0] = 0.0
  eps = [0.05, 0.3, 1.0, 3.0][seed]
  x64 = x.astype(np.float64)
  nz = x64 != 0
  g2 = x64[nz] ** 2
  budget = (1 + eps) * g2.sum()
  res = optimize.minimize(
    lambda q: np.sum(1 / q),
    np.ones(g2.size),
    jac=lambda q: -1 / q**2,
    method="SLSQP",
    bounds=[(1.0, None)] * g2.size,
    constraints=[{"type": "ineq", "fun": lambda q: budget - g2 @ q, "jac": lambda q: -g2}],
    options={"ftol": 1e-15, "maxiter": 1000},
  )
  assert res.success, res.message
  assert g2 @ res.x <= budget * (1 + 1e-9)
  codec = UnbiasedSparsifier(method="exact", epsilon=eps)
  p, _ = _probs(codec, x)
  assert np.all(p[~nz] == 0)
  assert np.sum(g2 / p[nz]) <= budget * (1 + 2e-6)  # feasible
  # optimal: no worse than the solver's feasible point, which is within 1e-6 of it
  assert p.sum() <= res.fun * (1 + 2e-6)
  assert p.sum() == pytest.approx(res.fun, rel=1e-6)
  np.testing.assert_allclose(p[nz], 1 / res.x, atol=1e-5)  # the (unique) optimum
  # ... and it has saturated entries for small ε (the k of Algorithm 2 is exercised)
  if eps <= 0.3:
    assert np.sum(p >= 1) >= 1


# ----------------------------------------------------------------------------- Algorithm 3


GREEDY_VECTORS = {
  "normal": lambda n: _normal(n, 5),
  "heavy": lambda n: _heavy(n, 6),
  "cauchy": lambda n: np.random.default_rng(7).standard_cauchy(n).astype(np.float32),
}


@pytest.mark.parametrize("density", [0.01, 0.1, 0.5, 0.9])
def test_greedy_hits_target_density(density):
  """Σp is within 2% of κn (from below) after the default 4 rounds; rounds=0 (the
  first step alone) can be far off, so the rounds matter."""
  n = 4096
  codec = UnbiasedSparsifier(density=density)
  for name, make in GREEDY_VECTORS.items():
    p, _ = _probs(codec, make(n))
    target = density * n
    assert target * 0.98 <= p.sum() <= target * (1 + 1e-5), (name, p.sum(), target)
    assert np.sum(p >= 1) <= target * (1 + 1e-6)  # the dense part never exceeds κn
  if density == 0.5:
    p, _ = _probs(UnbiasedSparsifier(density=density, rounds=0), GREEDY_VECTORS["cauchy"](n))
    assert p.sum() < 0.5 * density * n
  # without saturation (normal values at 1%), Σp = κn exactly
  if density == 0.01:
    p, _ = _probs(codec, GREEDY_VECTORS["normal"](n))
    assert np.sum(p >= 1) == 0
    assert p.sum() == pytest.approx(density * n, rel=1e-5)


def test_greedy_realised_count():
  samples, _ = _samples(GREEDY, X_HEAVY, seed=2)
  p, _ = _probs(GREEDY, X_HEAVY)
  counts = (samples != 0).sum(axis=1)
  se = counts.std(ddof=1) / math.sqrt(M)
  assert abs(counts.mean() - p.sum()) <= Z * se, (counts.mean(), p.sum(), se)
  assert p.sum() >= 0.97 * GREEDY.density * N
  # the count's variance is the Poisson-binomial one, Σ p(1-p) <= mean
  assert counts.var(ddof=1) == pytest.approx(np.sum(p * (1 - p)), rel=0.1)


# ----------------------------------------------------------------------------- Lemma 3, Theorem 4


def _rho_s_sparse(d, s, rho, seed, kind):
  """A (ρ, s)-sparse vector: ||g_{S^c}||_1 = ρ ||g_S||_1 with |S| = s (S random)."""
  rng = np.random.default_rng(seed)
  g = np.zeros(d)
  support = rng.choice(d, size=s, replace=False)
  g[support] = rng.uniform(1.0, 4.0, s) * rng.choice([-1.0, 1.0], s)
  rest = np.setdiff1d(np.arange(d), support)
  if kind == "spread":  # many tiny values
    tail = rng.exponential(1.0, rest.size)
  elif kind == "few":  # a handful of mid-sized values
    tail = np.zeros(rest.size)
    tail[rng.choice(rest.size, size=5, replace=False)] = rng.uniform(0.5, 1.0, 5)
  else:  # "one": a single value as large as the whole budget allows
    tail = np.zeros(rest.size)
    tail[0] = 1.0
  tail *= rho * np.abs(g[support]).sum() / tail.sum()
  g[rest] = tail * rng.choice([-1.0, 1.0], rest.size)
  return g.astype(np.float32), s


LEMMA_CASES = [
  (4096, 20, 0.1, "spread"),
  (4096, 20, 0.5, "few"),
  (1000, 50, 1.0, "spread"),
  (1000, 10, 0.25, "one"),
  (1000, 100, 0.05, "few"),
]


@pytest.mark.parametrize("d, s, rho, kind", LEMMA_CASES)
def test_lemma_3_expected_nnz(d, s, rho, kind):
  g, s = _rho_s_sparse(d, s, rho, seed=d + s, kind=kind)
  g64 = np.abs(g.astype(np.float64))
  order = np.argsort(-g64)
  assert g64[order[s:]].sum() <= rho * g64[order[:s]].sum() * (1 + 1e-5)  # (ρ, s)-sparse
  p, _ = _probs(UnbiasedSparsifier(method="exact", epsilon=rho), g)
  assert p.sum() <= (1 + rho) * s * (1 + 1e-6), (p.sum(), (1 + rho) * s)
  assert (1 + rho) * s < d / 5  # the bound is informative


THEOREM_CASES = [(4096, 20, 0.1), (4096, 20, 0.5), (1000, 50, 1.0)]


@pytest.mark.parametrize("d, s, rho", THEOREM_CASES)
def test_theorem_4_bits(d, s, rho):
  """Bits of the coding against s(b + log d) + ρ s log d + b (b = 32).

  The *used* bits (of the entries a draw keeps, expected) satisfy the bound with
  ``log d`` read as the payload's index width (16 bits here, ceil(log2 d) = 10..12), plus
  one sign bit per sign entry and 32 bits for ``num_dense``, which the paper's count
  leaves out. The *capacity* (static ``wire_bits``, planned for m = (1+ρ)s with
  dense_fraction = 1/(1+ρ)) exceeds it by its Chernoff margin, ``(C - m)`` slots of
  index + sign bits, and one sign bit per slot; both are asserted as identities.
  """
  g, s = _rho_s_sparse(d, s, rho, seed=7 * d + s, kind="spread")
  m = (1 + rho) * s
  codec = UnbiasedSparsifier(
    method="exact", epsilon=rho, density=m / d, dense_fraction=1 / (1 + rho)
  )
  p, _ = _probs(codec, g)
  c_slots, d_slots = codec.capacities(d)
  payload = jax.eval_shape(
    lambda x: codec.encode(x, key=jax.random.key(0)), jax.ShapeDtypeStruct((d,), jnp.float32)
  )
  idx_bits = 8 * payload.arrays["indices"].dtype.itemsize
  assert idx_bits == 16 and math.ceil(math.log2(d)) <= idx_bits
  n_dense = float(np.sum(p >= 1))
  n_sign = float(np.sum(np.where(p < 1, p, 0.0)))  # expected sign entries
  assert n_dense <= s  # here every dense entry lies in S
  used = n_dense * (idx_bits + 32) + n_sign * (idx_bits + 1) + 32 + 32
  bound = s * (32 + idx_bits) + rho * s * idx_bits + 32
  assert used <= bound + rho * s + 32, (used, bound)
  # the static capacity: exactly these arrays, whatever the draw
  wire = codec.wire_bits((d,))
  assert wire == 8 * payload.nbytes
  assert wire == c_slots * idx_bits + 32 * math.ceil(c_slots / 32) + 32 * d_slots + 64
  assert d_slots == s and c_slots == math.ceil(m + 6 * math.sqrt(m) + 6)
  # wire - bound = the margin's (C - m) index fields + a sign bit per slot + num_dense
  margin = (c_slots - m) * idx_bits + 32 * math.ceil(c_slots / 32) + 32
  assert wire - bound == pytest.approx(margin, abs=1e-6)
  assert margin <= 0.75 * bound  # the static payload stays within 1.75x the bound here


# ----------------------------------------------------------------------------- capacity, overflow


def test_capacity_rule_and_tail_bound():
  for n, density in [(1000, 0.1), (10**6, 0.01), (50, 0.02), (7, 1.0), (1, 0.5)]:
    codec = UnbiasedSparsifier(density=density)
    c, d = codec.capacities(n)
    m = density * n
    assert c == min(n, max(2, math.ceil(m + 6 * math.sqrt(m) + 6)))
    assert 1 <= d <= c and (d < c or c == n)
  # P(more than C - (dense) sign entries) <= 1.6e-8 for every planned m: the Chernoff
  # bound at the worst case μ = m - #dense, with m + 6√m + 6 - #dense slots left.
  for m in np.concatenate([np.linspace(0.01, 50, 400), np.geomspace(50, 1e8, 200)]):
    c = math.ceil(m + 6 * math.sqrt(m) + 6)
    for dense in [0, int(m) // 2, int(m)]:
      assert wangni.capacity_tail_bound(m - dense, c - dense) < 1.6e-8, (m, dense)


def test_tail_bound_dominates_exact_poisson_binomial_tail():
  """The Chernoff bound against the exact tail of the count of sign entries (by DP)."""
  p, _ = _probs(GREEDY, X_HEAVY)
  q = p[p < 1]
  dist = np.zeros(q.size + 1)
  dist[0] = 1.0
  for pi in q:
    dist[1:] = dist[1:] * (1 - pi) + dist[:-1] * pi
    dist[0] *= 1 - pi
  mu = q.sum()
  for cap in [int(mu) + 5, int(mu) + 15, int(mu) + 30]:
    assert dist[cap + 1 :].sum() <= wangni.capacity_tail_bound(mu, cap)


# C = 20 slots for about 60 kept entries, D = 3 dense slots for about 10 dense entries:
# both parts overflow on (almost) every draw.
OVERFLOW = UnbiasedSparsifier(method="exact", epsilon=0.5, capacity=0.05, dense_fraction=0.01)


def test_overflow_is_reported_and_unbiased():
  codec, x = OVERFLOW, X_HEAVY
  p, _ = _probs(codec, x)
  c_slots, d_slots = codec.capacities(N)
  assert (c_slots, d_slots) == (20, 3)
  assert np.sum(p >= 1) > d_slots and p.sum() > 1.5 * c_slots
  samples, ov = _samples(codec, x, seed=3)
  assert ov.mean() > 0.99
  counts = (samples != 0).sum(axis=1)
  assert np.all(counts <= c_slots) and np.median(counts) == c_slots  # every slot used
  dense_hits = (samples[:, p >= 1] != 0).sum(axis=1)
  assert np.all(dense_hits == d_slots)  # a random subset of D of the dense entries
  # Unbiased conditionally on the draw: the sample means (with the samples' own,
  # larger, variance) still center on x, dense and sign entries alike.
  var = samples.var(axis=0, ddof=1)
  ok, msg = _unbiasedness_check(samples, x, var, min_hits=30)
  assert ok, msg
  # Negative controls: a silent drop (the same draws cut to their first 14 kept entries
  # by position, without rescaling) is biased, and so is forgetting the dense factor.
  truncated = np.where(np.cumsum(samples != 0, axis=1) <= 14, samples, 0.0)
  ok, msg = _unbiasedness_check(truncated, x, var, min_hits=30)
  assert not ok, msg
  unscaled = np.where(p >= 1, samples * d_slots / np.sum(p >= 1), samples)
  ok, msg = _unbiasedness_check(unscaled, x, var, min_hits=30)
  assert not ok, msg


def test_no_silent_drop_without_overflow():
  """White-box: without overflow the decoding is exactly Z_i x_i / p_i with the codec's
  own draw (u = uniform(key), Z_i = [u_i < p_i])."""
  codec, x = GREEDY, X_HEAVY
  keys = _keys(64, seed=4)
  p, lam = _probs(codec, x)
  p32 = np.asarray(_probs_fn(codec)(jnp.asarray(x))[0])
  uniform = jax.jit(lambda k: rng.uniform(k, (N,)))  # the codec's counter-based bits
  for i in range(8):
    payload, ov = _encode(codec, x, keys[i])
    assert not bool(ov)
    out = np.asarray(_decode_fn(codec)(payload), np.float64)
    u = np.asarray(uniform(keys[i]))
    keep = u < p32
    assert np.array_equal(out != 0, keep)
    x64 = x.astype(np.float64)
    expect = np.where(p >= 1, x64, np.sign(x64) / lam)
    np.testing.assert_allclose(out[keep], expect[keep], rtol=1e-6)
    assert int(payload.arrays["num_dense"]) == int(np.sum(p >= 1))


# ----------------------------------------------------------------------------- payload


def test_payload_static_shapes_and_wire_bits():
  n = N
  datas = [
    X_HEAVY,
    np.zeros(n, np.float32),
    np.full(n, 1e30, np.float32),
    np.where(np.arange(n) % 3 == 0, np.nan, 1.0).astype(np.float32),
    np.where(np.arange(n) < 100, -np.inf, 0.0).astype(np.float32),
  ]
  c_slots, d_slots = GREEDY.capacities(n)
  payloads = [_encode(GREEDY, d, jax.random.key(i))[0] for i, d in enumerate(datas)]
  for pl in payloads:
    chex.assert_trees_all_equal_shapes_and_dtypes(payloads[0], pl)
    arrays = pl.arrays
    assert arrays["indices"].shape == (c_slots,) and arrays["indices"].dtype == jnp.uint16
    assert arrays["values"].shape == (d_slots,) and arrays["values"].dtype == jnp.float32
    assert arrays["signs"].shape == (math.ceil(c_slots / 32),)
    assert arrays["signs"].dtype == jnp.uint32
    assert arrays["scale"].shape == () and arrays["num_dense"].shape == ()
    assert GREEDY.wire_bits((n,)) == 8 * pl.nbytes
  assert GREEDY.wire_bits((n,)) == c_slots * 16 + 32 * math.ceil(c_slots / 32) + 32 * d_slots + 64
  # the input dtype does not change the payload
  assert GREEDY.wire_bits((n,), jnp.bfloat16) == GREEDY.wire_bits((n,))


@pytest.mark.parametrize(
  "n, dtype",
  [(200, jnp.uint8), (255, jnp.uint8), (256, jnp.uint16), (65535, jnp.uint16), (65536, jnp.int32)],
)
def test_index_dtype_is_narrow(n, dtype):
  out = jax.eval_shape(
    lambda x: GREEDY.encode(x, key=jax.random.key(0)), jax.ShapeDtypeStruct((n,), jnp.float32)
  )
  assert out.arrays["indices"].dtype == dtype


def test_decode_jit_vmap_and_decode_sum():
  """vmap(encode) == encode one by one (the overflow branch of lax.cond runs as a select
  under vmap); vmap(decode) and decode_sum of the stacked payload, under jit."""
  k = 3
  codec = GREEDY
  xs = np.stack([_heavy(N, 10 + i) for i in range(k)])
  keys = _keys(k, seed=5)

  @jax.jit
  def run(xs, keys):
    stacked = jax.vmap(lambda x, key: codec.encode(x, key=key))(xs, keys)
    return stacked, jax.vmap(codec.decode)(stacked), codec.decode_sum(stacked)

  stacked, decoded, total = jax.tree.map(np.asarray, run(jnp.asarray(xs), keys))
  assert decoded.shape == (k, N) and decoded.dtype == np.float32
  for i in range(k):
    single, _ = _encode(codec, xs[i], keys[i])
    for name, a in single.arrays.items():
      np.testing.assert_array_equal(np.asarray(a), stacked.arrays[name][i], err_msg=name)
    np.testing.assert_array_equal(decoded[i], np.asarray(_decode_fn(codec)(single)))
  assert total.shape == (N,) and total.dtype == np.float32
  np.testing.assert_allclose(total, decoded.sum(axis=0), rtol=1e-6, atol=1e-6)


def test_reproducible_and_key_dependent():
  x = X_HEAVY
  p1, p2 = _encode(GREEDY, x, jax.random.key(3)), _encode(GREEDY, x, jax.random.key(3))
  chex.assert_trees_all_equal(p1, p2)
  p3 = _encode(GREEDY, x, jax.random.key(4))
  assert not np.array_equal(
    np.asarray(p1[0].arrays["indices"]), np.asarray(p3[0].arrays["indices"])
  )
  raw = _encode(GREEDY, x, jax.random.PRNGKey(3))  # raw uint32 key data: the same key
  typed = _encode(GREEDY, x, jax.random.wrap_key_data(jax.random.PRNGKey(3)))
  chex.assert_trees_all_equal(raw, typed)
  with pytest.raises(ValueError, match="key"):
    GREEDY.encode(jnp.asarray(x))


def test_shard_map_with_check_vma():
  """Inside shard_map (check_vma on): per-device x and keys, and a replicated x with
  per-device keys. The cond's branches and the bisection's carry must vary over the
  same axes whatever varies; the exact method with a small capacity runs both."""
  codec = OVERFLOW
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
  spec = jax.sharding.PartitionSpec

  def body(x, x_rep, key_data):
    key = jax.random.wrap_key_data(key_data[0])
    outs, flags = [], []
    for v in (x[0], x_rep):
      payload, ov = codec.encode_with_info(v, key=key)
      stacked = collectives.gather_tree(payload, "d")  # all_gather, typed invariant
      outs.append(codec.decode_sum(stacked) / 8)
      flags.append(jax.lax.psum(ov.astype(jnp.int32), "d"))
    return outs, flags

  xs = np.stack([_heavy(N, 20 + i) for i in range(8)])
  keys = jax.random.key_data(_keys(8, seed=8))  # 7 of 8 devices overflow
  run = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(spec("d"), spec(), spec("d")), out_specs=spec(), check_vma=True
    )
  )
  put = lambda a, s: jax.device_put(jnp.asarray(a), jax.NamedSharding(mesh, s))
  outs, flags = run(put(xs, spec("d")), put(X_HEAVY, spec()), put(keys, spec("d")))
  for out in outs:
    out = np.asarray(out)
    assert out.shape == (N,) and np.all(np.isfinite(out)) and np.count_nonzero(out) > 20
  assert int(flags[1]) == 8  # X_HEAVY overflows C = 20 on every device
  assert 0 < int(flags[0]) < 8  # the per-device vectors: some devices take each branch


# ----------------------------------------------------------------------------- special values


@pytest.mark.parametrize("codec", [GREEDY, EXACT], ids=["greedy", "exact"])
def test_special_values(codec):
  key = jax.random.key(0)
  assert np.all(_round_trip(codec, np.zeros(N, np.float32), key) == 0)
  for bad in [np.nan, np.inf, -np.inf]:
    x = X_HEAVY.copy()
    x[17] = bad
    assert not np.all(np.isfinite(_round_trip(codec, x, key))), bad
  # more non-finite entries than dense slots (the overflow path): still not finite
  assert not np.all(np.isfinite(_round_trip(codec, np.full(N, np.nan, np.float32), key)))
  # huge and tiny magnitudes: no overflow of Σx², no underflow to zero
  for scale in [1e30, 1e-30]:
    out = _round_trip(codec, X_HEAVY * np.float32(scale), key).astype(np.float64)
    assert np.all(np.isfinite(out)) and np.count_nonzero(out) > 0
    assert np.all(out * X_HEAVY >= 0)


def test_low_precision_input():
  x = jnp.asarray(X_HEAVY).astype(jnp.bfloat16)
  payload, _ = _encode(GREEDY, x, jax.random.key(1))
  out = jax.jit(GREEDY.decode)(payload)
  assert out.dtype == jnp.bfloat16 and out.shape == (N,)
  out32 = np.asarray(_decode_fn(GREEDY)(payload))
  np.testing.assert_array_equal(
    np.asarray(out, np.float32), out32.astype(jnp.bfloat16).astype(np.float32)
  )
  # dense entries are the input values exactly; the others sign(x) · scale
  x64 = np.asarray(x, np.float64)
  nz = out32 != 0
  scale = float(payload.arrays["scale"])
  assert np.all((out32[nz] == x64[nz]) | (np.abs(out32[nz]) == np.float32(scale)))
  # float16 (abstractly): decoded in the input dtype, the same payload as float32
  for dtype in [jnp.float16, jnp.bfloat16]:
    spec = jax.ShapeDtypeStruct((5, 30), dtype)
    out = jax.eval_shape(lambda x: GREEDY.decode(GREEDY.encode(x, key=jax.random.key(0))), spec)
    assert out.shape == (5, 30) and out.dtype == dtype
    assert GREEDY.wire_bits((5, 30), dtype) == GREEDY.wire_bits((5, 30))


def test_degenerate_shapes():
  @jax.jit
  def run(key):
    return {
      s: GREEDY.decode(GREEDY.encode(jnp.full(s, -0.75, jnp.float32), key=key))
      for s in [(), (0,), (3, 0), (2,)]
    }

  out = run(jax.random.key(0))
  for shape, o in out.items():
    chex.assert_shape(o, shape)
  # n = 1 (and 2) at density 0.1: p = 0.1, so each value decodes to -0.75 / 0.1 or 0
  for shape in [(), (2,)]:
    vals = np.asarray(out[shape]).reshape(-1)
    assert np.all((vals == 0) | np.isclose(vals, -7.5, rtol=1e-6)), vals
  for shape in [(), (2,)]:
    c_slots, d_slots = GREEDY.capacities(math.prod(shape))
    assert c_slots == math.prod(shape) and d_slots == 1


# ----------------------------------------------------------------------------- properties


@pytest.mark.slow
@hypothesis.settings(max_examples=5)
@hypothesis.given(
  shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
  density=st.sampled_from([0.01, 0.05, 0.3, 1.0]),
  method=st.sampled_from(["greedy", "exact"]),
  seed=st.integers(0, 2**16),
)
def test_property_round_trip(shape, density, method, seed):
  """Random shapes and settings (one compilation each): static shapes, exact values."""
  shape = tuple(shape)
  n = math.prod(shape)
  kwargs = dict(method="exact", epsilon=1.0) if method == "exact" else {}
  codec = UnbiasedSparsifier(density=density, **kwargs)
  x = _heavy(n, seed, zeros=min(3, n)).reshape(shape)

  @jax.jit
  def run(x, key):
    payload, ov = codec.encode_with_info(x, key=key)
    return payload, ov, codec.decode(payload, jnp.float32), codec.probabilities(x)

  payload, ov, out, (p, lam) = jax.tree.map(np.asarray, run(jnp.asarray(x), jax.random.key(seed)))
  c_slots, d_slots = codec.capacities(n)
  assert payload.arrays["indices"].shape == (c_slots,)
  assert payload.arrays["values"].shape == (d_slots,)
  assert out.shape == shape
  p = p.astype(np.float64).reshape(shape)
  x64 = x.astype(np.float64)
  out = out.astype(np.float64)
  nz = out != 0
  assert np.all(x64[nz] != 0) and np.all(out * x64 >= 0)
  if not bool(ov):
    assert np.all(out[p >= 1] == x64[p >= 1])
    expect = np.where(p >= 1, x64, np.sign(x64) / max(float(lam), 1e-30))
    np.testing.assert_allclose(out[nz], expect[nz], rtol=2e-6)
  if method == "greedy":
    assert p.sum() <= density * n * (1 + 1e-5)


# ----------------------------------------------------------------------------- arguments, docs


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(),
    dict(density=0.0),
    dict(density=1.5),
    dict(density=True),
    dict(density="0.1"),
    dict(density=0.1, epsilon=0.5),
    dict(density=0.1, method="topk"),
    dict(method="exact"),
    dict(method="exact", epsilon=0.0),
    dict(method="exact", epsilon=-1),
    dict(method="exact", epsilon=math.inf),
    dict(method="exact", epsilon=True),
    dict(method="exact", epsilon=1.0, density=2.0),
    dict(density=0.1, rounds=-1),
    dict(density=0.1, rounds=1.0),
    dict(density=0.1, capacity=0.0),
    dict(density=0.1, capacity=1.5),
    dict(density=0.1, dense_fraction=0.0),
  ],
)
def test_bad_arguments_raise(kwargs):
  with pytest.raises(ValueError):
    UnbiasedSparsifier(**kwargs)


def test_codec_is_hashable_and_argument_order():
  assert hash(UnbiasedSparsifier(density=0.1)) == hash(UnbiasedSparsifier(None, 0.1))
  with pytest.raises(TypeError):
    UnbiasedSparsifier(None, 0.1, "greedy", 4)  # pylint: disable=too-many-function-args
  with pytest.raises(ValueError, match="epsilon"):
    UnbiasedSparsifier(0.1)  # positional order is (epsilon, density, method)
  assert UnbiasedSparsifier(density=0.1).needs_key
