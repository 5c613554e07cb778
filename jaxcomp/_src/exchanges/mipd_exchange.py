r"""MIPD's exchange: its payloads on the wire, the all-gather and the two-phase server.

:func:`jaxcomp.mipd` selects and codes each group's entries (:class:`_Coded`); this
module moves them. A :class:`_Format` is a payload's static wire layout (positions as a
bitmap or indices, normal-quantizer codes or float32 values, exact outliers);
:func:`exchange` routes a group either through an all-gather of every device's payload
or through the parameter server sharded over the devices (:class:`_Owners`: push with
``all_to_all``, reduce on the owner, pull with ``all_gather``), and falls back to an
exact all-gather of the same selection when a static capacity overflowed anywhere.
Every device decodes the same sums, so the server's prediction stays replicated.

MIPD's payloads are not a codec's (a selection made against the prediction, coded per
layer, summed with the senders' counts), so they take the collective primitives' own
transport directly: :func:`collectives.gather_tree`, :func:`collectives.all_to_all_tree`,
and the overflow branch every compressed exchange shares (:func:`collectives.agree`,
:func:`collectives.fallback_cond`); the leaves MIPD leaves out, and the flags the
devices agree on, take :func:`collectives.dense_means` (:func:`jaxcomp.mipd`'s sync).
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import math
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.codecs import normal
from jaxcomp._src.codecs import sparse
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.plumbing import bitpack
from jaxcomp._src.plumbing import phases

Array = jax.Array
_F32 = jnp.float32


class _Coded(NamedTuple):
  """One group's selection, coded: what a payload is packed from (a device's own, or an
  owner's rows of it). The field order is :meth:`_Format.pack`'s argument order."""

  flat: Array  # float32, the group's entries, flat (or (K, M) owner rows)
  mask: Array  # bool, like flat: the kept entries
  codes: Array | None  # int32, like flat: normal-quantizer codes (None: not quantized)
  outl: Array | None  # bool, like flat: kept entries beyond μ ± 3σ, sent exactly
  stats: Array | None  # float32, (layers, 2): each layer's (μ, σ)
  finite: Array | None  # bool, shape=(): the group's entries are all finite


class _Payload(NamedTuple):
  """The arrays of one payload on the wire (absent ones ``None``). The fields are in
  alphabetical order, the order in which the collectives fuse them into one buffer."""

  bitmap: Array | None = None  # uint32 words: positions as a bitmap
  codes: Array | None = None  # uint32 words: packed normal-quantizer codes
  indices: Array | None = None  # uint8/16/32: positions as indices
  outlier_indices: Array | None = None  # positions of the exactly sent outliers
  outlier_values: Array | None = None  # float32: their values
  stats: Array | None = None  # float32 (layers, 2): the (μ, σ) the codes refer to
  values: Array | None = None  # float32: the kept values (not quantized)


# ----------------------------------------------------------------------------- payload


class _Format:
  """Static wire format of one payload: a vector of ``n`` entries in layer segments.

  Up to ``slots`` entries travel, their positions as a bitmap of ``n`` bits or as
  ``slots`` indices (whichever is smaller; nothing when ``dense``: every entry is sent),
  their values as normal-quantizer codes against the segment's ``(μ, σ)`` (``quantizer``)
  or as float32 (``quantizer=None``); values beyond ``μ ± 3σ`` as exact (index, float32)
  pairs in ``outliers`` slots. :meth:`pack` reports when either capacity overflowed.
  """

  def __init__(
    self, sizes: Sequence[int], slots: int, outliers: int, quantizer, dense: bool = False
  ):
    self.sizes = tuple(int(s) for s in sizes)
    self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
    self.n = int(self.offsets[-1])
    self.dense = bool(dense)
    self.slots = self.n if self.dense else int(slots)
    self.quantizer = quantizer
    self.outliers = int(outliers) if quantizer is not None else 0
    self.index_bytes = sparse.index_dtype(self.n).itemsize if self.n else 1
    self.bitmap = not self.dense and 32 * -(-self.n // 32) < self.slots * 8 * self.index_bytes

  @property
  def nbytes(self) -> int:
    """Bytes of one payload (what :meth:`pack` returns)."""
    b = 0
    if not self.dense:
      b += 4 * bitpack.num_words(self.n, 1) if self.bitmap else self.slots * self.index_bytes
    q = self.quantizer
    if q is None:
      return b + 4 * self.slots
    return (
      b
      + 4 * bitpack.num_words(self.slots, q.bits)
      + 8 * len(self.sizes)
      + self.outliers * (self.index_bytes + 4)
    )

  def pack(
    self,
    flat: Array,
    mask: Array,
    codes: Array | None,
    outl: Array | None,
    stats: Array | None,
    finite: Array,
  ) -> tuple[_Payload, Array]:
    """Payload of the entries of flat ``x`` under ``mask``; (arrays, overflowed).

    ``codes``, ``outl`` (kept entries beyond the range) and ``stats`` (``(μ, σ)`` per
    segment) come from :func:`_layer_codes` (the fields of a :class:`_Coded`, in its
    order). A non-finite ``finite`` sends NaN stats and values, so the receivers' sums
    are non-finite too.
    """
    n, q = self.n, self.quantizer
    arrays = {}
    main = mask
    if q is not None:
      out_idx = sparse.compact(outl, self.outliers)
      out_vals = jnp.where(out_idx < n, flat[jnp.minimum(out_idx, n - 1)], 0.0)
      # Sent exactly: not among the coded entries.
      main = mask & ~jnp.zeros((n,), bool).at[out_idx].set(True, mode="drop")
      arrays["stats"] = jnp.where(finite, stats, jnp.nan)
      arrays["outlier_indices"] = out_idx.astype(sparse.index_dtype(n))
      arrays["outlier_values"] = jnp.where(finite, out_vals, jnp.nan)
    if self.dense:  # every entry coded; an outlier's code is ignored on decoding
      pos = jnp.arange(n, dtype=jnp.int32)
    else:
      pos = sparse.compact(main, self.slots)
      if self.bitmap:
        arrays["bitmap"] = bitpack.pack_bits(main.astype(jnp.uint32), 1)
      else:
        arrays["indices"] = pos.astype(sparse.index_dtype(n))
    safe = jnp.minimum(pos, n - 1)
    if q is not None:
      arrays["codes"] = bitpack.pack_bits(codes[safe], q.bits)
    else:
      arrays["values"] = jnp.where(finite, jnp.where(pos < n, flat[safe], 0.0), jnp.nan)
    return _Payload(**arrays), self.overflows(mask, outl)

  def overflows(self, mask: Array, outl: Array | None) -> Array:
    """Whether the entries of ``mask``, or the outliers ``outl``, exceed the slots."""
    over = jnp.zeros((), bool) if self.dense else (jnp.sum(mask, dtype=jnp.int32) > self.slots)
    if self.quantizer is not None:
      over = over | (jnp.sum(outl, dtype=jnp.int32) > self.outliers)
    return over

  def entries(self, arrays: _Payload) -> tuple[Array, Array]:
    """(positions, float32 values) of one payload; padding slots have position n."""
    n, q = self.n, self.quantizer
    if self.dense:
      pos = jnp.arange(n, dtype=jnp.int32)
    elif self.bitmap:
      pos = sparse.compact(bitpack.unpack_bits(arrays.bitmap, 1, n) != 0, self.slots)
    else:
      pos = arrays.indices.astype(jnp.int32)
    if q is None:
      return pos, arrays.values
    codes = bitpack.unpack_bits(arrays.codes, q.bits, self.slots)
    seg = jnp.searchsorted(jnp.asarray(self.offsets[1:-1], jnp.int32), pos, side="right")
    stats = arrays.stats[seg]
    vals = normal.proxy_values(codes, stats[:, 0], stats[:, 1], q.intervals, q.sigmas)
    out = arrays.outlier_indices.astype(jnp.int32)
    if self.dense:  # the outliers' exact values replace their codes
      pos = pos.at[out].set(n, mode="drop")
    return (
      jnp.concatenate([pos, out]),
      jnp.concatenate([jnp.where(pos < n, vals, 0.0), arrays.outlier_values]),
    )

  def sum_and_count(self, stacked: _Payload) -> tuple[Array, Array]:
    """Sum over the stacked payloads (leading axis), and how many sent each entry."""
    pos, vals = jax.vmap(self.entries)(stacked)
    total = sparse.scatter(self.n, pos, vals)
    count = sparse.scatter(self.n, pos, jnp.ones(pos.shape, _F32))
    return total, count

  def values(self, arrays: _Payload) -> Array:
    """The dense vector of one payload (entries not sent are 0)."""
    return sparse.scatter(self.n, *self.entries(arrays))


def _layer_codes(flats: Sequence[Array], masks: Sequence[Array], quantizer):
  """Per segment ``f`` of ``flats``: the normal quantizer's codes against the moments of
  all of ``f`` (the distribution the paper models; the kept entries are its tails), and
  the kept entries beyond the range. Returns (codes, outlier mask, stats (L, 2))."""
  stats, codes, outl = [], [], []
  for f, m in zip(flats, masks):
    mu, sigma = normal.moments(f)
    c, o = normal.interval_codes(f, mu, sigma, quantizer.intervals, quantizer.sigmas)
    stats.append(jnp.stack([mu, sigma]))
    codes.append(c)
    outl.append(o & m)
  return jnp.concatenate(codes), jnp.concatenate(outl), jnp.stack(stats)


def code(flats: Sequence[Array], masks: Sequence[Array], quantizer) -> _Coded:
  """The group's flat values, mask, and (quantized) codes, outliers and stats."""
  flat = jnp.concatenate(flats)
  codes = outl = stats = None
  if quantizer is not None:
    codes, outl, stats = _layer_codes(flats, masks, quantizer)
  return _Coded(flat, jnp.concatenate(masks), codes, outl, stats, jnp.all(jnp.isfinite(flat)))


# ----------------------------------------------------------------------------- two-phase


#: Bound on the probability, per step and group, that the two-phase exchange's capacities
#: overflow where the all-gather's would not (then the step falls back to the all-gather).
_OVERFLOW_BOUND = 1e-6
_OWNER_SEED = 20220301  # the fixed random assignment of entries to owners


@functools.lru_cache(maxsize=64)
def owner_index(sizes: tuple[int, ...], k: int) -> np.ndarray:
  """Which entries of a group each of ``k`` devices owns: ``(k, M)`` int32 positions.

  Layer ``i`` (``s_i`` entries) gets ``K·m_i`` slots, ``m_i = ceil(s_i / K)``: its entries
  and ``K·m_i - s_i`` padding slots (position ``n``, the group's size). A fixed random
  permutation (seeded: the same on every device and process) shuffles the slots and deals
  them out in ``K`` chunks of ``m_i``; device j's row is its chunk of every layer, in
  layer order, ``M = Σ_i m_i`` entries. The assignment is random so that any set of
  entries (a layer's largest magnitudes, whatever their structure: rows, channels) is
  split over the owners like a random sample, whose counts concentrate (:func:`_capacity`).
  """
  rng = np.random.default_rng(_OWNER_SEED)
  n = int(sum(sizes))
  rows, offset = [], 0
  for s in sizes:
    m = -(-int(s) // k)
    slots = rng.permutation(k * m)
    rows.append(np.where(slots < s, offset + slots, n).reshape(k, m))
    offset += int(s)
  out = np.concatenate(rows, axis=1).astype(np.int32)
  out.setflags(write=False)  # cached: shared by every caller
  return out


def _capacity(mean: float, m: int, k: int) -> int:
  """Slots for the count of a random sample's members in a row of ``m`` owner slots.

  Under the random assignment (:func:`owner_index`) the entries of a fixed set that fall
  in one device's row are a sum over layers of independent hypergeometric counts, with
  mean at most ``mean`` and variance at most ``min(mean, m/4)``. Hoeffding's inequality
  (which holds for sampling without replacement, Hoeffding 1963 §6) and Bernstein's
  bound the chance it exceeds ``mean + t``; ``t`` is the smaller of the two that puts
  this at ``_OVERFLOW_BOUND / (2K²)``: a union over K senders, K owners and the two
  capacities (kept entries, outliers) leaves at most ``_OVERFLOW_BOUND`` per step.
  """
  log = math.log(2 * k * k / _OVERFLOW_BOUND)
  var = min(mean, m / 4)
  t = min(math.sqrt(m * log / 2), log / 3 + math.sqrt(log * log / 9 + 2 * log * var))
  return int(min(m, math.ceil(mean + t)))


class _Owners:
  """Static layout of a group's two-phase exchange on ``k`` devices (``group``: a
  ``jaxcomp._src.methods.mipd._Group``).

  Push: a device sends owner j the kept entries of j's row (:func:`owner_index`) in a
  static capacity (:func:`_capacity` of ``kept/K``, and of ``outliers/K`` for the exact
  outliers), positions as a bitmap of the row or indices into it, values coded against
  the sender's per-layer ``(μ, σ)``. Pull: owner j's averaged row (and the received mean,
  when the prediction smooths it) coded against each layer segment's own ``(μ, σ)``, or
  float32 (``pull_quantizer=None``).
  """

  def __init__(self, group, k: int, pull_quantizer, vectors: int):
    self.k = k
    self.index = owner_index(group.sizes, k)
    seg = [-(-s // k) for s in group.sizes]
    self.m = int(sum(seg))
    dense = group.drops == 0
    slots = self.m if dense else _capacity(group.kept / k, self.m, k)
    outliers = _capacity(group.fmt.outliers / k, self.m, k) if group.fmt.outliers else 0
    self.row = _Format(seg, slots, outliers, group.quantizer, dense)
    self.vectors = vectors
    self.pull = None
    if pull_quantizer is not None:  # outlier room as for the push's (data-dependent here)
      pull_outliers = _capacity(sparse.num_entries(group.outlier_fraction, group.n) / k, self.m, k)
      self.pull = _Format(seg, self.m, pull_outliers, pull_quantizer, dense=True)

  def nbytes(self) -> float:
    """Bytes received per device per step (ring convention of :mod:`jaxcomp.wire`)."""
    k = self.k
    pull = self.pull.nbytes if self.pull is not None else 4 * self.m
    return (k - 1) / k * k * self.row.nbytes + (k - 1) * self.vectors * pull

  def rows(self, x: Array, fill) -> Array:
    """``(K, M)``: the entries of the group's flat ``x`` each owner reduces."""
    return jnp.concatenate([x, jnp.full((1,), fill, x.dtype)])[jnp.asarray(self.index)]

  def unrows(self, rows: Array, n: int) -> Array:
    """The group's flat vector from the ``(K, M)`` rows of all owners."""
    return (
      jnp.zeros((n,), rows.dtype)
      .at[jnp.asarray(self.index).reshape(-1)]
      .set(rows.reshape(-1), mode="drop")
    )


def _match(x: Array, like: Array) -> Array:
  """``x`` typed varying over every mesh axis ``like`` varies over (shard_map's
  check_vma), so that the two branches of a ``lax.cond`` have the same type."""
  extra = tuple(sorted(collectives.varying_axes(like) - collectives.varying_axes(x)))
  return lax.pcast(x, extra, to="varying") if extra else x


# ----------------------------------------------------------------------------- exchange


def _means(total, count, pred, k: int, compensate: bool):
  """(mean, received mean) from the sums and the senders' counts (compensation)."""
  received = total / k
  return ((total + (k - count) * pred) / k if compensate else received), received


def _gathered(fmt: _Format, coded: _Coded, p_flat: Array, k: int, axis_name, compensate):
  """All-gathers the selection in ``fmt``; (mean, received mean, overflowed here)."""
  arrays, overflow = fmt.pack(*coded)
  got = (
    jax.tree.map(lambda x: x[None], arrays)
    if axis_name is None
    else collectives.gather_tree(arrays, axis_name)
  )
  with jax.named_scope(phases.DECODE_SCOPE):
    return (*_means(*fmt.sum_and_count(got), p_flat, k, compensate), overflow)


def _allgather(group, coded: _Coded, p_flat: Array, k: int, axis_name, compensate):
  """The all-gather exchange (with the exact fallback when a quantized payload's
  capacity overflowed on some device): (mean, received mean, overflowed)."""
  if group.quantizer is None:
    mean, received, _ = _gathered(group.fmt, coded, p_flat, k, axis_name, compensate)
    return mean, received, jnp.zeros((), bool)
  overflow = collectives.agree(group.fmt.overflows(coded.mask, coded.outl), axis_name)
  mean, received = collectives.fallback_cond(
    overflow,
    lambda: _gathered(group.fmt, coded, p_flat, k, axis_name, compensate)[:2],
    lambda: _gathered(group.exact, coded, p_flat, k, axis_name, compensate)[:2],
  )
  return mean, received, overflow


def _pull(owners: _Owners, vecs: list[Array], axis_name):
  """All-gathers every owner's rows ``vecs``: (list of ``(K, M)``, overflowed)."""
  fmt = owners.pull
  if fmt is None:
    return collectives.gather_tree(vecs, axis_name), jnp.zeros((), bool)
  payloads, overflow = [], jnp.zeros((), bool)
  with jax.named_scope(phases.ENCODE_SCOPE):
    for v in vecs:
      segs = [v[int(lo) : int(hi)] for lo, hi in zip(fmt.offsets[:-1], fmt.offsets[1:])]
      codes, outl, stats = _layer_codes(
        segs, [jnp.ones(s.shape, bool) for s in segs], fmt.quantizer
      )
      arrays, o = fmt.pack(v, jnp.ones(v.shape, bool), codes, outl, stats, jnp.all(jnp.isfinite(v)))
      payloads.append(arrays)
      overflow = overflow | o
  overflow = collectives.agree(overflow, axis_name)

  def coded():
    got = collectives.gather_tree(payloads, axis_name)
    with jax.named_scope(phases.DECODE_SCOPE):
      return [jax.vmap(fmt.values)(g) for g in got]

  def exact():
    return collectives.gather_tree(vecs, axis_name)

  return collectives.fallback_cond(overflow, coded, exact), overflow


def _two_phase(group, owners: _Owners, coded: _Coded, p_flat: Array, axis_name, compensate):
  """Push (``all_to_all``) to the owners, reduce, pull (``all_gather``)."""
  k, n = owners.k, group.n
  with jax.named_scope(phases.ENCODE_SCOPE):
    quantized = group.quantizer is not None
    rows = _Coded(
      flat=owners.rows(coded.flat, 0.0),
      mask=owners.rows(coded.mask, False),
      codes=owners.rows(coded.codes, 0) if quantized else None,
      outl=owners.rows(coded.outl, False) if quantized else None,
      stats=None,
      finite=None,
    )
    payload, overflow = jax.vmap(
      lambda r: owners.row.pack(r.flat, r.mask, r.codes, r.outl, coded.stats, coded.finite)
    )(rows)
  overflow = collectives.agree(jnp.any(overflow), axis_name)

  def push_and_pull():
    got = collectives.all_to_all_tree(payload, axis_name)
    with jax.named_scope(phases.DECODE_SCOPE):
      total, count = owners.row.sum_and_count(got)
      mine = jnp.asarray(owners.index)[lax.axis_index(axis_name)]
      pred = jnp.concatenate([p_flat, jnp.zeros((1,), _F32)])[mine]
      mean, received = _means(total, count, pred, k, compensate)
    rows_out, pull_overflow = _pull(owners, [mean, received][: owners.vectors], axis_name)
    with jax.named_scope(phases.DECODE_SCOPE):
      # Typed like the fallback's mean, which has the prediction's type (varying when
      # a caller keeps the state per device).
      flat = [_match(owners.unrows(r, n), p_flat) for r in rows_out]
    return flat[0], flat[-1], _match(pull_overflow, overflow)

  def fallback():
    mean, received, _ = _gathered(group.exact, coded, p_flat, k, axis_name, compensate)
    return _match(mean, p_flat), _match(received, p_flat), _match(jnp.zeros((), bool), overflow)

  mean, received, pull_overflow = collectives.fallback_cond(overflow, push_and_pull, fallback)
  return mean, received, overflow | pull_overflow


def plan(group, *, collective: str, axis_name, pull_quantizer, vectors: int) -> _Owners | None:
  """The group's two-phase layout, or None for the all-gather (``collective="auto"``:
  whichever moves fewer bytes)."""
  if axis_name is None or collective == "allgather":
    return None
  k = collectives.axis_size(axis_name)
  owners = _Owners(group, k, pull_quantizer, vectors)
  if collective == "two_phase" or owners.nbytes() < (k - 1) * group.fmt.nbytes:
    return owners
  return None


def exchange(group, coded: _Coded, p_flat: Array, *, owners: _Owners | None, axis_name, compensate):
  """One group's coded selection exchanged: (mean, received mean, overflowed), flat.

  ``mean`` is the compensated mean (dropped entries count as the prediction ``p_flat``)
  or, with ``compensate=False``, the received one (dropped entries count 0).
  """
  k = 1 if axis_name is None else collectives.axis_size(axis_name)
  if owners is not None:
    return _two_phase(group, owners, coded, p_flat, axis_name, compensate)
  return _allgather(group, coded, p_flat, k, axis_name, compensate)
