"""Sparse codecs: payloads of a static number of (index, value) entries.

A sparse payload of a tensor of ``n`` values holds a *static* number of entries, so it
has a fixed shape and can cross ``lax.all_gather`` like any payload:

* ``indices``: the flat positions, as the narrowest unsigned type that holds ``n``
  itself (``uint8`` for ``n < 2**8``, ``uint16`` for ``n < 2**16``, else ``int32``;
  tensors of ``2**31`` values or more are rejected). The value ``n`` marks an unused slot
  (padding); decoding drops it.
* values, in float32 (or the codec's own coding, e.g. a sign bit and one shared scale).

Decoding scatter-adds the entries into zeros. :meth:`SparseCodec.decode_sum` of a
gathered stack scatter-adds all K devices' entries in one pass, in rank order (the
entries of device 0 first), so no K dense intermediates are built.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.codecs.base import Array
from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.codecs.base import Payload
from jaxcomp._src.codecs.base import _check_float
from jaxcomp._src.plumbing import bitpack

_F32 = jnp.float32
_MAX_N = 2**31 - 1


def index_dtype(n: int):
  """Narrowest index dtype that holds every position of ``n`` values *and* ``n`` (padding)."""
  if n >= _MAX_N:
    raise ValueError(f"sparse codecs handle tensors of fewer than 2**31 values, got {n}")
  if n < 2**8:
    return jnp.dtype(jnp.uint8)
  if n < 2**16:
    return jnp.dtype(jnp.uint16)
  return jnp.dtype(jnp.int32)


def num_entries(density: float, n: int) -> int:
  """``k = ceil(density · n)``, at least 1 (for ``n >= 1``) and at most ``n``."""
  if n == 0:
    return 0
  # The tiny slack absorbs float error in density * n (0.001 * 2000 = 2.0000000000000004).
  return int(min(n, max(1, math.ceil(density * n - 1e-9))))


def check_density(density, name: str = "density") -> None:
  if (
    isinstance(density, bool)
    or not isinstance(density, (int, float, np.floating))
    or not (0 < density <= 1)
  ):
    raise ValueError(f"{name} must be a number in (0, 1], got {density!r}")


def scatter(n: int, indices: Array, values: Array) -> Array:
  """Dense float32 vector of length n with ``values`` added at ``indices`` (n = padding)."""
  zeros = jnp.zeros((n,), _F32)
  return zeros.at[indices.reshape(-1).astype(jnp.int32)].add(
    values.reshape(-1).astype(_F32), mode="drop"
  )


#: Word counts up to this use jnp.cumsum (XLA:CPU's reduce-window: cheap at this size,
#: and quicker to compile); above it a lax.associative_scan, which XLA:CPU runs in a
#: few passes instead of a reduce-window over all of them.
_CUMSUM_MAX = 2**14


def _inclusive_sum(x: Array) -> Array:
  if x.shape[0] <= _CUMSUM_MAX:
    return jnp.cumsum(x, dtype=x.dtype)
  return lax.associative_scan(jnp.add, x)


def select_bit(word: Array, rank: Array) -> Array:
  """Position (0..31) of the ``rank``-th set bit (1-based, from bit 0) of each uint32
  ``word``: a binary search on the popcounts of halves, 5 steps."""
  pos = jnp.zeros(rank.shape, jnp.int32)
  for width in (16, 8, 4, 2, 1):
    low = lax.population_count(word & jnp.uint32((1 << width) - 1)).astype(jnp.int32)
    up = rank > low
    rank = jnp.where(up, rank - low, rank)
    word = jnp.where(up, word >> width, word)
    pos = pos + jnp.where(up, width, 0)
  return pos


def _packed_ranks(mask: Array) -> tuple[Array, Array, Array]:
  """``(words, counts, ends)`` of a flat bool ``mask``: packed 32 per uint32 word (bit
  ``i`` of word ``w`` is entry ``32w + i``), each word's popcount, and their inclusive
  sum (the number of True entries up to the end of each word)."""
  words = bitpack.pack_bits(mask.astype(jnp.uint32), 1)
  counts = lax.population_count(words).astype(jnp.int32)
  return words, counts, _inclusive_sum(counts)


def _kth_true(words: Array, counts: Array, ends: Array, k: Array) -> tuple[Array, Array]:
  """Position of the ``k``-th True entry (1-based, ``k`` any shape), and whether there
  is one (``1 <= k <= total``): a binary search of ``ends`` for its word, then
  :func:`select_bit` within the word."""
  nw = words.shape[0]
  w = jnp.searchsorted(ends, k, side="left").astype(jnp.int32)  # nw: fewer than k
  safe = jnp.minimum(w, nw - 1)
  bit = select_bit(words[safe], k - (ends[safe] - counts[safe]))
  return safe * 32 + bit, (w < nw) & (k >= 1)


def compact(mask: Array, size: int) -> Array:
  """Positions of the first ``size`` True entries of a flat ``mask``, padded with n (int32).

  What ``jnp.nonzero(mask, size=size, fill_value=n)`` returns, without a cumsum over
  ``n`` values (XLA:CPU runs that as a reduce-window) or a scatter of ``n`` updates,
  where the output is small. For ``size <= n/8`` each output is found by
  :func:`_kth_true`: ``O(size log n)`` after one pass over the mask. For larger outputs
  each True is scattered to its rank, ``ends[w] - popcount(w) + popcount(bits of w
  below it)``. the XLA:CPU table of ``docs/benchmarks.md`` has both next to
  ``jnp.nonzero`` and ``jnp.cumsum``.
  """
  n = mask.shape[0]
  if size == 0 or n == 0:
    return jnp.full((size,), n, jnp.int32)
  words, counts, ends = _packed_ranks(mask)
  if 8 * size <= n:
    pos, found = _kth_true(words, counts, ends, jnp.arange(1, size + 1, dtype=jnp.int32))
    return jnp.where(found, pos, n)
  nw = words.shape[0]
  lanes = jnp.arange(32, dtype=jnp.uint32)
  set_bits = (words[:, None] >> lanes) & 1
  below = lax.population_count(words[:, None] & ((jnp.uint32(1) << lanes) - 1))
  dest = jnp.where(set_bits != 0, (ends - counts)[:, None] + below.astype(jnp.int32), size)
  out = jnp.full((size,), n, jnp.int32)
  return out.at[dest.reshape(-1)].set(jnp.arange(nw * 32, dtype=jnp.int32), mode="drop")


def first_trues(mask: Array, count: Array) -> Array:
  """``mask & (cumsum(mask) <= count)``: the first ``count`` (dynamic; none when ``<= 0``)
  True entries of a flat ``mask``, without the cumsum over ``n`` values: the mask is
  cut after its ``count``-th True (:func:`_kth_true`)."""
  n = mask.shape[0]
  if n == 0:
    return mask
  count = jnp.asarray(count, jnp.int32)
  pos, found = _kth_true(*_packed_ranks(mask), count)
  last = jnp.where(found, pos, jnp.where(count <= 0, -1, n))
  return mask & (jnp.arange(n, dtype=jnp.int32) <= last)


class SparseCodec(Codec):
  """Base of the sparse codecs: subclasses implement ``entries(payload)``."""

  def entries(self, payload: Payload) -> tuple[Array, Array]:
    """(flat int indices, float32 values) of one payload; padding slots have index n."""
    raise NotImplementedError

  def _decode_f32(self, payload: Payload) -> Array:
    idx, val = self.entries(payload)
    return scatter(math.prod(payload.shape), idx, val)

  def decode_sum(self, stacked: Payload) -> Array:
    """Sum of K stacked payloads: one scatter-add of all their entries, rank order."""
    idx, val = jax.vmap(self.entries)(stacked)
    n = math.prod(stacked.shape)
    return scatter(n, idx, val).reshape(stacked.shape)


def _pack_entries(x: Array, idx: Array, n: int) -> Payload:
  """Payload of the entries of x at idx (int32, n = padding): values and narrow indices."""
  flat = x.reshape(-1)
  values = jnp.where(idx < n, flat[jnp.minimum(idx, n - 1)].astype(_F32), 0.0)
  # A NaN/Inf anywhere in x must not vanish because it was not selected: poison the
  # values so the decoded mean is not finite either (jaxcomp's NaN policy).
  values = jnp.where(jnp.all(jnp.isfinite(flat)), values, jnp.nan)
  return Payload(
    {"values": values, "indices": idx.astype(index_dtype(n))}, tuple(x.shape), jnp.dtype(x.dtype)
  )


def _entries(payload: Payload) -> tuple[Array, Array]:
  return payload.arrays["indices"].astype(jnp.int32), payload.arrays["values"]


# ----------------------------------------------------------------------------- top-k


_BLOCK = 32  # values per block of the two-level selections


def _blocks(a: Array, block: int) -> Array:
  """(ceil(n/block), block) view of a flat non-negative vector, padded with -1."""
  nb = -(-a.shape[0] // block)
  return jnp.pad(a, (0, nb * block - a.shape[0]), constant_values=-1.0).reshape(nb, block)


def _top_in_blocks(blocks: Array, chosen: Array, k: int, n: int, ids: Array | None = None) -> Array:
  """Flat indices of the k largest entries inside the chosen blocks (-1 entries -> n).

  ``ids`` are the chosen blocks' positions in the vector when ``blocks`` is already
  the gathered subset (then ``chosen`` indexes into it). The blocks are visited in
  increasing position, so ``lax.top_k``'s tie rule (the lower position first) picks
  among equal values exactly as it would over the whole vector.
  """
  block = blocks.shape[1]
  ids = chosen if ids is None else ids
  order = jnp.argsort(ids)
  chosen, ids = chosen[order], ids[order]
  vals, pos = lax.top_k(blocks[chosen].reshape(-1), k)
  idx = ids[pos // block] * block + pos % block
  return jnp.where(vals >= 0, idx, n).astype(jnp.int32)


def passes(a: Array, thr: Array) -> Array:
  """1.0 where ``a >= thr`` (as ``a · (1/thr) >= 1``), 0.0 below, for ``thr > 0``.

  Negative ``a`` (the -1 padding of :func:`_blocks`) gives a negative value, never > 0.
  No lower clip: ``floor(min(x, 1))`` alone keeps XLA:CPU's vectorised reduction
  (the XLA:CPU table of ``docs/benchmarks.md``).
  """
  return jnp.floor(jnp.minimum(a * (1.0 / thr), 1.0))


def blocked_top_k(a: Array, k: int, block: int = _BLOCK) -> Array:
  """``lax.top_k(a, k)[1]`` of a flat non-negative vector, in two small ``top_k`` calls.

  Every entry of the top k lies in one of the k blocks with the largest block maxima
  (ties to the lower block): a block outside them has k blocks ranked above it, each
  holding an entry ranked above all of its own (larger, or equal and at a lower
  position). So the top k of those ``k · block`` entries, visited in position order, is
  the top k of the vector, ties included: the same indices in the same order as
  ``lax.top_k``. It reads the vector once for the block maxima and sorts
  ``n/block + k·block`` values instead of n.
  """
  n = a.shape[0]
  blocks = _blocks(a, block)
  if blocks.shape[0] <= k:
    return lax.top_k(a, k)[1].astype(jnp.int32)
  _, chosen = lax.top_k(jnp.max(blocks, axis=1), k)
  return _top_in_blocks(blocks, chosen, k, n)


def sampled_threshold_select(
  a: Array, k: int, key: Array, *, sample_fraction: float, max_rounds: int, capacity: int
) -> tuple[Array, Array]:
  """DGC's sampled threshold, exact: (``lax.top_k(a, k)[1]``, number that passed).

  ``a`` is a flat non-negative vector (``|x|``). A random sample of
  ``m = ceil(sample_fraction · n)`` entries gives a first threshold: the value that
  ``ceil(1.4 k m / n)`` sampled entries reach, aiming at about 1.4k entries above it.
  The entries at or above the threshold are counted (one pass); while the count is
  outside ``[k, capacity]`` the threshold is refined (at most ``max_rounds`` passes):
  multiplied by 0.8 (too few, the reference code's step) or 1.25 (too many) until the
  count is bracketed, then bisected.

  The threshold decides only how much work the selection takes, never what it selects.
  Passing is monotone in the value, so when at least k entries pass, the top k all
  pass, equal values alike; the passing entries lie in at most ``capacity`` blocks of 32
  (those whose maximum passes), which are gathered in position order and the top k of
  their passing entries taken (:func:`_top_in_blocks`). When the refinement ends
  outside ``[k, capacity]`` (rounds used up; fewer than k non-zero entries, since zeros
  never pass), :func:`blocked_top_k` runs instead. Either way the result is exactly
  ``lax.top_k(a, k)[1]``: the same indices in the same order, ties to the lower
  position, k entries (zero-valued ones when fewer than k are non-zero).
  """
  n = a.shape[0]
  m = min(n, max(int(math.ceil(sample_fraction * n)), 1))
  ks = min(m, max(1, int(math.ceil(1.4 * k * m / n))))
  sample = a[jax.random.randint(key, (m,), 0, n)]
  # min() of the values, not [-1]: slicing top_k's output makes XLA:CPU rewrite the
  # top_k into a full sort (the XLA:CPU table of ``docs/benchmarks.md`` times both).
  thr0 = jnp.min(lax.top_k(sample, ks)[0])
  tiny = jnp.finfo(_F32).tiny
  thr0 = jnp.maximum(thr0, tiny)  # zeros never pass: a threshold of 0 would take them

  def count(thr):
    # floor(min(a/thr, 1)) is 1 exactly when a passes (the same test as `passes` below);
    # XLA:CPU vectorises this float sum, not a sum of a boolean compare.
    # (A float32 sum is exact up to 2**24 passing entries, far above any capacity.)
    return jnp.sum(passes(a, thr)).astype(jnp.int32)

  def cond(carry):
    r, _, _, _, c = carry
    return (r < max_rounds) & ((c < k) | (c > capacity))

  def body(carry):
    r, thr, lo, hi, c = carry
    few = c < k
    hi = jnp.where(few, thr, hi)  # smallest threshold known to pass too few
    lo = jnp.where(few, lo, thr)  # largest threshold known to pass too many
    bracketed = (lo > 0) & jnp.isfinite(hi)
    new = jnp.where(bracketed, 0.5 * (lo + hi), jnp.where(few, 0.8 * thr, 1.25 * thr))
    new = jnp.maximum(new, tiny)
    return r + 1, new, lo, hi, count(new)

  # lo/hi derive from thr0 so they carry its sharding type (varying under shard_map).
  init = (jnp.zeros((), jnp.int32), thr0, thr0 * 0.0, thr0 * 0.0 + jnp.inf, count(thr0))
  _, thr, _, _, c = lax.while_loop(cond, body, init)
  blocks = _blocks(a, _BLOCK)
  bmax = jnp.max(blocks, axis=1)
  cap_blocks = min(capacity, blocks.shape[0])

  def from_passing_blocks(_):
    # At most c <= capacity blocks hold a passing entry: take them, drop what fails.
    _, chosen = lax.top_k(jnp.where(passes(bmax, thr) > 0, bmax, -1.0), cap_blocks)
    got = blocks[chosen]
    return _top_in_blocks(
      jnp.where(passes(got, thr) > 0, got, -1.0), jnp.arange(cap_blocks), k, n, ids=chosen
    )

  def exact(_):
    if blocks.shape[0] <= k:
      return lax.top_k(a, k)[1].astype(jnp.int32)
    _, chosen = lax.top_k(bmax, k)
    return _top_in_blocks(blocks, chosen, k, n)

  idx = lax.cond((c > capacity) | (c < k), exact, from_passing_blocks, None)
  return idx, c


@dataclasses.dataclass(frozen=True)
class TopK(SparseCodec):
  r"""Keeps the ``k = ceil(density · n)`` entries of largest magnitude.

  .. math:: Q(x)_i = x_i \cdot [\,|x_i| \text{ is among the k largest}\,]

  Biased (it drops everything else): use it with error feedback or DGC's local
  accumulation (:func:`jaxcomp.dgc`), which keep what was not sent.

  Methods, all three exact: they return ``lax.top_k(|x|, k)``'s indices, in its order
  (decreasing magnitude, ties to the lower position), and differ only in cost:

  * ``"exact"``: ``lax.top_k`` of ``|x|``.
  * ``"blocked"``: two small ``top_k`` calls: the k blocks of 32 with the largest
    maxima, then the top k inside them (:func:`blocked_top_k`); faster than
    ``lax.top_k`` on CPU (``docs/benchmarks.md#top-k-selection``).
  * ``"sampled"``: Deep Gradient Compression's threshold estimation (the paper's
    reference code): a threshold is estimated from a random ``sample_fraction`` of the
    entries and refined with at most ``max_rounds`` counting passes, then the top k of
    the at most ``capacity_factor · k`` entries above it is taken; when the refinement
    does not land between k and that buffer, the blocked selection runs instead (see
    :func:`sampled_threshold_select`). The random sample changes the work, never the
    result. (The reference code keeps whatever its threshold selects, about k entries,
    not always the top k.)

  Wire format: ``k`` float32 values and ``k`` indices (``uint8``/``uint16`` when ``n``
  fits, else ``int32``; see :mod:`jaxcomp._src.codecs.sparse`): ``k · (32 + 16 or 32)`` bits.

  Args:
    density: fraction of entries kept, in (0, 1].
    method: ``"exact"``, ``"blocked"`` or ``"sampled"``.
    sample_fraction: share of entries sampled for the threshold (``"sampled"``).
    max_rounds: most refinement passes (``"sampled"``).
    capacity_factor: buffer of entries above the threshold, in units of k (>= 1).

  References:
    Lin, Han, Mao, Wang, Dally. *Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training*. ICLR 2018. https://arxiv.org/abs/1712.01887

  >>> import jax.numpy as jnp, jaxcomp as jc
  >>> codec = jc.codecs.TopK(0.25)  # k = ceil(0.25 * 8) = 2
  >>> payload = codec.encode(jnp.array([0.1, -3.0, 0.2, 2.0, 0.0, 0.5, -0.3, 1.0]))
  >>> payload.arrays["indices"]
  Array([1, 3], dtype=uint8)
  >>> codec.decode(payload)
  Array([ 0., -3.,  0.,  2.,  0.,  0.,  0.,  0.], dtype=float32)
  """

  density: float
  method: str = "exact"
  sample_fraction: float = 0.01
  max_rounds: int = 10
  capacity_factor: float = 2.0

  def __post_init__(self):
    check_density(self.density)
    if self.method not in ("exact", "blocked", "sampled"):
      raise ValueError(f"method must be 'exact', 'blocked' or 'sampled', got {self.method!r}")
    check_density(self.sample_fraction, "sample_fraction")
    if (
      isinstance(self.max_rounds, bool)
      or not isinstance(self.max_rounds, int)
      or (self.max_rounds < 0)
    ):
      raise ValueError(f"max_rounds must be an integer >= 0, got {self.max_rounds!r}")
    if not self.capacity_factor >= 1:
      raise ValueError(f"capacity_factor must be >= 1, got {self.capacity_factor!r}")

  @property
  def needs_key(self) -> bool:  # the sample is random
    return self.method == "sampled"

  def num_entries(self, n: int) -> int:
    return num_entries(self.density, n)

  def select(self, x: Array, *, key: Array | None = None) -> Array:
    """int32 flat indices of the k entries kept (n marks padding)."""
    n = x.size
    k = self.num_entries(n)
    a = jnp.abs(x.reshape(-1).astype(_F32))
    a = jnp.where(jnp.isnan(a), jnp.inf, a)  # NaNs are poisoned later; keep top_k sane
    if self.method == "exact" or k == n:
      return lax.top_k(a, k)[1].astype(jnp.int32)
    if self.method == "blocked":
      return blocked_top_k(a, k)
    key = self._require_key(key)
    capacity = min(n, int(math.ceil(self.capacity_factor * k)))
    idx, _ = sampled_threshold_select(
      a, k, key, sample_fraction=self.sample_fraction, max_rounds=self.max_rounds, capacity=capacity
    )
    return idx

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    _check_float(x)
    index_dtype(x.size)
    if x.size == 0:
      return _pack_entries(x, jnp.zeros((0,), jnp.int32), 0)
    return _pack_entries(x, self.select(x, key=key), x.size)

  def entries(self, payload: Payload) -> tuple[Array, Array]:
    return _entries(payload)


# ----------------------------------------------------------------------------- random-k


def systematic_indices(key: Array, n: int, k: int) -> Array:
  """k distinct indices, each of the n included with probability exactly k/n.

  Systematic sampling with a random start: ``(r + floor(j n / k)) mod n`` for
  ``j = 0..k-1`` and ``r`` uniform in ``[0, n)``. For every j exactly one r hits a given
  index, so its inclusion probability is ``k/n``; the offsets ``floor(j n / k)`` are
  distinct because ``n >= k``. It costs O(k), not a permutation of n.
  """
  return systematic_from_start(jax.random.randint(key, (), 0, n, dtype=jnp.int32), n, k)


def systematic_from_start(r: Array, n: int, k: int) -> Array:
  """``(r + floor(j n / k)) mod n`` for ``j = 0..k-1`` (int32)."""
  offsets = jnp.asarray((np.arange(k, dtype=np.int64) * n // k).astype(np.int32))
  # r + offset < 2n <= 2**32 - 2: compute the wrap in uint32 to avoid int32 overflow.
  s = r.astype(jnp.uint32) + offsets.astype(jnp.uint32)
  return jnp.where(s >= n, s - jnp.uint32(n), s).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class RandomK(SparseCodec):
  r"""Keeps ``k = ceil(density · n)`` random entries, scaled by ``n/k``: unbiased.

  .. math:: Q(x)_i = \frac{n}{k} x_i Z_i, \quad P(Z_i = 1) = k/n, \qquad
    \mathbb{E}[Q(x)] = x, \quad \mathbb{E}\|Q(x) - x\|^2 = (n/k - 1)\|x\|^2.

  The k indices come from systematic sampling with a random start
  (:func:`systematic_indices`): every coordinate has inclusion probability exactly k/n
  at O(k) cost; the kept coordinates are evenly spaced, which leaves the per-coordinate
  variance above unchanged.

  With ``shared=True`` every device uses the same indices (:func:`jaxcomp.compress` does
  not fold the device index into its key), so the payloads can be *summed*:
  ``collective="psum"`` all-reduces only the k values, ``2(K-1)/K · 4k`` bytes per
  device, flat in K, and the indices never cross the wire.

  Wire format: k float32 values and k indices (as :class:`TopK`); with ``psum``, only
  the values.

  Args:
    density: fraction of entries kept, in (0, 1].
    shared: draw the same indices on every device.
  """

  density: float
  shared: bool = False

  needs_key = True

  def __post_init__(self):
    check_density(self.density)

  @property
  def shared_randomness(self) -> bool:
    return bool(self.shared)

  @property
  def summable_fields(self):
    return ("values",) if self.shared else None

  def num_entries(self, n: int) -> int:
    return num_entries(self.density, n)

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    _check_float(x)
    key = self._require_key(key)
    n = x.size
    index_dtype(n)
    if n == 0:
      return _pack_entries(x, jnp.zeros((0,), jnp.int32), 0)
    k = self.num_entries(n)
    payload = _pack_entries(x, systematic_indices(key, n, k), n)
    arrays = dict(payload.arrays, values=payload.arrays["values"] * jnp.float32(n / k))
    return Payload(arrays, payload.shape, payload.dtype)

  def entries(self, payload: Payload) -> tuple[Array, Array]:
    return _entries(payload)


# ----------------------------------------------------------------------------- chunked top-k


def _check_int_in(value, name: str, lo: int, hi: int | None = None) -> None:
  bad = isinstance(value, bool) or not isinstance(value, (int, np.integer))
  if bad or value < lo or (hi is not None and value > hi):
    upper = f"..{hi}" if hi is not None else " or more"
    raise ValueError(f"{name} must be an integer in {lo}{upper}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ChunkedTopK(SparseCodec):
  r"""Top-k per chunk, the kept values quantized to ``bits`` bits against one scale per chunk.

  The flat tensor (row-major) is cut into chunks of ``c = min(chunk_size, n)`` values,
  the last one possibly shorter. In every chunk the ``k = ceil(density · c)`` entries of
  largest magnitude are kept (``lax.top_k``'s choice: ties to the lower position), and
  each kept value ``v`` is sent as a sign and one of ``L = 2**(bits-1)`` magnitudes of
  the chunk's scale ``s = max |v|`` (its largest kept magnitude), rounded to nearest:

  .. math::
    j = \mathrm{clip}\big(\mathrm{round}(L |v| / s),\, 1,\, L\big), \qquad
    \hat v = \mathrm{sign}(v)\, j\, s / L .

  At ``bits=2`` the kept values decode to ``±s/2`` or ``±s``. The rounding is
  deterministic and biased (``|v - \hat v| <= s/(2L)``, or ``< s/L`` for a value below
  ``s/(2L)``, which is lifted to ``s/L``; none is sent as zero, since it was chosen for
  its size); it is meant for error feedback, which keeps ``v - \hat v`` with what top-k
  dropped (SparseLoCo, :func:`jaxcomp.sparseloco`). Why a max scale and round to
  nearest: the largest kept value, the one that matters most to the step, is then sent
  exactly, and the levels need no extra statistics on the wire.

  Wire format, per chunk: ``k`` indices inside the chunk at ``ceil(log2 c)`` bits each
  (packed into uint32 words, :mod:`jaxcomp._src.plumbing.bitpack`), ``k`` codes of
  ``bits`` bits (the sign in the top bit, ``j - 1`` below it), and one float32 scale.
  Chunks of 4096 values at 1% density: ``41 · (12 + 2) + 32`` bits per 4096 values.
  A last chunk shorter than ``k`` sends padding slots, dropped on decoding.

  Args:
    density: fraction of each chunk kept, in (0, 1].
    bits: bits per kept value, sign included, 2 to 8.
    chunk_size: values per chunk (>= 1). 4096 is the size of the 64x64 tiles that the
      DeMo and SparseLoCo code cuts matrices into; here chunks are runs of the flat
      tensor.

  References:
    Sarfi, Thérien, Lidin, Belilovsky. *Communication Efficient LLM Pre-training with
    SparseLoCo*. 2025. https://arxiv.org/abs/2508.15706

  >>> import jax.numpy as jnp, jaxcomp as jc
  >>> codec = jc.codecs.ChunkedTopK(0.25, bits=2, chunk_size=4)  # k = 1 per chunk
  >>> codec.decode(codec.encode(jnp.array([0.1, -3.0, 0.2, 2.0, 0.0, 0.5, -0.3, 1.0])))
  Array([ 0., -3.,  0.,  0.,  0.,  0.,  0.,  1.], dtype=float32)
  """

  density: float
  bits: int = 2
  chunk_size: int = 4096

  def __post_init__(self):
    check_density(self.density)
    _check_int_in(self.bits, "bits", 2, 8)
    _check_int_in(self.chunk_size, "chunk_size", 1)

  def layout(self, n: int) -> tuple[int, int, int]:
    """``(c, chunks, k)``: values per chunk, chunks, and entries kept per chunk."""
    c = max(1, min(self.chunk_size, n))
    return c, -(-n // c), num_entries(self.density, c)

  def index_bits(self, n: int) -> int:
    """Bits of an index inside a chunk: ``ceil(log2 c)``, at least 1."""
    c = self.layout(n)[0]
    return max(1, (c - 1).bit_length())

  def num_entries(self, n: int) -> int:
    """Entries sent for a tensor of ``n`` values: ``k`` per chunk (padding included)."""
    _, chunks, k = self.layout(n)
    return chunks * k if n else 0

  def encode(self, x: Array, *, key: Array | None = None) -> Payload:
    del key  # deterministic
    _check_float(x)
    n = x.size
    index_dtype(n)
    c, chunks, k = self.layout(n)
    flat = x.reshape(-1).astype(_F32)
    a = jnp.abs(flat)
    a = jnp.where(jnp.isnan(a), jnp.inf, a)  # NaNs are poisoned below; keep top_k sane
    a = jnp.pad(a, (0, chunks * c - n), constant_values=-1.0).reshape(chunks, c)
    _, local = lax.top_k(a, k)  # (chunks, k), padding (-1) chosen last
    pos = jnp.arange(chunks, dtype=jnp.int32)[:, None] * c + local.astype(jnp.int32)
    v = jnp.where(pos < n, flat[jnp.minimum(pos, max(n - 1, 0))], 0.0)
    scale = jnp.max(jnp.abs(v), axis=1)
    # A NaN/Inf anywhere must not vanish because it was not kept (jaxcomp's NaN policy).
    scale = jnp.where(jnp.all(jnp.isfinite(flat)), scale, jnp.nan)
    levels = 2 ** (self.bits - 1)
    safe = jnp.where(scale > 0, scale, 1.0)[:, None]
    j = jnp.clip(jnp.round(jnp.abs(v) * (levels / safe)), 1, levels).astype(jnp.uint32)
    codes = (j - 1) | (jnp.signbit(v).astype(jnp.uint32) << (self.bits - 1))
    arrays = {
      "indices": bitpack.pack_bits(local.reshape(-1).astype(jnp.uint32), self.index_bits(n)),
      "codes": bitpack.pack_bits(codes.reshape(-1), self.bits),
      "scales": scale,
    }
    return Payload(arrays, tuple(x.shape), jnp.dtype(x.dtype))

  def entries(self, payload: Payload) -> tuple[Array, Array]:
    n = math.prod(payload.shape)
    c, chunks, k = self.layout(n)
    local = bitpack.unpack_bits(payload.arrays["indices"], self.index_bits(n), chunks * k)
    codes = bitpack.unpack_bits(payload.arrays["codes"], self.bits, chunks * k)
    levels = 2 ** (self.bits - 1)
    j = (codes & jnp.uint32(levels - 1)).astype(_F32) + 1.0
    sign = jnp.where((codes >> (self.bits - 1)) & 1, -1.0, 1.0)
    scale = jnp.repeat(payload.arrays["scales"], k, total_repeat_length=chunks * k)
    pos = jnp.repeat(jnp.arange(chunks, dtype=jnp.int32) * c, k, total_repeat_length=chunks * k)
    pos = pos + local.astype(jnp.int32)
    return jnp.where(pos < n, pos, n), sign * j * (scale / levels)
