"""Optimal unbiased sparsification (Wangni, Wang, Liu, Zhang, NeurIPS 2018).

Each value is kept with its own probability ``p_i = min(λ |x_i|, 1)`` and, when kept,
sent as ``x_i / p_i``. The kept count is random, so the payload has *static* capacities
sized from the expected count with a Chernoff margin, and an unbiased fallback for the
rare draw that does not fit (:class:`UnbiasedSparsifier`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.codecs.base import Array
from jaxcomp._src.codecs.base import Payload
from jaxcomp._src.codecs.base import _check_float
from jaxcomp._src.codecs.sparse import SparseCodec
from jaxcomp._src.codecs.sparse import check_density
from jaxcomp._src.codecs.sparse import compact
from jaxcomp._src.codecs.sparse import index_dtype
from jaxcomp._src.plumbing import bitpack
from jaxcomp._src.plumbing import rng

_F32 = jnp.float32
_TINY = float(np.finfo(np.float32).tiny)
_ROW = 16  # values per row of the greedy rounds' sums (one AVX-512 vector)

#: The capacity rule ``ceil(m + _SIGMAS·sqrt(m) + _SLACK)`` (see UnbiasedSparsifier).
_SIGMAS = 6.0
_SLACK = 6.0
#: Counts are float32 sums of 0/1 on the common path: exact below 2**24.
_FLOAT_COUNT_MAX = 2**23


def capacity_tail_bound(mean: float, capacity: int) -> float:
  """Chernoff bound on P(N > capacity) for a sum N of independent Bernoullis, E[N] <= mean.

  ``P(N >= c) <= e^{-μ} (e μ / c)^c`` for ``c > μ`` (the multiplicative Chernoff bound
  ``(e^δ / (1+δ)^{1+δ})^μ`` with ``c = (1+δ)μ``), which increases with μ, so it holds for
  every mean up to ``mean``; here with ``c = capacity + 1``.
  """
  c = capacity + 1
  if mean <= 0:
    return 0.0
  if c <= mean:
    return 1.0
  return math.exp(-mean + c * (1.0 + math.log(mean / c)))


def exact_lambda(a: Array, epsilon: float) -> Array:
  r"""λ of Algorithm 2 for non-negative magnitudes ``a``, without sorting (float32 scalar).

  With ``C_1(τ) = Σ_{a_i <= τ} a_i``, ``C_2(τ) = Σ_{a_i <= τ} a_i^2`` and ``S_2 = Σ a_i^2``,
  the paper's test for the j smallest entries to stay unsaturated,
  ``b_{(j)} C_1 < ε S_2 + C_2`` (``b_{(j)}`` the j-th smallest), is ``H(b_{(j)}) > 0`` for

  .. math:: H(\tau) = \varepsilon S_2 + C_2(\tau) - \tau\, C_1(\tau),

  which is continuous and non-increasing in τ (it has slope ``-C_1(τ)`` between data
  values and does not jump at them: an entry ``a = τ`` adds ``τ^2 - τ·τ``). So the
  paper's smallest k (largest j) is found by bisection of H on the bit patterns of
  non-negative float32 (31 passes of two masked sums instead of a sort, which costs far
  more on XLA:CPU; the XLA:CPU table of ``docs/benchmarks.md`` times both), and
  ``λ = C_1 / (ε S_2 + C_2)`` at the last τ with ``H(τ) > 0``. Returns 0 when ``a`` is
  all zero. :func:`exact_lambda_sorted` is the paper's sorting version, kept as the
  reference.
  """
  eps = jnp.float32(epsilon)
  s2 = jnp.sum(a * a)

  def sums(bits):
    tau = lax.bitcast_convert_type(bits, _F32)
    below = a <= tau
    c1 = jnp.sum(jnp.where(below, a, 0.0))
    c2 = jnp.sum(jnp.where(below, a * a, 0.0))
    return tau, c1, c2

  def body(_, lohi):
    lo, hi = lohi
    mid = lo + (hi - lo) // 2
    tau, c1, c2 = sums(mid)
    up = eps * s2 + c2 - tau * c1 > 0
    return jnp.where(up, mid, lo), jnp.where(up, hi, mid)

  # H(0) = ε S_2 > 0 and H(+inf) = -inf: the bracket [0, +inf) of float32 bit patterns.
  # (zeros_like: the carry varies over the same shard_map axes as `a`.)
  lo = jnp.zeros_like(s2, dtype=jnp.int32)
  lo, _ = lax.fori_loop(0, 31, body, (lo, lo + 0x7F800000))
  _, c1, c2 = sums(lo)
  budget = eps * s2 + c2
  return jnp.where((s2 > 0) & (c1 > 0), c1 / jnp.maximum(budget, _TINY), 0.0)


def exact_lambda_sorted(a: Array, epsilon: float) -> Array:
  """Reference for :func:`exact_lambda`: Algorithm 2 as written, with one sort of ``a``.

  Sorted ascending, the paper's suffix sums over the n - k smallest are prefix sums; the
  smallest k is the largest j = n - k with ``b[j-1] · Σ_{i<j} b_i < ε S_2 + Σ_{i<j} b_i^2``.
  """
  eps = jnp.float32(epsilon)
  b = jnp.sort(a)
  c1 = jnp.cumsum(b)
  c2 = jnp.cumsum(b * b)
  budget = eps * c2[-1] + c2
  j = jnp.max(jnp.where(b * c1 < budget, jnp.arange(1, b.shape[0] + 1, dtype=jnp.int32), 0))
  i = jnp.maximum(j - 1, 0)
  return jnp.where((c2[-1] > 0) & (j > 0), c1[i] / jnp.maximum(budget[i], _TINY), 0.0)


@dataclasses.dataclass(frozen=True)
class UnbiasedSparsifier(SparseCodec):
  r"""Optimal unbiased sparsification: keep ``x_i`` with probability ``p_i``, send ``x_i/p_i``.

  .. math::
    Q(x)_i = \frac{Z_i\, x_i}{p_i}, \quad Z_i \sim \mathrm{Bernoulli}(p_i), \quad
    p_i = \min(\lambda |x_i|, 1), \qquad
    \mathbb{E}[Q(x)] = x, \quad \mathbb{E}\|Q(x)\|^2 = \sum_i x_i^2 / p_i, \quad
    \mathbb{E}\|Q(x)\|_0 = \sum_i p_i.

  ``p = min(λ|x|, 1)`` solves :math:`\min \sum_i p_i` subject to
  :math:`\sum_i x_i^2/p_i \le (1+\varepsilon)\sum_i x_i^2`, :math:`0 < p_i \le 1`
  (Prop. 1). Two ways to choose λ (Section 2.2 of the paper, Algorithms 2 and 3):

  * ``method="exact"`` (Algorithm 2), for a variance budget ``epsilon`` ε > 0: with
    :math:`|x|_{(1)} \ge \dots \ge |x|_{(n)}` sorted, take the smallest k with
    :math:`|x|_{(k+1)} \sum_{i>k} |x|_{(i)} < \varepsilon \sum_i x_i^2 + \sum_{i>k} x_{(i)}^2`
    and :math:`\lambda = \sum_{i>k}|x|_{(i)} / (\varepsilon \sum_i x_i^2 + \sum_{i>k} x_{(i)}^2)`.
    The k largest then have ``p = 1`` and :math:`\sum_i x_i^2/p_i = (1+\varepsilon)\|x\|^2`
    exactly (up to float32 rounding): the optimum of the problem above. The same k is
    found by a bisection instead of a sort (:func:`exact_lambda`): 31 bisection passes
    over n, and two more for ``Σ x_i^2`` and the final sums.
  * ``method="greedy"`` (Algorithm 3), for a target density κ: ``λ = κn / Σ|x_j|``, then
    ``rounds`` times: over the entries not saturated (``λ|x_i| < 1``) rescale λ so that
    the expected count is κn, i.e. ``λ ← (κn − #saturated) / Σ_{unsaturated}|x_i|``.
    ``Σ p_i`` approaches κn from below (it is exactly κn when no entry saturates); a few
    passes over n, no sort.

  Coding (§2.3): a kept entry with ``p_i = 1`` ("dense") is sent as its index and its
  float32 value; every other kept entry decodes to ``sign(x_i) / λ``, so only its index
  and a sign bit are sent, plus one float32 ``scale = 1/λ`` for all of them.

  Payload (static shapes; ``C`` entry slots, ``D <= C`` dense value slots):

  * ``indices``: ``C`` indices (``uint8``/``uint16``/``int32`` by n, see
    :func:`~jaxcomp._src.codecs.sparse.index_dtype`), the dense entries first; unused slots hold
    ``n`` and decode to nothing;
  * ``signs``: one bit per slot, packed 32 per uint32 (ignored for dense slots);
  * ``values``: ``D`` float32 values of the dense entries (slot j < ``num_dense``);
  * ``scale`` (float32, ``1/λ``) and ``num_dense`` (int32).

  So ``wire_bits = C · (index bits) + 32·ceil(C/32) + 32·D + 64``, whatever was drawn.

  Capacities. Let ``m`` be the planned expected count: ``κn`` for ``"greedy"``;
  for ``"exact"``, ``density · n`` when ``density`` is given, else ``n / (1+ε)`` (a bound
  for every input: ``p_i = 1/(1+ε)`` is feasible, so the optimum keeps at most that many
  in expectation). Then

  .. math:: C = \min\bigl(n, \lceil m + 6\sqrt{m} + 6 \rceil\bigr), \qquad
     D = \min(\lceil \text{dense\_fraction} \cdot m \rceil, C - 1)

  (``D >= 1``, and ``D <= C - 1`` so that a sign entry always has a slot, unless
  ``C = n``), or ``C = ceil(capacity · n)`` when ``capacity`` is given. The dense
  count is deterministic and, for ``"greedy"``, at most κn: with ``dense_fraction=1`` it
  always fits. The other kept entries are a sum of
  independent Bernoullis of mean ``μ = Σ_{p_i<1} p_i <= m − #dense``, and they get the
  ``C − #dense >= μ + 6√m + 6`` slots left, so by the Chernoff bound
  ``P(N > C') <= e^{-μ}(eμ/(C'+1))^{C'+1}`` (:func:`capacity_tail_bound`) they overflow
  with probability below ``1.6e-8`` for every ``m`` (``6√m`` is 6 standard deviations:
  the bound tends to ``e^{-18}`` for large m). For ``"exact"`` with a planned density
  this holds only while ``Σ p_i <= m``.

  Overflow is never a silent drop: when a part does not fit, a uniformly random subset
  of as many of its entries as fit is kept and their values are multiplied by
  ``count / kept`` (for the sign entries, folded into ``scale``), which is unbiased
  conditionally on the draw but adds variance (the ε guarantee no longer holds for that
  draw). :meth:`encode_with_info` reports it; the slow path runs under ``lax.cond`` (under
  ``jax.vmap`` both paths run).

  A NaN/Inf input is kept as a dense entry and every value (and ``scale``) is set to
  NaN, so the decoded tensor is not finite. The math runs in float32 on ``|x| / max|x|``
  (no overflow of ``Σx²``); the decoded values are unbiased in float32, and decoding to
  a bfloat16/float16 input dtype rounds ``scale`` to that dtype.

  Args:
    epsilon: ε > 0, the variance budget ``E||Q(x)||^2 <= (1+ε)||x||^2`` (``"exact"``).
    density: κ in (0, 1]: the expected fraction of entries kept (``"greedy"``,
      required), or the planned density that sizes the capacity (``"exact"``, optional).
    method: ``"greedy"`` or ``"exact"``.
    rounds: rescaling passes of ``"greedy"`` (integer >= 0). Each is one pass over n;
      with 4, ``Σ p_i`` is within 2% of κn (from below) for κ in {1%, 10%, 50%, 90%}
      on normal, heavy-tailed and Cauchy vectors, and exactly κn when nothing
      saturates (``tests/test_wangni.py`` asserts both).
    capacity: entry slots as a fraction of n in (0, 1], overriding the rule above.
    dense_fraction: dense value slots in units of ``m``, in (0, 1]. Only entries with
      ``p_i = 1`` take one, and gradients saturate few entries at small κ, so the
      default 0.25 leaves a wide margin at a quarter of the cost of room for every
      kept entry (``python -m benchmarks.studies.demo_variants --saturation`` prints the
      saturated share per kernel). Raise it to 1 (``"greedy"`` then never overflows
      this part) for inputs with many outliers; each slot costs 32 bits.

  References:
    Wangni, Wang, Liu, Zhang. *Gradient Sparsification for Communication-Efficient
    Distributed Optimization*. NeurIPS 2018. https://arxiv.org/abs/1710.09854

  >>> import jax, jax.numpy as jnp
  >>> codec = UnbiasedSparsifier(density=0.1)  # keep 10% of the entries on average
  >>> x = jax.random.normal(jax.random.key(0), (400,))
  >>> payload, overflowed = codec.encode_with_info(x, key=jax.random.key(1))
  >>> codec.decode(payload).shape, bool(overflowed), codec.capacities(400)
  ((400,), False, (84, 10))
  >>> codec.wire_bits(x.shape)  # 84 uint16 indices, 3 sign words, 10 values, 2 scalars
  1824
  """

  epsilon: float | None = None
  density: float | None = None
  method: str = "greedy"
  _: dataclasses.KW_ONLY
  rounds: int = 4
  capacity: float | None = None
  dense_fraction: float = 0.25

  needs_key = True

  def __post_init__(self):
    if self.method not in ("greedy", "exact"):
      raise ValueError(f"method must be 'greedy' or 'exact', got {self.method!r}")
    if self.method == "greedy":
      if self.density is None:
        hint = (
          ""
          if self.epsilon is None
          else f" (got epsilon={self.epsilon!r}: the positional order is epsilon, "
          f"density, method; pass density=... by keyword)"
        )
        raise ValueError(f"method='greedy' needs density=κ in (0, 1]{hint}")
      if self.epsilon is not None:
        raise ValueError("epsilon is used by method='exact' only; 'greedy' takes density")
    else:
      eps = self.epsilon
      if (
        isinstance(eps, bool)
        or not isinstance(eps, (int, float, np.floating))
        or not (0 < eps < math.inf)
      ):
        raise ValueError(f"method='exact' needs epsilon > 0 (finite), got {eps!r}")
    if self.density is not None:
      check_density(self.density)
    if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 0:
      raise ValueError(f"rounds must be an integer >= 0, got {self.rounds!r}")
    if self.capacity is not None:
      check_density(self.capacity, "capacity")
    check_density(self.dense_fraction, "dense_fraction")

  # --------------------------------------------------------------------------- sizes

  def planned_count(self, n: int) -> float:
    """``m``: the expected number of kept entries the capacities are sized for."""
    if self.density is not None:
      return float(self.density) * n
    return n / (1.0 + float(self.epsilon))

  def capacities(self, n: int) -> tuple[int, int]:
    """(C, D): entry slots and dense value slots of a tensor of n values."""
    if n == 0:
      return 0, 0
    m = self.planned_count(n)
    if self.capacity is not None:
      c = math.ceil(self.capacity * n - 1e-9)
    else:
      c = math.ceil(m + _SIGMAS * math.sqrt(m) + _SLACK)
    # At least 2 slots, so that one is left for the sign entries next to a dense one.
    c = min(n, max(c, 2))
    # The sign entries always keep a slot (C - D >= 1) unless every entry fits (C = n).
    d = min(math.ceil(self.dense_fraction * m - 1e-9), c if c == n else c - 1)
    return c, max(d, 1)

  # --------------------------------------------------------------------------- probabilities

  def _normalized(self, x: Array) -> tuple[Array, Array, Array]:
    """(|x| / max|x| with non-finite entries as 0, max|x|, whether x is all finite)."""
    xf = x.reshape(-1).astype(_F32)
    finite = jnp.isfinite(xf)
    a = jnp.where(finite, jnp.abs(xf), 0.0)
    amax = jnp.max(a)
    inv = jnp.where(amax > 0, 1.0 / amax, 0.0)
    return a * inv, amax, jnp.all(finite)

  def _lambda_normalized(self, a: Array) -> Array:
    """λ for the normalized magnitudes a (max a = 1, or all zero)."""
    n = a.shape[0]
    if self.method == "exact":
      return self._lambda_exact(a)
    target = jnp.float32(float(self.density) * n)
    s1 = jnp.sum(a)
    lam = jnp.where(s1 > 0, target / jnp.maximum(s1, _TINY), 0.0)
    # Rows of 16 (zero padded: zeros add nothing to either sum): each round's two sums
    # are one variadic reduction of the rows, then sums of the row sums. XLA:CPU runs
    # the rounds faster so (the XLA:CPU table of ``docs/benchmarks.md``, the λ rows).
    rows = jnp.pad(a, (0, -n % _ROW)).reshape(-1, _ROW)
    for _ in range(self.rounds):
      # Saturated: a·λ >= 1, i.e. floor(min(a·λ, 1)) = 1 (a float sum, fast on XLA:CPU).
      sat = jnp.floor(jnp.minimum(rows * lam, 1.0))
      # Σ|x| over the unsaturated entries as a - sat·a (no cancellation).
      sat_rows, rest_rows = lax.reduce(
        (sat, rows - sat * rows),
        (jnp.float32(0), jnp.float32(0)),
        lambda u, v: (u[0] + v[0], u[1] + v[1]),
        (1,),
      )
      n_sat, rest = jnp.sum(sat_rows), jnp.sum(rest_rows)
      ok = (target - n_sat > 0) & (rest > 0)
      new = (target - n_sat) / jnp.where(ok, rest, 1.0)
      # λ only grows (mathematically; max() guards float rounding).
      lam = jnp.where(ok, jnp.maximum(new, lam), lam)
    return lam

  def _lambda_exact(self, a: Array) -> Array:
    return exact_lambda(a, float(self.epsilon))

  def probabilities(self, x: Array) -> tuple[Array, Array]:
    """(p, λ): the float32 keep probabilities of the flattened x, and λ (float32).

    ``p_i = min(λ|x_i|, 1)`` (computed as ``min(λ' |x_i|/max|x|, 1)``); non-finite
    entries get ``p = 1``. For an all-zero x, ``p = 0`` and ``λ = 0``.
    """
    _check_float(x)
    if x.size == 0:
      return jnp.zeros((0,), _F32), jnp.zeros((), _F32)
    a, amax, _ = self._normalized(x)
    lam = self._lambda_normalized(a)
    p = jnp.minimum(a * lam, 1.0)
    p = jnp.where(jnp.isfinite(x.reshape(-1)), p, 1.0)
    safe = jnp.where(amax > 0, amax, 1.0)
    return p, lam / safe

  # --------------------------------------------------------------------------- encode

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    return self.encode_with_info(x, key=key)[0]

  def encode_with_info(self, x: Array, *, key: Array | None = None) -> tuple[Payload, Array]:
    """(payload, overflowed): ``overflowed`` (bool scalar) is True when a capacity was
    exceeded and the unbiased subsampling fallback was taken.

    The work is one jitted function (``self`` is static), so an eager call compiles one
    program instead of dispatching each operation; under an outer ``jit`` it is inlined.
    """
    _check_float(x)
    key = self._require_key(key)
    return _encode_jit(self, x, key)

  def _encode(self, x: Array, key: Array) -> tuple[Payload, Array]:
    n = x.size
    idt = index_dtype(n)
    c_slots, d_slots = self.capacities(n)
    shape, dtype = tuple(x.shape), jnp.dtype(x.dtype)
    if n == 0:
      arrays = {
        "indices": jnp.zeros((0,), idt),
        "signs": jnp.zeros((0,), jnp.uint32),
        "values": jnp.zeros((0,), _F32),
        "scale": jnp.zeros((), _F32),
        "num_dense": jnp.zeros((), jnp.int32),
      }
      return Payload(arrays, shape, dtype), jnp.zeros((), bool)

    xf = x.reshape(-1).astype(_F32)
    a, amax, all_finite = self._normalized(x)
    lam = self._lambda_normalized(a)
    u = rng.uniform(key, (n,))  # the counter-based bits of jaxcomp._src.plumbing.rng
    finite = jnp.isfinite(xf)
    p = jnp.minimum(a * lam, 1.0)
    # One definition of "dense" and "kept", materialised once and read by both paths.
    dense = (p >= 1.0) | ~finite
    keep = (u < p) | ~finite  # u < 1: every dense entry is kept
    scale = jnp.where(lam > 0, amax / jnp.where(lam > 0, lam, 1.0), 0.0)  # 1/λ in x's units

    if c_slots < _FLOAT_COUNT_MAX:
      n_dense = jnp.sum(jnp.where(dense, 1.0, 0.0))
      n_keep = jnp.sum(jnp.where(keep, 1.0, 0.0))
    else:
      n_dense = jnp.sum(dense, dtype=jnp.int32)
      n_keep = jnp.sum(keep, dtype=jnp.int32)
    overflow = (n_dense > d_slots) | (n_keep > c_slots)
    # Both branches of the cond must return values that vary over the same shard_map
    # axes (check_vma); `keep` depends on x and on the key, so a zero derived from it
    # varies over every axis either one does, and is added to each output.
    zero = jnp.zeros_like(n_keep, dtype=jnp.int32)

    def common(_):
      # Every kept entry fits: the C first kept positions are all of them.
      idx = compact(keep, c_slots)
      valid = idx < n
      safe = jnp.minimum(idx, n - 1)
      is_dense = valid & dense[safe]
      # Stable partition of the slots: dense first, then sign entries, then padding.
      nd = jnp.sum(is_dense, dtype=jnp.int32)
      ns = jnp.sum(valid & ~is_dense, dtype=jnp.int32)
      dest = jnp.where(is_dense, jnp.cumsum(is_dense) - 1, nd + jnp.cumsum(~is_dense) - 1)
      idx = jnp.zeros_like(idx).at[dest].set(idx, unique_indices=True)
      return idx + zero, nd + zero, nd + zero, ns + zero

    def subsample(_):
      # Uniformly random subsets (the largest priorities r) of each part that fits.
      # r = u / p: given that entry i was kept (u_i < p_i), u_i / p_i is uniform on
      # [0, 1) and independent across entries, so no second draw is needed (dense
      # entries have p = 1, r = u). The two parts are disjoint: one r serves both.
      r = u / jnp.where(p > 0, p, 1.0)
      nd_all = jnp.sum(dense, dtype=jnp.int32)
      ns_all = jnp.sum(keep & ~dense, dtype=jnp.int32)
      _, d_idx = lax.top_k(jnp.where(dense, r, -1.0), d_slots)
      _, s_idx = lax.top_k(jnp.where(keep & ~dense, r, -1.0), c_slots)
      nd = jnp.minimum(nd_all, d_slots)
      ns = jnp.minimum(ns_all, c_slots - nd)  # c_slots - nd >= 1 (see capacities)
      j_d = jnp.arange(d_slots, dtype=jnp.int32)
      j_s = jnp.arange(c_slots, dtype=jnp.int32)
      idx = jnp.full((c_slots,), n, jnp.int32)
      idx = idx.at[j_d].set(jnp.where(j_d < nd, d_idx.astype(jnp.int32), n))
      dest = jnp.where(j_s < ns, nd + j_s, c_slots)  # past the end: dropped
      idx = idx.at[dest].set(s_idx.astype(jnp.int32), mode="drop")
      return idx + zero, nd + zero, nd_all + zero, ns_all + zero

    # nd_all, ns_all: dense and sign entries drawn; nd of them dense are sent.
    idx, nd, nd_all, ns_all = lax.cond(overflow, subsample, common, None)
    # Unbiased thinning factors (1 unless the part overflowed): count / kept.
    room = jnp.maximum(c_slots - nd, 1)
    f_dense = jnp.where(nd_all > d_slots, nd_all.astype(_F32) / d_slots, 1.0)
    f_sign = jnp.where(ns_all > room, ns_all.astype(_F32) / room.astype(_F32), 1.0)
    vals = xf[jnp.minimum(idx, n - 1)]
    j = jnp.arange(d_slots, dtype=jnp.int32)
    values = jnp.where(j < nd, vals[:d_slots] * f_dense, 0.0)
    signs = bitpack.pack_bits(((idx < n) & (vals < 0)).astype(jnp.uint32), 1)
    scale = scale * f_sign
    # NaN policy: a non-finite input poisons every value, so no decoding of it is finite.
    values = jnp.where(all_finite, values, jnp.nan)
    scale = jnp.where(all_finite, scale, jnp.nan)
    arrays = {
      "indices": idx.astype(idt),
      "signs": signs,
      "values": values,
      "scale": scale.astype(_F32),
      "num_dense": nd.astype(jnp.int32),
    }
    return Payload(arrays, shape, dtype), overflow

  # --------------------------------------------------------------------------- decode

  def entries(self, payload: Payload) -> tuple[Array, Array]:
    arrays = payload.arrays
    idx = arrays["indices"].astype(jnp.int32)
    c_slots = idx.shape[0]
    d_slots = arrays["values"].shape[0]
    neg = bitpack.unpack_bits(arrays["signs"], 1, c_slots) != 0
    scale = arrays["scale"]
    signed = jnp.where(neg, -scale, scale)
    dense = jnp.pad(arrays["values"], (0, c_slots - d_slots))
    j = jnp.arange(c_slots, dtype=jnp.int32)
    return idx, jnp.where(j < arrays["num_dense"], dense, signed)


_encode_jit = jax.jit(UnbiasedSparsifier._encode, static_argnums=0)
