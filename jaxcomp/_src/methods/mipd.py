r"""MIPD (TPDS 2022): layer-wise adaptive sparsification, compensation, half updates.

The paper's system runs on an asynchronous parameter server. jaxcomp runs it
synchronously inside collectives, either all-gathering every device's sparse, quantized
payload, or as a parameter server sharded over the devices (push with ``all_to_all``,
pull with ``all_gather``). Either way every device decodes the same aggregate, so the
server's state (the exponential-smoothing prediction) is kept, identically, on every
device. What departs from the paper, and why, is listed in ``docs/methods/mipd.md``.

The method is written as named steps over a frozen :class:`_Options`: ``_layout``
(the static groups), ``_sync`` (the all-reduce every device agrees on first),
``_select_and_code`` (drop rates, per-layer top-k, quantization: a :class:`_Coded`),
the exchange (:mod:`jaxcomp._src.exchanges.mipd_exchange`), ``_predict`` (the server's
prediction), wired by ``_half_step`` and ``_update``.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import functools
import math
from typing import Any
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src.codecs import normal
from jaxcomp._src.codecs import sparse
from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import mipd_exchange
from jaxcomp._src.exchanges import pipeline
from jaxcomp._src.methods import transforms
from jaxcomp._src.plumbing import phases
from jaxcomp._src.plumbing import treeutil

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
  return beta * inverse_share_rates(param_norms) + (1.0 - beta) * inverse_share_rates(error_norms)


def allocate_drops(rates: Array, sizes: Sequence[int], total: int) -> Array:
  """Integer drops per layer: ``≈ rates_i · total``, at most ``sizes_i``, summing to ``total``.

  Layers whose share exceeds their size are capped and their excess is handed to the
  others in proportion to their rates (water-filling, at most one round per layer);
  the fractional parts are then rounded so the sum is exactly ``total``: one more drop
  each for the layers with the largest remainders. ``total`` must not exceed
  ``sum(sizes)``.
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

  # Hand out the rest one per layer, largest remainders first (the rest is below the
  # number of layers but for float rounding; that excess then fills the slack in the
  # same order); a negative rest (float rounding) is taken back alike, smallest first.
  def spread(rem, order, room):
    out = jnp.zeros_like(room)
    for cap in (jnp.minimum(room, 1), room):  # one each, then as much as fits
      step = (cap - out)[order]
      part = jnp.clip(rem - (jnp.cumsum(step) - step), 0, step)
      out = out.at[order].add(part)
      rem = rem - jnp.sum(part)
    return out

  rem = jnp.int32(total) - jnp.sum(drops)
  drops = drops + spread(jnp.maximum(rem, 0), jnp.argsort(-frac), sizes_i - drops)
  return drops - spread(jnp.maximum(-rem, 0), jnp.argsort(frac), drops)


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
  the XLA:CPU table of ``docs/benchmarks.md`` times both). Ties at the threshold are broken
  by position (:func:`jaxcomp._src.codecs.sparse.first_trues`). NaNs count as larger than any
  number.
  """
  bits = lax.bitcast_convert_type(jnp.abs(x.astype(_F32)), jnp.int32)
  ways = _SEARCH_WAYS
  j = jnp.arange(1, ways, dtype=jnp.int32)

  def body(_, carry):
    # Invariant: count(bits >= lo) >= k > count(bits >= hi).
    lo, hi = carry
    span = hi - lo
    t = lo + (span // ways) * j + jnp.minimum(j, span % ways)  # non-decreasing in j
    counts = lax.reduce(
      tuple((bits >= t[i]).astype(jnp.int32) for i in range(ways - 1)),
      (jnp.int32(0),) * (ways - 1),
      lambda a, b: tuple(u + v for u, v in zip(a, b)),
      (0,),
    )
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


# Re-exported from the exchange module (the tests and studies read them here).
_Coded = mipd_exchange._Coded  # pylint: disable=protected-access
_Format = mipd_exchange._Format  # pylint: disable=protected-access
_Owners = mipd_exchange._Owners  # pylint: disable=protected-access
_capacity = mipd_exchange._capacity  # pylint: disable=protected-access
_layer_codes = mipd_exchange._layer_codes  # pylint: disable=protected-access
owner_index = mipd_exchange.owner_index


# ----------------------------------------------------------------------------- groups


class _Group:
  """Static layout of one exchanged group of layers: sizes, drops, all-gather formats."""

  def __init__(
    self,
    sizes: Sequence[int],
    drop_rate: float,
    quantizer,
    outlier_fraction: float = 0.0,
    min_keep: float = 0.0,
  ):
    # A layer drops at most this many (it keeps at least ceil(min_keep · size)).
    self.caps = tuple(int(s) - math.ceil(min_keep * int(s)) for s in sizes)
    self.sizes = tuple(int(s) for s in sizes)
    self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
    self.n = int(self.offsets[-1])
    self.drops = int(round(drop_rate * self.n))
    self.kept = self.n - self.drops
    if self.drops > sum(self.caps):
      raise ValueError(
        f"min_keep={min_keep} leaves {sum(self.caps)} droppable entries in a "
        f"group of {self.n}, fewer than the {self.drops} to drop"
      )
    self.quantizer = quantizer
    self.outlier_fraction = outlier_fraction
    outliers = (
      min(self.kept, sparse.num_entries(outlier_fraction, self.n)) if quantizer and self.kept else 0
    )
    dense = self.drops == 0
    self.fmt = _Format(self.sizes, self.kept, outliers, quantizer, dense)
    # The same selection sent as float32: what every device sends when a capacity
    # overflowed anywhere.
    self.exact = _Format(self.sizes, self.kept, 0, None, dense) if quantizer else self.fmt

  def select(self, gs: Sequence[Array], keep: Array) -> tuple[list, list]:
    """(flat leaves, masks of their ``keep[i]`` largest magnitudes)."""
    flats = [g.reshape(-1) for g in gs]
    return flats, [top_mask(f, keep[i]) for i, f in enumerate(flats)]

  def code(self, flats: Sequence[Array], masks: Sequence[Array]) -> _Coded:
    """The group's flat values, mask, and (quantized) codes, outliers and stats."""
    return mipd_exchange.code(flats, masks, self.quantizer)


# ----------------------------------------------------------------------------- state


class MIPDState(NamedTuple):
  """State of :func:`mipd`: identical on every device (no ``per_device_state`` needed).

  ``prediction`` holds ``ĝ`` (float32, leaf shape) for the compressed leaves and
  ``optax.MaskedNode()`` for the dense ones; it is updated only from what every device
  decodes alike (the all-gathered payloads, or the two-phase pull), so every device
  keeps the same copy.
  """

  count: Array  # shape=(), int32: steps taken (the half update's parity)
  prediction: Any  # ĝ: exponential-smoothing prediction of the mean gradient
  observed: Array  # shape=(compressed leaves,), bool: ĝ_i has been initialised
  nonfinite_count: Array  # shape=(), int32: steps whose gradient had NaN/Inf
  overflow_count: Array  # shape=(), int32: steps that took an exact fallback exchange
  shapes: treeutil.LeafShapes = None  # static record of init's leaves (no arrays)


COLLECTIVES = ("auto", "allgather", "two_phase")


# ----------------------------------------------------------------------------- options


def _check_options(drop_rate, min_keep, beta, alpha, predict_from, collective, quantize_pull):
  """Every argument check of :func:`mipd`, in one place."""
  if (
    isinstance(drop_rate, bool)
    or not isinstance(drop_rate, (int, float))
    or not (0 <= drop_rate < 1)
  ):
    raise ValueError(f"drop_rate must be a number in [0, 1), got {drop_rate!r}")
  if not 0 <= min_keep <= 1 - drop_rate:
    raise ValueError(
      f"min_keep must be in [0, 1 - drop_rate] = [0, {1 - drop_rate}] (the "
      f"layers must be able to drop drop_rate of the entries), got {min_keep!r}"
    )
  if not 0 <= beta <= 1:
    raise ValueError(f"beta must be in [0, 1], got {beta!r}")
  if not 0 < alpha <= 1:
    raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
  if predict_from not in PREDICT_FROM:
    raise ValueError(f"predict_from must be one of {PREDICT_FROM}, got {predict_from!r}")
  pipeline.refuse_reduce_scatter(collective, "jc.mipd", pipeline.MIPD_NO_REDUCE_SCATTER)
  if collective not in COLLECTIVES:
    raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
  if quantize_pull is not None and not isinstance(quantize_pull, bool):
    raise TypeError(f"quantize_pull must be a bool or None, got {quantize_pull!r}")


@dataclasses.dataclass(frozen=True)
class _Options:
  """The options of :func:`mipd`, checked and resolved."""

  drop_rate: float
  beta: float
  alpha: float
  min_keep: float
  outlier_fraction: float
  quantizer: normal.NormalQuantizer | None  # the push's codes (None: float32)
  pull_quantizer: normal.NormalQuantizer | None  # the two-phase pull's codes
  pulled: int  # vectors the two-phase pull carries (G, and G_r when both are needed)
  half_update: bool
  compensate: bool
  predict_from: str
  collective: str
  axis_name: Any
  filter_fn: transforms.FilterFn


class _Layout(NamedTuple):
  """The static split of a gradient's leaves into MIPD's groups."""

  on: list  # per leaf: compressed (selected by the filter)
  sel: list  # the compressed leaves' positions
  halves: tuple  # two tuples of positions in sel (the second empty without half updates)
  groups: list  # the _Group of each half


# ----------------------------------------------------------------------------- steps


def _selected(opts: _Options, leaves) -> list:
  return [treeutil.selected(opts.filter_fn, p, x) for p, x in leaves]


def _layout(opts: _Options, leaves) -> _Layout:
  """The compressed leaves, their halves and each half's static group."""
  on = _selected(opts, leaves)
  sel = [i for i, o in enumerate(on) if o]
  sizes = [int(np.prod(leaves[i][1].shape)) for i in sel]
  halves = balanced_halves(sizes) if opts.half_update else (tuple(range(len(sel))), ())
  groups = [
    _Group(
      [sizes[j] for j in h],
      opts.drop_rate,
      opts.quantizer,
      opts.outlier_fraction,
      min_keep=opts.min_keep,
    )
    for h in halves
  ]
  return _Layout(on, sel, halves, groups)


def _init(opts: _Options, params) -> MIPDState:
  """A zero prediction for every compressed leaf, nothing observed yet."""
  leaves, treedef = treeutil.flat(params)
  for path, leaf in leaves:
    treeutil.check_leaf(path, leaf)
  on = _selected(opts, leaves)
  rule = pipeline.filter_rule(opts.filter_fn, transforms.default_filter)
  pipeline.warn_if_nothing_compressed("jc.mipd", on, rule)
  pred = [jnp.zeros(x.shape, _F32) if o else optax.MaskedNode() for (_, x), o in zip(leaves, on)]
  return MIPDState(
    count=jnp.zeros((), jnp.int32),
    prediction=treedef.unflatten(pred),
    observed=jnp.zeros((sum(on),), bool),
    nonfinite_count=jnp.zeros((), jnp.int32),
    overflow_count=jnp.zeros((), jnp.int32),
    shapes=treeutil.LeafShapes.of(params),
  )


def _check_local(opts: _Options, leaves, sel) -> None:
  """Under shard_map, the compressed gradients must be local (varying over the axis)."""
  axis_name = opts.axis_name
  if axis_name is None or not collectives.tracks_varying(axis_name):
    return
  for i in sel:
    if axis_name not in collectives.varying_axes(leaves[i][1]):
      raise ValueError(
        f"the gradient at {jax.tree_util.keystr(leaves[i][0])} is already "
        f"replicated over axis {axis_name!r}: differentiate with respect to "
        f"jc.vary(params, {axis_name!r}) to get the local gradient."
      )


def _sync(opts: _Options, leaves, lay: _Layout, gs, parity):
  """(dense leaves averaged, finite everywhere, the shared parity).

  One all-reduce for everything the devices must agree on before the exchange: the
  leaves MIPD leaves out (averaged in full precision), whether any device's gradient is
  non-finite (skip the state update on every device alike), and the half-update parity
  (held in per-device state, typed varying under shard_map: every device must take the
  same branch).
  """
  axis_name = opts.axis_name
  finite = (
    jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in gs])) if gs else (jnp.ones((), bool))
  )
  off = [g for (_, g), o in zip(leaves, lay.on) if not o]
  if axis_name is None:
    return off, finite, parity
  sync_parity = bool(
    opts.half_update
    and lay.sel
    and collectives.tracks_varying(axis_name)
    and axis_name in collectives.varying_axes(parity)
  )
  flags = ([~finite] if gs else []) + ([parity] if sync_parity else [])
  off, sums = collectives.dense_means(off, axis_name, counts=flags)
  if gs:
    finite = sums.pop(0) == 0  # no device had a non-finite gradient
  if sync_parity:
    parity = sums.pop(0) // collectives.axis_size(axis_name)
  # The shards of a tensor-parallel group skip together.
  finite = ~collectives.any_over_other_axes(~finite, axis_name)
  return off, finite, parity


def _select_and_code(opts: _Options, group: _Group, g_m, p_m, pnorms) -> _Coded:
  """Drop rates (eq. 7) from the parameter and prediction-error norms, each layer's
  ``keep`` largest magnitudes, and their codes."""
  with jax.named_scope(phases.ENCODE_SCOPE):
    errs = jnp.stack([jnp.sqrt(jnp.sum(jnp.square(g - p))) for g, p in zip(g_m, p_m)])
    rates = drop_rates(jnp.stack(pnorms), errs, opts.beta)
    keep = jnp.asarray(group.sizes, jnp.int32) - allocate_drops(rates, group.caps, group.drops)
    return group.code(*group.select(g_m, keep))


def _predict(opts: _Options, group: _Group, members, mean, received, gs, preds, observed):
  """Per member: its mean (leaf shape) and its new prediction (ESP, eqs. 3–5)."""
  a = opts.alpha
  means_out, new_p = [], []
  for pos, j in enumerate(members):
    lo, hi = int(group.offsets[pos]), int(group.offsets[pos + 1])
    m = mean[lo:hi].reshape(gs[j].shape)
    obs = m if opts.predict_from == "compensated" else received[lo:hi].reshape(gs[j].shape)
    means_out.append(m)
    new_p.append(jnp.where(observed[j], a * obs + (1 - a) * preds[j], obs))
  return means_out, new_p


def _exchange_group(opts: _Options, group: _Group, members, gs, preds, pnorms, observed):
  """One group's exchange: (mean per member, new prediction per member, overflow)."""
  axis_name = opts.axis_name
  overflow = jnp.zeros((), bool)
  if not members:
    return [], [], overflow
  g_m = [gs[j] for j in members]
  p_m = [preds[j] for j in members]
  if group.drops == 0 and group.quantizer is None:
    # Nothing dropped, nothing quantized: the payload is linear, so all-reduce it
    # (a ring psum moves 2(K-1)/K of it instead of the all-gather's K-1).
    flat = jnp.concatenate([g.reshape(-1) for g in g_m])
    mean = received = (
      flat if axis_name is None else collectives.dense_means([flat], axis_name)[0][0]
    )
  else:
    coded = _select_and_code(opts, group, g_m, p_m, [pnorms[j] for j in members])
    p_flat = jnp.concatenate([p.reshape(-1) for p in p_m])
    owners = mipd_exchange.plan(
      group,
      collective=opts.collective,
      axis_name=axis_name,
      pull_quantizer=opts.pull_quantizer,
      vectors=opts.pulled,
    )
    mean, received, overflow = mipd_exchange.exchange(
      group, coded, p_flat, owners=owners, axis_name=axis_name, compensate=opts.compensate
    )
  means_out, new_p = _predict(opts, group, members, mean, received, gs, preds, observed)
  if axis_name is not None:  # the same in both half-update branches
    overflow = collectives.any_over_other_axes(overflow, axis_name)
  return means_out, new_p, overflow


def _half_step(opts: _Options, lay: _Layout, gs, preds, pnorms, observed, active: int):
  """Exchange group ``active``; the other group's update is its prediction."""
  members = lay.halves[active]
  means, new_p, overflow = _exchange_group(
    opts, lay.groups[active], members, gs, preds, pnorms, observed
  )
  outs, preds_out = list(preds), list(preds)
  for pos, j in enumerate(members):
    outs[j], preds_out[j] = means[pos], new_p[pos]
  seen = observed.at[jnp.asarray(members, jnp.int32)].set(True) if members else observed
  return outs, preds_out, seen, overflow


def _update(opts: _Options, updates, state: MIPDState, params):
  """One MIPD step: agree, exchange this step's group, update the prediction."""
  if params is None:
    raise ValueError(
      "jc.mipd needs params: call tx.update(grads, state, params) "
      "(the interpretability drop rate reads the parameters' norms)"
    )
  leaves, treedef = pipeline.open_update(updates, state.shapes, "jc.mipd")
  lay = _layout(opts, leaves)
  sel = lay.sel
  p_leaves = treedef.flatten_up_to(params)
  preds_all = treedef.flatten_up_to(state.prediction)
  gs = [leaves[i][1].astype(_F32) for i in sel]
  preds = [preds_all[i] for i in sel]
  pnorms = [jnp.sqrt(jnp.sum(jnp.square(p_leaves[i].astype(_F32)))) for i in sel]
  _check_local(opts, leaves, sel)
  off, finite, parity = _sync(opts, leaves, lay, gs, state.count % 2)
  step = functools.partial(_half_step, opts, lay, gs, preds, pnorms, state.observed)
  if opts.half_update and sel:
    outs, new_preds, seen, overflow = lax.cond(parity == 1, lambda: step(1), lambda: step(0))
  elif sel:
    outs, new_preds, seen, overflow = step(0)
  else:
    outs, new_preds, seen, overflow = [], [], state.observed, jnp.zeros((), bool)
  new_preds = [jnp.where(finite, n, p) for n, p in zip(new_preds, preds)]
  result, pred_tree = [], list(preds_all)
  pos = {i: j for j, i in enumerate(sel)}
  off = iter(off)
  for i, ((_, g), o) in enumerate(zip(leaves, lay.on)):
    if o:
      # The half update sends the other group's prediction in place of its mean: a
      # non-finite step (agreed above) must still give a non-finite mean everywhere.
      result.append(treeutil.mark_nonfinite(outs[pos[i]].astype(g.dtype), finite))
      pred_tree[i] = new_preds[pos[i]]
    else:
      result.append(next(off))
  new_state = MIPDState(
    count=state.count + 1,
    prediction=treedef.unflatten(pred_tree),
    observed=jnp.where(finite, seen, state.observed),
    nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
    overflow_count=state.overflow_count + overflow.astype(jnp.int32),
    shapes=state.shapes,
  )
  return treedef.unflatten(result), new_state


# ----------------------------------------------------------------------------- transform


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
  quantize_pull: bool | None = None,
  compensate: bool = True,
  min_keep: float = 0.1,
  predict_from: str = "received",
  collective: str = "auto",
  axis_name: Any = transforms.AXIS_REQUIRED,
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
  3. *Exchange* (``collective``, below): the sum over the devices of the kept entries,
     and how many devices sent each entry, ``c_j``.
  4. *Global gradient compensation* (§4.2.3, ``compensate=True``): an entry a device
     dropped counts as the prediction ``ĝ`` in the mean:
     ``G_j = (Σ_{d sent j} g_{d,j} + (K - c_j) ĝ_j) / K`` (without compensation a
     dropped entry counts as 0).
  5. *Prediction* (ESP, eqs. 3–5): ``ĝ ← α G_r + (1 - α) ĝ``, ``ĝ ← G_r`` at a layer's
     first exchange (eq. 4), where ``G_r`` is the mean of what was received (dropped
     entries count 0; ``predict_from="received"``) or the compensated mean
     (``predict_from="compensated"``). The paper does not say which. With the
     compensated mean an entry that no device sends keeps its last prediction forever
     (the mean feeds the prediction back to itself), a constant push on it, which cost
     accuracy on the demo (``docs/methods/mipd.md``), so ``"received"`` is the default:
     such an entry's prediction decays by ``1 - α`` per step.
  6. *Half update* (§2.4.3, ``half_update=True``): the compressed layers are split into
     two groups of about equal size; even steps exchange the first, odd steps the
     second, and the other group's update is its prediction ``ĝ``.

  Leaves the filter leaves out (biases, small tensors) are never dropped or quantized:
  a dense ``pmean`` every step, also under the half update.

  **Exchange.** ``collective="allgather"``: every device all-gathers every device's
  payload (positions, codes, ``(μ_i, σ_i)``, outliers) and decodes the sums and counts;
  ``(K-1)·B`` bytes received per device, growing with K. ``"two_phase"``: the paper's
  parameter server, sharded over the devices. Every device owns a fixed random
  ``1/K`` of each layer's entries (:func:`owner_index`). *Push*: an ``all_to_all``
  sends owner j the kept entries of its share, coded as above against the sender's
  ``(μ_i, σ_i)``; owner j sums them, counts ``c_j`` and computes ``G`` (and ``G_r``) on
  its share with the shared prediction. *Pull*: the owners' shares of ``G`` (and of
  ``G_r`` when the prediction smooths it, which needs both) are coded with the normal
  quantizer against each layer share's own ``(μ, σ)`` (``quantize_pull``; values beyond
  ``3σ`` exactly) and all-gathered; every device decodes the same values, so the
  prediction stays identical everywhere. Bytes received per device are about
  ``(K-1)/K · (B_push + K · v · B_pull)`` with ``B_push`` and ``B_pull`` of order
  ``N/K`` each (``v`` vectors pulled): flat in K. ``"auto"``: whichever of the two
  moves fewer bytes by these formulas (with the defaults, the all-gather at K <= 3, and
  at K = 4 for small models).
  With ``drop_rate=0`` and ``quantize=False`` the group is all-reduced with a
  ``pmean`` instead, under either.

  The push's payloads are static, so each owner gets a fixed capacity; how many of a
  device's ``N - round(s·N)`` kept entries fall in one owner's share is data-dependent.
  The shares are random so that, whatever the structure of the kept set, that count is
  a sum of hypergeometric counts with mean ``kept / K``; the capacity is that mean plus
  the Hoeffding/Bernstein margin that makes an overflow anywhere (K senders × K owners,
  kept entries and exact outliers) less likely than ``1e-6`` per step
  (:func:`_capacity`). The worst case (a capacity overflowed on some device: adversarial
  data, or the all-gather's own outlier capacity overflowing): that step every device
  all-gathers its kept entries as float32 instead (the same selection, nothing lost or
  biased), decided by a 4-byte ``pmax``; likewise a pull whose outliers overflow is
  all-gathered as float32. Both are counted in ``overflow_count`` and listed by
  :func:`jaxcomp.wire_report` as ``fallback_bytes``.

  Adaptations to synchronous data parallelism (the paper uses an asynchronous parameter
  server) and the other departures, each with its reason, are listed in
  ``docs/methods/mipd.md`` ("What is exactly the paper, and what departs"). Among them:
  every layer keeps at least ``min_keep`` (10%) of its entries each exchange (the
  paper's cap lets small layers drop whole, and a layer no device sends gets no
  gradient), and ``α`` (not given in the paper) is 0.5 by default.

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
    quantize_pull: code the two-phase pull with the normal quantizer (None: as
      ``quantize``). With ``False`` the pull is float32 and ``"two_phase"`` gives the
      all-gather's result up to the order of float32 additions.
    compensate: fill dropped entries with the prediction (else zero).
    min_keep: the fraction of each compressed layer kept at least, in
      ``[0, 1 - drop_rate]`` (0: the paper's rule, which may drop whole layers).
    predict_from: ``"received"`` or ``"compensated"``: what the prediction smooths.
    collective: ``"auto"``, ``"allgather"`` or ``"two_phase"`` (above).
    axis_name: the mapped axis to average over (required), or ``None``: the explicit
      one-device simulation, which exchanges nothing.
    filter: which leaves are compressed (default :func:`jaxcomp.default_filter`).

  Returns:
    An ``optax.GradientTransformation``; its ``update`` needs ``params`` (the
    interpretability rate reads their norms). The state (:class:`MIPDState`) is the
    same on every device and stays replicated (``jc.per_device_state`` returns the
    transform unchanged).

  Example (inside ``jax.shard_map`` over axis ``"b"``; the state is replicated)::

    tx = optax.chain(jc.mipd(0.5, axis_name="b"), optax.sgd(lr, momentum=0.9))

  References:
    MIPD: an adaptive gradient sparsification framework for distributed DNNs training.
    IEEE TPDS 33(11), 2022. doi:10.1109/TPDS.2022.3154387
  """
  transforms.require_axis_name(axis_name, "jc.mipd")
  _check_options(drop_rate, min_keep, beta, alpha, predict_from, collective, quantize_pull)
  normal_q = normal.NormalQuantizer(intervals, sigmas, outlier_fraction)
  opts = _Options(
    drop_rate=drop_rate,
    beta=beta,
    alpha=float(alpha),
    min_keep=min_keep,
    outlier_fraction=outlier_fraction,
    quantizer=normal_q if quantize else None,
    pull_quantizer=normal_q if (quantize if quantize_pull is None else quantize_pull) else None,
    # The prediction smooths the received mean, the update is the compensated one: with
    # both, the pull carries both.
    pulled=2 if (compensate and predict_from == "received") else 1,
    half_update=half_update,
    compensate=compensate,
    predict_from=predict_from,
    collective=collective,
    axis_name=axis_name,
    filter_fn=transforms.default_filter if filter is None else filter,
  )

  def init_fn(params):
    return _init(opts, params)

  def update_fn(updates, state, params=None):
    return _update(opts, updates, state, params)

  tx = transforms.places_own_state(optax.GradientTransformation(init_fn, update_fn))
  why = (
    "its per-layer drop rates, predictions and kept entries are chosen over each "
    "whole layer from state that is the same on every device; not implemented yet"
  )
  return transforms.register_exchange(tx, "jc.mipd", axis_name, collective=None, shardable=why)
