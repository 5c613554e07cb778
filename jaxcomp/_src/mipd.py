r"""MIPD (TPDS 2022): layer-wise adaptive sparsification, compensation, half updates.

The paper's system runs on an asynchronous parameter server. jaxcomp runs it
synchronously inside a collective: every device all-gathers every device's sparse,
quantized payload and decodes the same aggregate, so the server's state (the
exponential-smoothing prediction) is kept, identically, on every device. The
adaptations are listed in :func:`mipd`'s docstring and in ``docs/index.md``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp._src import bitpack
from jaxcomp._src import collectives
from jaxcomp._src import phases
from jaxcomp._src import normal
from jaxcomp._src import sparse
from jaxcomp._src import transforms
from jaxcomp._src import treeutil

Array = jax.Array
_F32 = jnp.float32
_TINY = 1e-30
PREDICT_FROM = ("received", "compensated")


# ----------------------------------------------------------------------------- drop rates


def inverse_share_rates(norms: Array) -> Array:
  r"""Drop rates inversely proportional to each layer's share of the norms (eqs. 1, 6).

  ``W_i = x_i / Σ_j x_j`` and ``r_i = W_i^{-1} / Σ_j W_j^{-1}`` (which equals
  ``x_i^{-1} / Σ_j x_j^{-1}``): the rates sum to 1 and a layer with a larger norm drops
  less. A zero norm counts as ``1e-30`` (that layer takes almost all the drops).
  """
  inv = 1.0 / jnp.maximum(norms.astype(_F32), _TINY)
  return inv / jnp.sum(inv)


def drop_rates(param_norms: Array, error_norms: Array, beta: float) -> Array:
  r"""MIPD's final per-layer rates (eq. 7): ``r = β r^{MI} + (1 - β) r^{ESP}``.

  ``r^{MI}`` from the L2 norms of the layers' parameters (interpretability, eq. 1),
  ``r^{ESP}`` from the L2 norms of their prediction errors ``||g_i - ĝ_i||`` (eq. 6).
  """
  return beta * inverse_share_rates(param_norms) + (1.0 - beta) * inverse_share_rates(
      error_norms)


def allocate_drops(rates: Array, sizes: Sequence[int], total: int) -> Array:
  """Integer drops per layer: ``≈ rates_i · total``, at most ``sizes_i``, summing to ``total``.

  Layers whose share exceeds their size are capped and their excess is handed to the
  others in proportion to their rates (water-filling, at most one round per layer);
  the fractional parts are then rounded so the sum is exactly ``total`` (largest
  remainders first). ``total`` must not exceed ``sum(sizes)``.
  """
  sizes_np = np.asarray(sizes, np.int64)
  if total > sizes_np.sum() or total < 0:
    raise ValueError(f"cannot drop {total} of {sizes_np.sum()} entries")
  nl = len(sizes_np)
  size = jnp.asarray(sizes_np, _F32)
  rates = jnp.maximum(rates.astype(_F32), 0.0)
  capped = jnp.zeros((nl,), bool)
  want = jnp.zeros((nl,), _F32)
  for _ in range(nl):
    free = jnp.float32(total) - jnp.sum(jnp.where(capped, size, 0.0))
    w = jnp.where(capped, 0.0, rates)
    wsum = jnp.sum(w)
    # All-zero rates among the uncapped layers: share by size instead.
    w = jnp.where(wsum > 0, w, jnp.where(capped, 0.0, size))
    want = jnp.maximum(free, 0.0) * w / jnp.maximum(jnp.sum(w), _TINY)
    capped = capped | (want >= size)
  want = jnp.where(capped, size, want)
  sizes_i = jnp.asarray(sizes_np, jnp.int32)
  drops = jnp.clip(jnp.floor(want).astype(jnp.int32), 0, sizes_i)
  frac = want - jnp.floor(want)
  # Hand out (or take back, after float rounding) the rest, largest remainders first.
  rem = jnp.int32(total) - jnp.sum(drops)
  order = jnp.argsort(-frac)
  slack = (sizes_i - drops)[order]
  give = jnp.clip(rem - (jnp.cumsum(slack) - slack), 0, slack)
  drops = drops.at[order].add(give)
  order = jnp.argsort(frac)
  have = drops[order]
  take = jnp.clip(-rem - (jnp.cumsum(have) - have), 0, have)
  return drops.at[order].add(-take)


# ----------------------------------------------------------------------------- selection


#: Thresholds counted per pass of :func:`top_mask`'s search (a 4-way search: 16 passes).
_SEARCH_WAYS = 4


def top_mask(x: Array, k: Array) -> Array:
  """Mask of exactly ``k`` (dynamic) entries of flat ``x`` with the largest ``|x|``.

  The ``k``-th largest magnitude is found by a 4-way search on the float32 bit patterns
  (monotone for non-negative floats; no sort): each pass counts the values at or above
  3 thresholds in one variadic reduction, one read of ``x``, and keeps the quarter of
  the range where the count crosses ``k``; 16 passes cover the 31 bits, where a
  bisection takes 31 (separate ``jnp.sum`` calls are separate passes on XLA:CPU;
  ``python -m benchmarks.xla_cpu_pitfalls`` times both). Ties at the threshold are broken by position
  (:func:`jaxcomp._src.sparse.first_trues`). NaNs count as larger than any number.
  """
  bits = lax.bitcast_convert_type(jnp.abs(x.astype(_F32)), jnp.int32)
  ways = _SEARCH_WAYS
  j = jnp.arange(1, ways, dtype=jnp.int32)

  def body(_, carry):
    # Invariant: count(bits >= lo) >= k > count(bits >= hi).
    lo, hi = carry
    span = hi - lo
    t = lo + (span // ways) * j + jnp.minimum(j, span % ways)  # non-decreasing in j
    counts = lax.reduce(tuple((bits >= t[i]).astype(jnp.int32) for i in range(ways - 1)),
                        (jnp.int32(0),) * (ways - 1),
                        lambda a, b: tuple(u + v for u, v in zip(a, b)), (0,))
    m = sum((c >= k).astype(jnp.int32) for c in counts)  # a prefix of the thresholds
    new_lo = jnp.where(m > 0, t[jnp.maximum(m - 1, 0)], lo)
    new_hi = jnp.where(m < ways - 1, t[jnp.minimum(m, ways - 2)], hi)
    return new_lo, new_hi

  # The bounds derive from the data and k so they carry their sharding type (varying
  # under shard_map's check_vma). Each pass leaves at most ceil(span / ways) of the span.
  zero = jnp.sum(bits[:1]) * 0 + jnp.asarray(k, jnp.int32) * 0
  passes = math.ceil(31 / math.log2(ways))
  lo, _ = lax.fori_loop(0, passes, body, (zero, zero + jnp.int32(2**31 - 1)))
  above = bits > lo
  tie = bits == lo
  need = k - jnp.sum(above.astype(jnp.int32))
  return above | sparse.first_trues(tie, need)  # ties by position


def balanced_halves(sizes: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Two groups of layer positions with about equal entry counts (largest first)."""
  groups: tuple[list[int], list[int]] = ([], [])
  totals = [0, 0]
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    j = 0 if totals[0] <= totals[1] else 1
    groups[j].append(i)
    totals[j] += sizes[i]
  return tuple(sorted(groups[0])), tuple(sorted(groups[1]))


# ----------------------------------------------------------------------------- payload


class _Group:
  """Static layout of one exchanged group of layers: sizes, capacities, wire format."""

  def __init__(self, sizes: Sequence[int], drop_rate: float, quantizer,
               outlier_fraction: float = 0.0, min_keep: float = 0.0):
    # A layer drops at most this many (it keeps at least ceil(min_keep · size)).
    self.caps = tuple(int(s) - math.ceil(min_keep * int(s)) for s in sizes)
    self.sizes = tuple(int(s) for s in sizes)
    self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
    self.n = int(self.offsets[-1])
    self.drops = int(round(drop_rate * self.n))
    self.kept = self.n - self.drops
    if self.drops > sum(self.caps):
      raise ValueError(f"min_keep={min_keep} leaves {sum(self.caps)} droppable entries in a "
                       f"group of {self.n}, fewer than the {self.drops} to drop")
    self.quantizer = quantizer
    self.outliers = (min(self.kept, sparse.num_entries(outlier_fraction, self.n))
                     if quantizer and self.kept else 0)
    # Positions as a bitmap of n bits, or as k indices: whichever is smaller.
    idx_bits = 8 * sparse.index_dtype(self.n).itemsize if self.n else 8
    self.bitmap = 32 * -(-self.n // 32) < self.kept * idx_bits
    # The same selection sent as float32: what every device sends when an outlier
    # capacity overflowed anywhere.
    self.exact = _Group(sizes, drop_rate, None, min_keep=min_keep) if quantizer else None

  def select(self, gs: Sequence[Array], keep: Array) -> tuple[list, list]:
    """(flat leaves, masks of their ``keep[i]`` largest magnitudes)."""
    flats = [g.reshape(-1) for g in gs]
    return flats, [top_mask(f, keep[i]) for i, f in enumerate(flats)]

  def encode(self, flats: Sequence[Array], masks: Sequence[Array]) -> tuple[dict, Array]:
    """Payload of the masked entries; (arrays, whether the outlier capacity overflowed)."""
    n, q = self.n, self.quantizer
    flat = jnp.concatenate(flats)
    mask = jnp.concatenate(masks)
    finite = jnp.all(jnp.isfinite(flat))
    arrays, overflow, main = {}, jnp.zeros((), bool), mask
    if q is not None:
      stats, codes, outl = [], [], []
      for f, m in zip(flats, masks):
        mu, sigma = normal.moments(f)  # the layer's distribution; the kept are its tails
        c, o = normal.interval_codes(f, mu, sigma, q.intervals, q.sigmas)
        stats.append(jnp.stack([mu, sigma]))
        codes.append(c)
        outl.append(o & m)
      outl = jnp.concatenate(outl)
      out_idx = sparse.compact(outl, self.outliers)
      out_vals = jnp.where(out_idx < n, flat[jnp.minimum(out_idx, n - 1)], 0.0)
      overflow = jnp.sum(outl, dtype=jnp.int32) > self.outliers
      # Sent exactly: not in the coded list.
      main = mask & ~jnp.zeros((n,), bool).at[out_idx].set(True, mode="drop")
      stats = jnp.stack(stats)
      arrays["stats"] = jnp.where(finite, stats, jnp.nan)
      arrays["outlier_indices"] = out_idx.astype(sparse.index_dtype(n))
      arrays["outlier_values"] = jnp.where(finite, out_vals, jnp.nan)
    pos = sparse.compact(main, self.kept)
    safe = jnp.minimum(pos, n - 1)
    if self.bitmap:
      arrays["bitmap"] = bitpack.pack_bits(main.astype(jnp.uint32), 1)
    else:
      arrays["indices"] = pos.astype(sparse.index_dtype(n))
    if q is not None:
      arrays["codes"] = bitpack.pack_bits(jnp.concatenate(codes)[safe], q.bits)
    else:
      arrays["values"] = jnp.where(finite, jnp.where(pos < n, flat[safe], 0.0), jnp.nan)
    return arrays, overflow

  def entries(self, arrays: dict) -> tuple[Array, Array]:
    """(positions, float32 values) of one payload; padding slots have position n."""
    n, q = self.n, self.quantizer
    if self.bitmap:
      pos = sparse.compact(bitpack.unpack_bits(arrays["bitmap"], 1, n) != 0, self.kept)
    else:
      pos = arrays["indices"].astype(jnp.int32)
    if q is None:
      return pos, arrays["values"]
    codes = bitpack.unpack_bits(arrays["codes"], q.bits, self.kept)
    leaf = jnp.searchsorted(jnp.asarray(self.offsets[1:-1], jnp.int32), pos, side="right")
    stats = arrays["stats"][leaf]
    vals = normal.proxy_values(codes, stats[:, 0], stats[:, 1], q.intervals, q.sigmas)
    out = arrays["outlier_indices"].astype(jnp.int32)
    return (jnp.concatenate([pos, out]),
            jnp.concatenate([jnp.where(pos < n, vals, 0.0), arrays["outlier_values"]]))

  def sum_and_count(self, stacked: dict) -> tuple[Array, Array]:
    """Sum over the K stacked payloads, and how many devices sent each entry."""
    pos, vals = jax.vmap(self.entries)(stacked)
    total = sparse.scatter(self.n, pos, vals)
    count = sparse.scatter(self.n, pos, jnp.ones(pos.shape, _F32))
    return total, count


# ----------------------------------------------------------------------------- transform


class MIPDState(NamedTuple):
  """State of :func:`mipd`: identical on every device (no ``per_device_state`` needed).

  ``prediction`` holds ``ĝ`` (float32, leaf shape) for the compressed leaves and
  ``optax.MaskedNode()`` for the dense ones; it is updated only from the aggregated
  gradient, so every device keeps the same copy.
  """

  count: Array            # shape=(), int32: steps taken (the half update's parity)
  prediction: Any         # ĝ: exponential-smoothing prediction of the mean gradient
  observed: Array         # shape=(compressed leaves,), bool: ĝ_i has been initialised
  nonfinite_count: Array  # shape=(), int32: steps whose gradient had NaN/Inf
  overflow_count: Array   # shape=(), int32: steps whose exact-outlier capacity overflowed
  shapes: treeutil.LeafShapes = None  # static record of init's leaves (no arrays)


def mipd(
    drop_rate: float = 0.5,
    *,
    beta: float = 0.5,
    alpha: float = 0.5,
    intervals: int = 256,
    sigmas: float = 3.0,
    outlier_fraction: float = 0.03,
    half_update: bool = True,
    quantize: bool = True,
    compensate: bool = True,
    min_keep: float = 0.1,
    predict_from: str = "received",
    axis_name: Any = None,
    filter: transforms.FilterFn | None = None,  # pylint: disable=redefined-builtin
) -> optax.GradientTransformation:
  r"""MIPD: layer-wise adaptive drop rates, compensation, half updates, normal quantization.

  Each step, per device, for the compressed leaves (layers) of the exchanged group:

  1. *Drop rates* (§4, eqs. 1–7): ``r_i = β r_i^{MI} + (1 - β) r_i^{ESP}`` where
     ``r^{MI}`` is inversely proportional to the layer's share of the parameter L2 norms
     (important layers drop less) and ``r^{ESP}`` to its share of the prediction-error
     norms ``||g_i - ĝ_i||`` (well-predicted layers drop more). Layer i drops
     ``r_i · s · N`` entries (``s = drop_rate``, ``N`` the group's entries), capped at
     ``(1 - min_keep)`` of its size with the excess handed to the other layers, rounded
     so that exactly ``round(s · N)`` are dropped (:func:`allocate_drops`); it drops its
     smallest magnitudes (a per-layer top-k). The paper caps at the layer's size
     (``min_keep=0``); see the adaptations below for why the default keeps 10%.
  2. *Quantization* (§5, ``quantize=True``): the kept entries of each layer are coded
     with :class:`jaxcomp.codecs.NormalQuantizer`'s intervals for ``N(μ_i, σ_i²)``,
     ``μ_i, σ_i`` the moments of the layer's whole local gradient (the distribution the
     paper models; the kept entries are its tails), values beyond ``μ_i ± 3σ_i`` sent
     exactly.
  3. *Exchange*: every device all-gathers the others' payloads and decodes their sum
     (with ``drop_rate=0`` and ``quantize=False`` the payload is the dense gradient,
     all-reduced with a ``pmean`` instead).
  4. *Global gradient compensation* (§4.2.3, ``compensate=True``): an entry a device
     dropped counts as the prediction ``ĝ`` in the mean:
     ``G_j = (Σ_{d sent j} g_{d,j} + (K - c_j) ĝ_j) / K`` with ``c_j`` the devices that
     sent it (without compensation a dropped entry counts as 0).
  5. *Prediction* (ESP, eqs. 3–5): ``ĝ ← α G_r + (1 - α) ĝ``, ``ĝ ← G_r`` at a layer's
     first exchange (eq. 4), where ``G_r`` is the mean of what was received (dropped
     entries count 0; ``predict_from="received"``) or the compensated mean
     (``predict_from="compensated"``). The paper does not say which. With the
     compensated mean an entry that no device sends keeps its last prediction forever
     (the mean feeds the prediction back to itself), a constant push on it; on the
     demo that cost 1–3 points (``docs/index.md``), so ``"received"`` is the default:
     such an entry's prediction decays by ``1 - α`` per step.
  6. *Half update* (§2.4.3, ``half_update=True``): the compressed layers are split into
     two groups of about equal size; even steps exchange the first, odd steps the
     second, and the other group's update is its prediction ``ĝ``.

  Leaves the filter leaves out (biases, small tensors) are never dropped or quantized:
  a dense ``pmean`` every step, also under the half update.

  Adaptations to synchronous data parallelism (the paper uses an asynchronous
  parameter server):

  * the server's prediction and compensation run identically on every device, from the
    all-gathered payloads; state is the same everywhere and can be replicated;
  * ``r^{ESP}`` uses this device's gradient against the shared prediction, so devices
    may split their kept entries differently over layers; the *total* kept per device
    is the static ``N - round(s · N)``, which is what makes the payload static;
  * the half update alternates groups on the step count instead of the worker pulling
    half of the parameters; both groups' programs are compiled (``lax.cond``) and
    :func:`jaxcomp.wire_report` counts the larger group;
  * proxies are recomputed from ``(μ_i, σ_i)`` (64 bits per layer) instead of sent;
  * positions travel as a bitmap of ``N`` bits when that is smaller than ``k`` indices
    (at 50% kept it is, 16x: the paper does not say how positions are coded);
  * values beyond ``μ_i ± 3σ_i`` travel as (index, float32) pairs in a static capacity
    of ``ceil(outlier_fraction · N)`` slots per group (the demo CNN's gradients have
    1.9–3.1% of their entries beyond 3σ: ``python -m benchmarks.normal_quantizer``);
    when it overflows on any device, every device sends its kept entries as float32
    for that step instead (the same selection, no loss; a 4-byte ``pmax`` picks the
    branch, :func:`jaxcomp.wire_report` lists it as ``fallback_bytes``), and the step is
    counted in ``overflow_count``;
  * ``α`` is not given in the paper: 0.5 by default;
  * every layer keeps at least ``min_keep`` (10%) of its entries each exchange. With the
    paper's cap (a layer may drop all of its entries) the rates, which sum to 1 over the
    layers, hand small layers more drops than they have, and a layer that no device
    sends gets no gradient: its prediction, smoothed from what was received, stays 0.
    On the demo's CNN the 1,280-entry classifier kernel is dropped whole (at
    initialization, and then so often that over 600 steps it moved 0.06 of its norm
    against 1.41 under dense), and MIPD trained 1.08 ± 0.27 points below dense over five
    seeds; ``docs/index.md`` has the runs with ``min_keep=0.1``.

  Args:
    drop_rate: ``s``, the fraction of each exchanged group's entries dropped, in [0, 1).
    beta: ``β``, the weight of the interpretability rate (the paper suggests 0.5).
    alpha: ``α``, the smoothing coefficient of the prediction, in (0, 1].
    intervals: quantization intervals (a power of two; 256 = int8 codes).
    sigmas: quantized range in σ (3: the 3σ rule).
    outlier_fraction: capacity of exactly-sent outliers, as a fraction of the exchanged
      group's entries.
    half_update: exchange half of the compressed layers per step, alternating.
    quantize: code kept entries with the normal quantizer (else float32).
    compensate: fill dropped entries with the prediction (else zero).
    min_keep: the fraction of each compressed layer kept at least, in
      ``[0, 1 - drop_rate]`` (0: the paper's rule, which may drop whole layers).
    predict_from: ``"received"`` or ``"compensated"``: what the prediction smooths.
    axis_name: the mapped axis to average over, or None (one device).
    filter: which leaves are compressed (default :func:`jaxcomp.default_filter`).

  ``update`` needs ``params`` (the interpretability rate reads their norms).

  Example (inside ``jax.shard_map`` over axis ``"b"``; the state is replicated)::

    tx = optax.chain(jc.mipd(0.5, axis_name="b"), optax.sgd(lr, momentum=0.9))

  References:
    MIPD: an adaptive gradient sparsification framework for distributed DNNs training.
    IEEE TPDS 33(11), 2022. doi:10.1109/TPDS.2022.3154387
  """
  if isinstance(drop_rate, bool) or not isinstance(drop_rate, (int, float)) or not (
      0 <= drop_rate < 1):
    raise ValueError(f"drop_rate must be a number in [0, 1), got {drop_rate!r}")
  if not 0 <= min_keep <= 1 - drop_rate:
    raise ValueError(f"min_keep must be in [0, 1 - drop_rate] = [0, {1 - drop_rate}] (the "
                     f"layers must be able to drop drop_rate of the entries), got {min_keep!r}")
  if not 0 <= beta <= 1:
    raise ValueError(f"beta must be in [0, 1], got {beta!r}")
  if not 0 < alpha <= 1:
    raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
  if predict_from not in PREDICT_FROM:
    raise ValueError(f"predict_from must be one of {PREDICT_FROM}, got {predict_from!r}")
  quantizer = normal.NormalQuantizer(intervals, sigmas, outlier_fraction) if quantize else None
  filter_fn = transforms.default_filter if filter is None else filter
  a = float(alpha)

  def selected(leaves):
    return [transforms._selected(filter_fn, p, x) for p, x in leaves]  # pylint: disable=protected-access

  def layout(leaves):
    on = selected(leaves)
    sel = [i for i, o in enumerate(on) if o]
    sizes = [int(np.prod(leaves[i][1].shape)) for i in sel]
    halves = balanced_halves(sizes) if half_update else (tuple(range(len(sel))), ())
    groups = [_Group([sizes[j] for j in h], drop_rate, quantizer, outlier_fraction,
                     min_keep=min_keep) for h in halves]
    return on, sel, halves, groups

  def init_fn(params):
    leaves, treedef = treeutil.flat(params)
    for path, leaf in leaves:
      transforms._check_leaf(path, leaf)  # pylint: disable=protected-access
    on = selected(leaves)
    pred = [jnp.zeros(x.shape, _F32) if o else optax.MaskedNode()
            for (_, x), o in zip(leaves, on)]
    return MIPDState(count=jnp.zeros((), jnp.int32), prediction=treedef.unflatten(pred),
                     observed=jnp.zeros((sum(on),), bool),
                     nonfinite_count=jnp.zeros((), jnp.int32),
                     overflow_count=jnp.zeros((), jnp.int32),
                     shapes=treeutil.LeafShapes.of(params))

  def exchange(group: _Group, members, gs, preds, pnorms, observed):
    """One group's exchange: (mean per member, new prediction per member, overflow)."""
    overflow = jnp.zeros((), bool)
    if not members:
      return [], [], overflow
    g_m = [gs[j] for j in members]
    p_m = [preds[j] for j in members]
    if group.drops == 0 and group.quantizer is None:
      # Nothing dropped, nothing quantized: the payload is linear, so all-reduce it
      # (a ring psum moves 2(K-1)/K of it instead of the all-gather's K-1).
      flat = jnp.concatenate([g.reshape(-1) for g in g_m])
      mean = received = flat if axis_name is None else lax.pmean(flat, axis_name)
    else:
      with jax.named_scope(phases.ENCODE_SCOPE):  # drop rates, selection, quantization
        errs = jnp.stack([jnp.sqrt(jnp.sum(jnp.square(g - p))) for g, p in zip(g_m, p_m)])
        rates = drop_rates(jnp.stack([pnorms[j] for j in members]), errs, beta)
        keep = jnp.asarray(group.sizes, jnp.int32) - allocate_drops(rates, group.caps,
                                                                    group.drops)
        flats, masks = group.select(g_m, keep)
        arrays, overflow = group.encode(flats, masks)

      def total_and_count(layout, payload):
        got = (jax.tree.map(lambda x: x[None], payload) if axis_name is None
               else collectives.gather_tree(payload, axis_name))
        with jax.named_scope(phases.DECODE_SCOPE):
          return layout.sum_and_count(got)

      if group.quantizer is None:
        total, count = total_and_count(group, arrays)
      else:
        if axis_name is not None:  # all devices take the same branch, count the step
          overflow = lax.pmax(overflow.astype(jnp.int32), axis_name) > 0

        def exact(_):
          with jax.named_scope("jaxcomp_fallback"):
            return total_and_count(group.exact, group.exact.encode(flats, masks)[0])

        total, count = lax.cond(overflow, exact,
                                lambda _: total_and_count(group, arrays), None)
      k = 1 if axis_name is None else collectives.axis_size(axis_name)
      with jax.named_scope(phases.DECODE_SCOPE):  # averaging and compensation
        p_flat = jnp.concatenate([p.reshape(-1) for p in p_m])
        received = total / k
        mean = (total + (k - count) * p_flat) / k if compensate else received
    means, new_p = [], []
    for pos, j in enumerate(members):
      lo, hi = int(group.offsets[pos]), int(group.offsets[pos + 1])
      m = mean[lo:hi].reshape(gs[j].shape)
      obs = m if predict_from == "compensated" else received[lo:hi].reshape(gs[j].shape)
      means.append(m)
      new_p.append(jnp.where(observed[j], a * obs + (1 - a) * preds[j], obs))
    if axis_name is not None:  # the same in both half-update branches
      overflow = collectives.any_over_other_axes(overflow, axis_name)
    return means, new_p, overflow

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("jc.mipd needs params: call tx.update(grads, state, params) "
                       "(the interpretability drop rate reads the parameters' norms)")
    leaves, treedef = treeutil.flat(updates)
    for path, g in leaves:
      transforms._check_leaf(path, g)  # pylint: disable=protected-access
    if state.shapes is not None:
      state.shapes.check(updates, "jc.mipd")
    on, sel, halves, groups = layout(leaves)
    p_leaves = treedef.flatten_up_to(params)
    preds_all = treedef.flatten_up_to(state.prediction)
    gs = [leaves[i][1].astype(_F32) for i in sel]
    preds = [preds_all[i] for i in sel]
    pnorms = [jnp.sqrt(jnp.sum(jnp.square(p_leaves[i].astype(_F32)))) for i in sel]
    if axis_name is not None and collectives.tracks_varying(axis_name):
      for i in sel:
        if axis_name not in collectives.varying_axes(leaves[i][1]):
          raise ValueError(
              f"the gradient at {jax.tree_util.keystr(leaves[i][0])} is already "
              f"replicated over axis {axis_name!r}: differentiate with respect to "
              f"jc.vary(params, {axis_name!r}) to get the local gradient.")
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in gs])) if gs else (
        jnp.ones((), bool))
    parity = state.count % 2
    off = [g for (_, g), o in zip(leaves, on) if not o]
    if axis_name is not None:
      # One all-reduce for everything the devices must agree on before the exchange:
      # the leaves MIPD leaves out (averaged in full precision), whether any device's
      # gradient is non-finite (skip the state update on every device alike), and the
      # half-update parity (held in per-device state, typed varying under shard_map:
      # every device must take the same branch).
      sync_parity = bool(half_update and sel and collectives.tracks_varying(axis_name)
                         and axis_name in collectives.varying_axes(parity))
      flags = ([~finite] if gs else []) + ([parity] if sync_parity else [])
      off, sums = collectives.pmean_and_count(off, flags, axis_name)
      if gs:
        finite = sums.pop(0) == 0  # no device had a non-finite gradient
      if sync_parity:
        parity = sums.pop(0) // collectives.axis_size(axis_name)
      # The shards of a tensor-parallel group skip together.
      finite = ~collectives.any_over_other_axes(~finite, axis_name)

    def step(active):
      means, new_p, overflow = exchange(groups[active], halves[active], gs, preds, pnorms,
                                        state.observed)
      outs, preds_out = list(preds), list(preds)
      for pos, j in enumerate(halves[active]):
        outs[j], preds_out[j] = means[pos], new_p[pos]
      seen = state.observed.at[jnp.asarray(halves[active], jnp.int32)].set(True) if (
          halves[active]) else state.observed
      return outs, preds_out, seen, overflow

    if half_update and sel:
      outs, new_preds, seen, overflow = lax.cond(parity == 1, lambda: step(1),
                                                 lambda: step(0))
    elif sel:
      outs, new_preds, seen, overflow = step(0)
    else:
      outs, new_preds, seen, overflow = [], [], state.observed, jnp.zeros((), bool)
    new_preds = [jnp.where(finite, n, p) for n, p in zip(new_preds, preds)]
    result, pred_tree = [], list(preds_all)
    pos = {i: j for j, i in enumerate(sel)}
    off = iter(off)
    for i, ((_, g), o) in enumerate(zip(leaves, on)):
      if o:
        # The half update sends the other group's prediction in place of its mean: a
        # non-finite step (agreed above) must still give a non-finite mean everywhere.
        result.append(treeutil.mark_nonfinite(outs[pos[i]].astype(g.dtype), finite))
        pred_tree[i] = new_preds[pos[i]]
      else:
        result.append(next(off))
    new_state = MIPDState(
        count=state.count + 1, prediction=treedef.unflatten(pred_tree),
        observed=jnp.where(finite, seen, state.observed),
        nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
        overflow_count=state.overflow_count + overflow.astype(jnp.int32),
        shapes=state.shapes)
    return treedef.unflatten(result), new_state

  return optax.GradientTransformation(init_fn, update_fn)
