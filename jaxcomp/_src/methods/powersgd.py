"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019) as an optax transform.

Written in the paper's steps (Algorithm 1), each a module-level function over a frozen
:class:`_Options`: ``_compute_p`` (``M = g + e``, ``P = M Q``), ``_all_reduce_p``,
``_compute_q`` (``P̂ = orth(P)``, ``Q = Mᵀ P̂``), ``_all_reduce_q``, ``_decompress``
(``P̂ Q̄ᵀ``, the warm start and the error feedback), wired by ``_update``. The same
steps, on blocks of each matrix's rows, make PowerSGD's own schedule under
:func:`jaxcomp.two_level` (``_two_level``, wired by ``_two_level_update``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import hierarchy
from jaxcomp._src.exchanges import pipeline
from jaxcomp._src.methods import transforms
from jaxcomp._src.methods import two_level as two_level_lib
from jaxcomp._src.plumbing import phases
from jaxcomp._src.plumbing import treeutil

Array = jax.Array
_F32 = jnp.float32
MATRIX_VIEWS = ("last", "first")


class PowerSGDState(NamedTuple):
  """State of :func:`powersgd`, all of it held per device (:func:`per_device_state`).

  ``q`` and ``residual`` are pytrees shaped like the parameters, with an array for each
  compressed leaf and ``optax.MaskedNode()`` elsewhere (``q`` only with ``warm_start``,
  ``residual`` only with ``error_feedback``). ``key`` and ``q`` hold the same values on
  every device; ``residual`` differs between devices.
  """

  key: Array  # typed PRNG key, shape=(), the same on every device
  q: Any  # last step's aggregated Q, shape=(n, r), dtype=float32
  residual: Any  # error feedback e, leaf shape, dtype=float32
  nonfinite_count: Array  # shape=(), dtype=int32: steps whose input had NaN/Inf here
  shapes: treeutil.LeafShapes = None  # static record of init's leaves (no arrays)


class _Plan(NamedTuple):
  rows: int  # m: the matrix view is (m, n)
  cols: int  # n
  rank: int  # r = min(rank, m, n)


def _matrix_view(shape: tuple, view: str) -> tuple[int, int] | None:
  """The (m, n) matrix a leaf of ``shape`` is compressed as; None for scalars/vectors."""
  if len(shape) < 2:
    return None
  if view == "last":  # (..., in, out) kernels of flax/haiku: the outputs are the columns
    return math.prod(shape[:-1]), shape[-1]
  return shape[0], math.prod(shape[1:])  # (out, in, ...) kernels, as in PyTorch


def _plan(filter_fn, path, leaf, rank: int, min_compression: float, view: str) -> _Plan | None:
  """How a leaf is compressed, or None when it is averaged dense.

  A matrix is worth compressing when its ``m·n`` values are at least ``min_compression``
  times the ``r·(m+n)`` values of P and Q (the PyTorch hook's rule; there a strict ``>``).
  """
  mn = _matrix_view(tuple(leaf.shape), view)
  if mn is None:
    return None
  if not treeutil.selected(filter_fn, path, leaf):
    return None
  m, n = mn
  r = min(rank, m, n)
  if r < 1 or m * n < min_compression * r * (m + n):
    return None
  return _Plan(m, n, r)


def _orthonormal(a: Array) -> Array:
  """An orthonormal basis of ``a``'s column space, as many columns as ``a``.

  Householder QR: the columns are orthonormal to rounding whatever ``a``'s conditioning,
  and a rank-deficient or zero ``a`` gets orthonormal completion columns (no division by
  a vanishing norm, no NaN); a NaN/Inf in ``a`` propagates. Gram-Schmidt as in the
  paper spans the same subspaces column by column (the same ``P̂`` up to the columns'
  signs, which cancel in ``P̂ Qᵀ``), but needs a guard for zero columns.
  """
  return jnp.linalg.qr(a, mode="reduced")[0]


def _match_varying(new: Array, old: Array) -> Array:
  """``new`` typed varying over the mesh axes ``old`` is (state keeps its types)."""
  extra = tuple(sorted(collectives.varying_axes(old) - collectives.varying_axes(new)))
  return lax.pcast(new, extra, to="varying") if extra else new


def _all_finite(x: Array) -> Array:
  return jnp.all(jnp.isfinite(x))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _check_options(rank, min_compression, matrix_view) -> None:
  """Every argument check of :func:`powersgd`, in one place."""
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"rank must be a positive integer, got {rank!r}")
  if (
    isinstance(min_compression, bool)
    or not isinstance(min_compression, (int, float))
    or (not min_compression >= 0 or math.isinf(min_compression))
  ):
    raise ValueError(f"min_compression must be a finite number >= 0, got {min_compression!r}")
  if matrix_view not in MATRIX_VIEWS:
    raise ValueError(f"matrix_view must be one of {MATRIX_VIEWS}, got {matrix_view!r}")


@dataclasses.dataclass(frozen=True)
class _Options:
  """The options of :func:`powersgd`, checked."""

  rank: int
  error_feedback: bool
  warm_start: bool
  min_compression: float
  matrix_view: str
  seed: int
  axis_name: Any
  filter_fn: transforms.FilterFn

  def plan(self, path, leaf) -> _Plan | None:
    return _plan(self.filter_fn, path, leaf, self.rank, self.min_compression, self.matrix_view)

  def num_devices(self) -> int:
    return 1 if self.axis_name is None else collectives.axis_size(self.axis_name)


# ----------------------------------------------------------------------------- steps


def _init(opts: _Options, params, blocks: int = 1) -> PowerSGDState:
  """The shared key, the warm-start Q (the same draw on every device), zero residuals:
  the leaf's shape, or with ``blocks`` = L > 1 (:func:`_two_level`) one block of
  ``ceil(m/L)`` rows of its ``(m, n)`` matrix view."""
  leaves, treedef = treeutil.flat(params)
  key, q_key = jax.random.split(jax.random.key(opts.seed))
  qs, residual, chosen = [], [], []
  for i, (path, leaf) in enumerate(leaves):
    treeutil.check_leaf(path, leaf)
    p = opts.plan(path, leaf)
    chosen.append(p is not None)
    # The same draw on every device (no device index folded in): shared randomness.
    qs.append(
      jax.random.normal(jax.random.fold_in(q_key, i), (p.cols, p.rank), _F32)
      if p and opts.warm_start
      else optax.MaskedNode()
    )
    if p and opts.error_feedback:
      shape = jnp.shape(leaf) if blocks == 1 else (_cdiv(p.rows, blocks), p.cols)
      residual.append(jnp.zeros(shape, _F32))
    else:
      residual.append(optax.MaskedNode())
  rule = pipeline.filter_rule(
    opts.filter_fn,
    transforms.default_filter,
    f" with min_compression={opts.min_compression} (a matrix whose rank-{opts.rank} "
    f"factors would not be that many times smaller is sent dense)",
  )
  pipeline.warn_if_nothing_compressed("jc.powersgd", chosen, rule)
  return PowerSGDState(
    key=key,
    q=treedef.unflatten(qs),
    residual=treedef.unflatten(residual),
    nonfinite_count=jnp.zeros((), jnp.int32),
    shapes=treeutil.LeafShapes.of(params),
  )


class _Local(NamedTuple):
  """One compressed leaf's first local step (Algorithm 1, line 3)."""

  m: Array  # M = g + e, (m, n) float32
  p: Array  # P = M Q, (m, r): what the first all-reduce sums
  finite: Array  # shape=(), bool: M is finite on this device


def _start_q(opts: _Options, plan: _Plan, old_q, key) -> Array:
  """This step's ``Q`` (``n × r``), orthonormalized: the warm start, or fresh."""
  # Fresh each step, from the key every device holds alike (shared randomness).
  fresh = jax.random.normal(key, (plan.cols, plan.rank), _F32)
  if opts.warm_start:
    # A column that collapsed to 0 (a zero gradient step) is redrawn: QR would
    # complete it with a fixed axis e_j, blind to gradients zero along e_j.
    q = jnp.where(jnp.all(old_q == 0, axis=0, keepdims=True), fresh, old_q)
  else:
    q = fresh
  return _orthonormal(q)


def _local(opts: _Options, g: Array, old_e, q: Array) -> _Local:
  """``M = g + e`` (error feedback) and ``P = M Q`` for ``g`` a float32 matrix: the
  whole matrix view, or under :func:`_two_level` a block of its rows (``P``'s rows are
  ``M``'s rows times ``Q``, so a block of rows gives the same rows of ``P``)."""
  m = g + old_e.reshape(g.shape) if opts.error_feedback else g
  return _Local(m, m @ q, _all_finite(m))


def _compute_p(opts: _Options, g, plan: _Plan, old_q, old_e, key) -> _Local:
  """``M = g + e`` (error feedback), ``Q`` (warm start, or fresh), ``P = M Q``."""
  m = g.astype(_F32).reshape(plan.rows, plan.cols)
  return _local(opts, m, old_e, _start_q(opts, plan, old_q, key))


def _all_reduce_p(opts: _Options, dense: list, ps: list) -> tuple[list, list]:
  """First all-reduce: every ``P`` (summed), and the full-precision leaves (averaged),
  one buffer per dtype (:func:`collectives.factor_sums`). Returns (dense means, P sums)."""
  p_sums, dense_means = collectives.factor_sums(ps, opts.axis_name, dense=dense)
  return dense_means, p_sums


def _compute_q(local: _Local, p_sum: Array) -> tuple[Array, Array]:
  """``P̂ = orth(Σ P)`` and this device's ``Q = Mᵀ P̂`` (lines 4-5)."""
  p_hat = _orthonormal(p_sum)
  return p_hat, local.m.T @ p_hat


def _all_reduce_q(opts: _Options, qs: list) -> list:
  """Second all-reduce: every ``Q`` (summed, :func:`collectives.factor_sums`)."""
  return collectives.factor_sums(qs, opts.axis_name)[0]


def _shared_q(opts: _Options, p_hat, q_bar, old_q) -> tuple[Array, Any]:
  """Whether the exchange was finite, and the next warm start ``Q̄`` (the previous one
  after a non-finite exchange)."""
  # The same on every device (computed from the sums): a non-finite input anywhere.
  ok = _all_finite(p_hat) & _all_finite(q_bar)
  new_q = old_q
  if opts.warm_start:
    new_q = _match_varying(jnp.where(ok, q_bar, old_q), old_q)
  return ok, new_q


def _feedback(opts: _Options, m: Array, approx: Array, ok, finite, old_e):
  """The residual ``e = M − P̂ Q̄ᵀ`` (of ``M``'s rows, ``approx`` the same rows), in
  ``old_e``'s shape."""
  if not opts.error_feedback:
    return old_e
  # A failed exchange delivered nothing: a device whose input was finite keeps
  # all of M for later; one whose input was not keeps its previous residual.
  e = jnp.where(ok, m - approx, jnp.where(finite, m, old_e.reshape(m.shape)))
  return e.reshape(old_e.shape)


def _decompress(opts: _Options, g, local: _Local, p_hat, q_sum, k: int, old_q, old_e):
  """``update = P̂ Q̄ᵀ``, the next warm start ``Q̄`` and the residual ``e = M − P̂ Q̄ᵀ``
  (lines 6-7); a non-finite exchange keeps the shared Q and delivers nothing."""
  q_bar = q_sum / k
  ok, new_q = _shared_q(opts, p_hat, q_bar, old_q)
  approx = p_hat @ q_bar.T
  out = treeutil.mark_nonfinite(approx.reshape(g.shape).astype(g.dtype), ok)
  return out, new_q, _feedback(opts, local.m, approx, ok, local.finite, old_e)


def _update(opts: _Options, updates, state: PowerSGDState):
  """One step of Algorithm 1 over every compressed leaf at once (two all-reduces)."""
  leaves, treedef = pipeline.open_update(updates, state.shapes, "jc.powersgd")
  old_qs = treedef.flatten_up_to(state.q)
  old_es = treedef.flatten_up_to(state.residual)
  key, step_key = jax.random.split(state.key)
  k = opts.num_devices()  # first: a clear error when the axis is not bound
  plans = [opts.plan(path, g) for path, g in leaves]
  comp, dense = pipeline.Split.of([p is not None for p in plans])
  any_bad = jnp.zeros((), bool)
  for i in dense:  # averaged in full precision: a NaN propagates into the mean
    any_bad = any_bad | ~_all_finite(leaves[i][1])
  locals_ = {}
  with jax.named_scope(phases.ENCODE_SCOPE):
    for i in comp:
      path, g = leaves[i]
      collectives.check_local(path, g, opts.axis_name)
      key_i = jax.random.fold_in(step_key, i)
      locals_[i] = _compute_p(opts, g, plans[i], old_qs[i], old_es[i], key_i)
      any_bad = any_bad | ~locals_[i].finite
  dense_means, p_sums = _all_reduce_p(
    opts, [leaves[i][1] for i in dense], [locals_[i].p for i in comp]
  )
  p_hats, q_locals = [], []
  with jax.named_scope(phases.ENCODE_SCOPE):
    for i, p_sum in zip(comp, p_sums):
      p_hat, q_local = _compute_q(locals_[i], p_sum)
      p_hats.append(p_hat)
      q_locals.append(q_local)
  q_sums = _all_reduce_q(opts, q_locals)
  out = [None] * len(leaves)
  new_qs, new_es = list(old_qs), list(old_es)
  for i, mean in zip(dense, dense_means):
    out[i] = mean
  with jax.named_scope(phases.DECODE_SCOPE):
    for i, p_hat, q_sum in zip(comp, p_hats, q_sums):
      out[i], new_qs[i], new_es[i] = _decompress(
        opts, leaves[i][1], locals_[i], p_hat, q_sum, k, old_qs[i], old_es[i]
      )
  if opts.axis_name is not None:  # the shards of a tensor-parallel group count alike
    any_bad = collectives.any_over_other_axes(any_bad, opts.axis_name)
  new_state = PowerSGDState(
    key=key,
    q=treedef.unflatten(new_qs),
    residual=treedef.unflatten(new_es),
    nonfinite_count=state.nonfinite_count + any_bad.astype(jnp.int32),
    shapes=state.shapes,
  )
  return treedef.unflatten(out), new_state


# ----------------------------------------------------------------------------- two levels
#
# Under jc.two_level(jc.powersgd(axis_name=slow), fast_axis=fast) each matrix is kept a
# matrix: device f of a node holds block f of its rows (of the node's mean and of the
# node's residual), and the steps above run on the blocks, with the sums over the rows
# of the whole matrix (Q = Mᵀ P̂) taken over the fast axis. The result is flat PowerSGD
# over the slow axis of the node means, to rounding.


def _padded_rows(x: Array, rows: int) -> Array:
  """``x`` with zero rows appended up to ``rows`` (zero rows of ``M`` add nothing to
  ``Q = Mᵀ P̂`` and give zero rows of ``P = M Q``)."""
  extra = rows - x.shape[0]
  return x if not extra else jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1))


def _my_rows(x: Array, fast) -> Array:
  """This device's block of ``ceil(rows/L)`` rows of ``x``, zero-padded."""
  l = collectives.axis_size(fast)
  b = _cdiv(x.shape[0], l)
  return _padded_rows(x, b * l).reshape((l, b) + x.shape[1:])[lax.axis_index(fast)]


def _whole_rows(blocks: list, rows: list, fast) -> list:
  """Every device's block of rows all-gathered over ``fast`` (one collective), each
  matrix whole again, its padding dropped."""
  gathered = collectives.gather_tree(blocks, fast)
  return [x.reshape((-1,) + x.shape[2:])[:n] for x, n in zip(gathered, rows)]


def _node_blocks(leaves, plans, split: pipeline.Split, fast) -> tuple[list, list]:
  """Step 0: the node's mean by one dense reduce-scatter over ``fast``
  (:func:`hierarchy.node_shards`): this device's block of rows of each compressed leaf's
  matrix view (zero-padded to a multiple of L rows; float32), and its shard of each
  dense leaf."""
  l = collectives.axis_size(fast)
  tree = [
    _padded_rows(leaves[i][1].reshape(plans[i].rows, plans[i].cols), l * _cdiv(plans[i].rows, l))
    for i in split.selected
  ]
  shards = hierarchy.node_shards(tree + [leaves[i][1] for i in split.dense], fast)
  n = len(split.selected)
  return [x.astype(_F32) for x in shards[:n]], shards[n:]


def _node_flags(flags: list, fast) -> Array:
  """The bool scalars ``flags`` or-ed over the devices of the node, in one all-reduce
  of as many int32: whether the node's ``M`` (a flat device's input) was non-finite."""
  return lax.psum(jnp.stack(flags).astype(jnp.int32), fast) > 0


def _orthonormal_rows(p_sums: list, plans: list, fast) -> list:
  """``P̂ = orth(ΣP)`` of the whole matrices from each device's block of rows of ``ΣP``.

  The blocks (``r`` values a row) are all-gathered over ``fast`` and every device runs
  :func:`_orthonormal`, the Householder QR flat PowerSGD runs, on the same ``ΣP``. A
  Cholesky QR from the ``r × r`` Gram matrix psum'ed over ``fast`` would move ``r²``
  values instead of ``m·r`` over the fast link, but it is another computation of
  ``P̂``: its rounding error grows with the square of ``P``'s condition number (so it
  could not be compared with flat PowerSGD to float tolerance, and warm starts carry
  the difference on), and it breaks down on a rank-deficient ``P`` (a zero gradient),
  which Householder QR completes to an orthonormal basis.
  """
  return [_orthonormal(p) for p in _whole_rows(p_sums, [plan.rows for plan in plans], fast)]


def _q_sums(opts: _Options, locals_: list, p_hats: list, plans: list, fast) -> list:
  """``ΣQ = Σ_nodes Σ_f M_fᵀ P̂_f`` (line 5 with the rows of ``M`` split over ``fast``):
  each device's ``M_fᵀ P̂_f`` summed over ``fast`` by a reduce-scatter (device f gets
  ``ceil(n/L)`` rows), those rows summed over the slow axis (each device sends 1/L of a
  ``Q``: the node, one ``Q``), and all-gathered over ``fast``."""
  l = collectives.axis_size(fast)
  qs = [
    _padded_rows(loc.m.T @ _my_rows(p_hat, fast), l * _cdiv(plan.cols, l))
    for loc, p_hat, plan in zip(locals_, p_hats, plans)
  ]
  slices = _all_reduce_q(opts, collectives.psum_scatter_tree(qs, fast, mean=False))
  return _whole_rows(slices, [plan.cols for plan in plans], fast)


def _two_level_decompress(
  opts: _Options, g, local: _Local, p_hat, q_bar, old_q, old_e, finite, fast
):
  """:func:`_decompress` with the residual of this device's rows; ``finite``: whether
  the node's ``M`` was finite (a flat device's input)."""
  ok, new_q = _shared_q(opts, p_hat, q_bar, old_q)
  # The whole update on every device from the gathered factors (m·n·r flops, as flat
  # PowerSGD's): no all-gather of m·n values over the fast link.
  approx = p_hat @ q_bar.T
  out = treeutil.mark_nonfinite(approx.reshape(g.shape).astype(g.dtype), ok)
  return out, new_q, _feedback(opts, local.m, _my_rows(approx, fast), ok, finite, old_e)


def _per_device(tree) -> transforms.PerDeviceState:
  return transforms.PerDeviceState(jax.tree.map(lambda x: x[None], tree))


def _two_level_init(opts: _Options, fast, params) -> two_level_lib.TwoLevelState:
  """:func:`_init` with residuals of ``ceil(m/L)`` rows, held per device; the key and
  ``Q``, the same on every device of every node, replicated."""
  inner = _init(opts, params, blocks=collectives.axis_size(fast))
  return two_level_lib.TwoLevelState(
    inner._replace(
      residual=_per_device(inner.residual), nonfinite_count=_per_device(inner.nonfinite_count)
    )
  )


def _two_level_update(opts: _Options, fast, updates, state: two_level_lib.TwoLevelState):
  """One step of Algorithm 1 on the node means, the rows of each matrix split over the
  devices of a node (:func:`_two_level`)."""
  inner = state.inner
  collectives.axis_size(fast)  # first: a clear error when an axis is not bound
  k = opts.num_devices()
  leaves, treedef = pipeline.open_update(updates, inner.shapes, "jc.two_level(jc.powersgd)")
  for path, g in leaves:
    collectives.check_local(path, g, fast)
    collectives.check_local(path, g, opts.axis_name)
  old_qs = treedef.flatten_up_to(inner.q)
  old_es = treedef.flatten_up_to(jax.tree.map(lambda x: x[0], inner.residual.inner))
  key, step_key = jax.random.split(inner.key)
  plans = [opts.plan(path, g) for path, g in leaves]
  split = pipeline.Split.of([p is not None for p in plans])
  comp, cplans = split.selected, [plans[i] for i in split.selected]
  blocks, dense = _node_blocks(leaves, plans, split, fast)
  with jax.named_scope(phases.ENCODE_SCOPE):
    qs = [_start_q(opts, plans[i], old_qs[i], jax.random.fold_in(step_key, i)) for i in comp]
    locals_ = [_local(opts, b, old_es[i], q) for i, b, q in zip(comp, blocks, qs)]
  dense_ok = jnp.all(jnp.stack([_all_finite(x) for x in dense] + [jnp.ones((), bool)]))
  bad = _node_flags([~loc.finite for loc in locals_] + [~dense_ok], fast)
  dense_means, p_sums = _all_reduce_p(opts, dense, [loc.p for loc in locals_])
  with jax.named_scope(phases.ENCODE_SCOPE):
    p_hats = _orthonormal_rows(p_sums, cplans, fast)
  q_sums = _q_sums(opts, locals_, p_hats, cplans, fast)
  out, new_qs, new_es = [None] * len(leaves), list(old_qs), list(old_es)
  with jax.named_scope(phases.DECODE_SCOPE):
    for j, i in enumerate(comp):
      out[i], new_qs[i], new_es[i] = _two_level_decompress(
        opts,
        leaves[i][1],
        locals_[j],
        p_hats[j],
        q_sums[j] / k,
        old_qs[i],
        old_es[i],
        ~bad[j],
        fast,
      )
  like = [leaves[i][1] for i in split.dense]
  for i, x in zip(split.dense, hierarchy.gather_shards(dense_means, like, fast)):
    out[i] = x
  slow = opts.axis_name if isinstance(opts.axis_name, (tuple, list)) else (opts.axis_name,)
  any_bad = collectives.any_over_other_axes(jnp.any(bad), tuple(slow) + (fast,))
  new_inner = inner._replace(
    key=key,
    q=treedef.unflatten(new_qs),
    residual=_per_device(treedef.unflatten(new_es)),
    nonfinite_count=_per_device(inner.nonfinite_count.inner[0] + any_bad.astype(jnp.int32)),
  )
  return treedef.unflatten(out), two_level_lib.TwoLevelState(new_inner)


def _two_level(opts: _Options, fast_axis) -> optax.GradientTransformation:
  r"""PowerSGD's own schedule under :func:`jaxcomp.two_level`: flat PowerSGD over the
  slow axis of the node-mean matrices, each device of a node handling a block of rows.

  With ``M̄_n`` node n's mean gradient (plus its residual) viewed as an ``m × n`` matrix,
  device f of the node holds ``M_f``, block f of its ``ceil(m/L)`` rows (a dense
  reduce-scatter over ``fast_axis``; rows of zeros pad ``m`` to a multiple of L), and
  its rows ``e_f`` of the node's residual. Per step

  .. math::
    P_f = M_f Q \;(\textstyle\sum_\text{slow}), \quad
    \hat P = \mathrm{orth}([P_1; \dots; P_L]) \;(\text{gathered over fast}), \quad
    \bar Q = \tfrac{1}{N} \textstyle\sum_\text{slow} \sum_f M_f^\top \hat P_f, \quad
    \text{update} = \hat P \bar Q^\top, \quad e_f \leftarrow M_f - \hat P_f \bar Q^\top,

  flat PowerSGD's steps on the node means (a row block of ``M Q`` is ``M_f Q``; ``Mᵀ P̂``
  is the sum over the blocks). Over the slow axis each device all-reduces its
  ``ceil(m/L) × r`` block of ``P`` and ``ceil(n/L) × r`` slice of ``Q``: a node sends one
  ``P`` and one ``Q``, not L. Dense leaves take the generic path (reduce-scatter,
  mean over slow in ``P``'s all-reduce, all-gather).

  The state is :class:`~jaxcomp.TwoLevelState` around a :class:`PowerSGDState`: its
  residuals (``ceil(m/L) × n`` float32, 1/L of the flat ones) and ``nonfinite_count`` in
  :class:`~jaxcomp.PerDeviceState`, its key and ``Q`` (the same on every device of every
  node) replicated, ``P()`` under :func:`jaxcomp.state_specs`.
  """

  def init_fn(params):
    return _two_level_init(opts, fast_axis, params)

  def update_fn(updates, state, params=None):
    del params
    return _two_level_update(opts, fast_axis, updates, state)

  return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------- transform


def powersgd(
  rank: int = 1,
  *,
  axis_name: Any = transforms.AXIS_REQUIRED,
  error_feedback: bool = True,
  warm_start: bool = True,
  min_compression: float = 2.0,
  matrix_view: str = "last",
  seed: int = 0,
  filter: transforms.FilterFn | None = None,  # pylint: disable=redefined-builtin
) -> optax.GradientTransformation:
  r"""PowerSGD: a rank-``r`` approximation of the mean gradient from one power iteration.

  Each compressed leaf is viewed as a matrix (``m × n``) and, with ``K`` devices, ``M_w``
  this device's gradient plus its residual, approximated as (Algorithm 1):

  .. math::
    P = \sum_w M_w Q, \quad \hat P = \mathrm{orth}(P), \quad
    \bar Q = \tfrac{1}{K} \sum_w M_w^\top \hat P, \qquad
    \text{update} = \hat P \bar Q^\top = \hat P \hat P^\top \bar M,

  two all-reduces of ``r·m`` and ``r·n`` values instead of ``m·n``: a projection of the
  mean ``M̄`` onto an ``r``-dimensional subspace found by one step of subspace (power)
  iteration from ``Q`` (``n × r``, the same on every device). With ``warm_start`` ``Q`` is
  the previous step's ``Q̄``, so the iteration continues across steps and tracks the
  gradient's leading singular subspace (a column of ``Q̄`` that is exactly 0, after an
  all-zero gradient, is redrawn from the state's key); otherwise it is drawn afresh each step (the
  draw is the same on every device: shared randomness, or the sums of ``P`` would
  mix different projections). ``Q`` is orthogonalized before use, as in the PyTorch hook
  (the same ``P̂``; better conditioned). With ``r >= min(m, n)`` the update is ``M̄``
  (to rounding).

  Error feedback (``error_feedback=True``; Algorithm 2): ``M_w = g_w + e_w`` and
  ``e_w ← M_w − P̂ Q̄ᵀ``, the decompressed *aggregate*, as both reference
  implementations do (the authors' code and PyTorch's ``powerSGD_hook``). The update
  depends on the residuals only through their mean, ``ē = M̄ − P̂ Q̄ᵀ``, which is the
  same as with each device's own share ``M_w − P̂ P̂ᵀ M_w``, so no part of the mean
  gradient is dropped, only delayed: ``Σ_t update_t + e_w(T) = Σ_t g_w(t)`` on every
  device. Residuals are float32 whatever the gradient dtype.

  Leaves of rank < 2, leaves the ``filter`` leaves out and matrices below
  ``min_compression`` are averaged in full precision. All the ``P``\ s (with the dense
  float32 leaves) travel in one all-reduce and all the ``Q``\ s in a second one:
  ``2(K-1)/K · 4 · Σ r(m+n)`` bytes per device per step for the compressed leaves, flat
  in K. ``P`` and ``Q`` are float32 whatever the gradient dtype (the orthogonalization
  needs it). With ``axis_name=None`` nothing is exchanged (a one-device simulation).

  NaN/Inf policy: a non-finite input on any device makes the update non-finite on every
  device (it enters the sums; it is never hidden) and ``nonfinite_count`` counts the step
  on the devices where it occurred. The shared ``Q`` keeps its previous value; a device
  whose own input was not finite keeps its residual, the others carry their whole
  ``M_w`` forward (nothing of it was delivered). Wrap the chain in
  :func:`jaxcomp.skip_nonfinite` to skip such steps.

  Under ``jax.shard_map`` hold the state with :func:`per_device_state` (the residuals
  differ between devices) and take gradients with respect to ``jc.vary(params, axis)``:
  a gradient already replicated over ``axis_name`` is a ``ValueError``. Under
  ``jax.pmap`` the state is per device already.

  Between nodes, ``jc.two_level(jc.powersgd(r, axis_name=slow), fast_axis=fast)`` runs
  PowerSGD's own two-level schedule (``docs/guides/two_level.md``): the same method
  over the slow axis of the node-mean matrices, to float rounding, each matrix kept as
  a matrix and its rows split over the devices of a node, so a node sends one ``P``
  and one ``Q`` over the slow link (not L), and each device holds 1/L of the residuals.

  Args:
    rank: ``r``, the approximation rank (PyTorch's default 1; the paper uses 1–4, up to
      32 for its language model).
    axis_name: the mapped axis to average over (required), or ``None``: the explicit
      one-device simulation, which exchanges nothing.
    error_feedback: keep and re-inject the approximation error (PowerSGD is biased;
      the paper always uses it).
    warm_start: reuse the previous step's ``Q`` instead of a fresh random one.
    min_compression: compress a matrix only if ``m·n >= min_compression · r(m+n)``
      (0: every matrix of rank >= 2 the filter selects).
    matrix_view: how a leaf of rank > 2 becomes a matrix: ``"last"`` (default),
      ``(prod(shape[:-1]), shape[-1])``, the output channels of flax/haiku kernels
      ``(..., in, out)`` as columns; ``"first"``, ``(shape[0], prod(shape[1:]))``, the
      paper's view of PyTorch kernels ``(out, in, ...)``. Either keeps the output
      channels on one side of the matrix.
    seed: seed of the state's PRNG key (the random ``Q``\ s).
    filter: ``filter(path, leaf) -> bool`` choosing which leaves may be compressed;
      defaults to :func:`jaxcomp.default_filter`.

  Returns:
    An ``optax.GradientTransformation`` whose updates are the approximated mean
    gradient, identical on every device; chain the optimizer (momentum) after it.

  Example:
    >>> import jax.numpy as jnp, optax, jaxcomp as jc
    >>> tx = optax.chain(jc.powersgd(2, axis_name=None), optax.sgd(0.1))
    >>> params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.outer(jnp.arange(64.0), jnp.ones(32)), "b": jnp.ones(32)}
    >>> updates, state = tx.update(grads, state, params)
    >>> bool(jnp.allclose(updates["w"], -0.1 * grads["w"], atol=1e-4))  # rank 1: exact
    True

  References:
    Vogels, Karimireddy, Jaggi. *PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization*. NeurIPS 2019, Algorithms 1-2 and sections 3-4.
    https://arxiv.org/abs/1905.13727
  """
  transforms.require_axis_name(axis_name, "jc.powersgd")
  _check_options(rank, min_compression, matrix_view)
  opts = _Options(
    rank=rank,
    error_feedback=error_feedback,
    warm_start=warm_start,
    min_compression=float(min_compression),
    matrix_view=matrix_view,
    seed=seed,
    axis_name=axis_name,
    filter_fn=transforms.default_filter if filter is None else filter,
  )

  def init_fn(params):
    return _init(opts, params)

  def update_fn(updates, state, params=None):
    del params
    return _update(opts, updates, state)

  tx = optax.GradientTransformation(init_fn, update_fn)
  why = (
    "its low-rank factors are computed from each matrix kept as a matrix, and a "
    "shard of 1/L of the rows has factors of its own, with their own rank and warm "
    "start"
  )
  # jc.two_level runs PowerSGD's own schedule (the rows of each matrix split over a
  # node), never the generic one on shards.
  return transforms.register_exchange(
    tx,
    "jc.powersgd",
    axis_name,
    collective=None,
    shardable=why,
    two_level=functools.partial(_two_level, opts),
  )
