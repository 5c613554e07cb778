r"""DiLoCo (Douillard et al. 2023): local steps, then a compressed outer step.

Each replica trains alone with an inner optimizer for ``sync_every`` steps; then the
*pseudo-gradient*, the parameters at the last sync minus the replica's own, is averaged
over the devices (densely, or through any jaxcomp exchange) and an outer optimizer
steps the shared parameters with it. Optionally the parameters are cut into fragments
synced in turn (Streaming DiLoCo, Douillard et al. 2025), which spreads the bytes over
the period instead of sending them all on one step. With ``fast_axis`` the replicas
are nodes of several devices, data-parallel inside (dense), and only the nodes'
pseudo-gradients cross the slow link, each device sending 1/L of its node's.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import NamedTuple
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import hierarchy
from jaxcomp._src.methods import transforms
from jaxcomp._src.methods import two_level as two_level_lib
from jaxcomp._src.methods import wrappers
from jaxcomp._src.plumbing import collective_trace
from jaxcomp._src.plumbing import treeutil

Array = jax.Array
_F32 = jnp.float32


class DiLoCoState(NamedTuple):
  """State of :func:`diloco`.

  ``count``, ``anchor`` and ``outer_state`` are the same on every device (they change
  only from exchanged, device-independent values) and stay replicated under
  ``jax.shard_map``. ``inner_state`` and ``exchange_state`` differ between devices:
  they are :class:`jaxcomp.PerDeviceState`\\ s (a leading axis of 1 per device), which
  :func:`jaxcomp.state_specs` places on the data axis. ``outer_state`` and
  ``exchange_state`` hold one entry per fragment (one in all without ``fragments``),
  each the state of its transform over the fragment's tree: the parameters with
  ``optax.MaskedNode()`` in place of the leaves it does not hold, and a leaf split
  between fragments as its rows in this one (:func:`fragment_pieces`); an empty
  fragment's is ``optax.EmptyState()``. With ``overlap=True``, ``round_start`` (per
  device, wrapped) and ``pending`` (replicated) hold the one-sync-late outer step's
  values; without it they are ``None``.
  """

  count: Array  # shape=(), dtype=int32: steps taken
  anchor: Any  # the parameters at the last sync, leaf shapes and dtypes, replicated
  inner_state: Any  # PerDeviceState: the inner optimizer's state, per device
  outer_state: tuple  # per fragment: the outer optimizer's state, replicated
  exchange_state: tuple  # per fragment: PerDeviceState of the exchange's state
  # overlap=True only (else None): PerDeviceState of the replica's parameters at the
  # start of its round (its last sync), leaf shapes and dtypes with a leading axis of 1
  round_start: Any = None
  # overlap=True only (else None): each value's exchanged mean from its fragment's last
  # sync, to be applied at the next one (zeros before the first), leaf shapes, replicated
  pending: Any = None


def _check_transform(tx, name: str, *, optional: bool = False) -> None:
  if optional and tx is None:
    return
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise TypeError(f"jc.diloco: {name} must be an optax GradientTransformation, got {tx!r}")


class Piece(NamedTuple):
  """The rows ``[start, stop)`` of a leaf along its first axis that a fragment holds."""

  leaf: int  # the leaf's index in the flattened parameters
  start: int
  stop: int


def _rows(shape) -> int:
  """The rows a leaf can be cut between: its first axis (a 0-d or empty leaf: one)."""
  return shape[0] if len(shape) and shape[0] >= 1 else 1


def fragment_pieces(shapes, fragments: int) -> list[list[Piece]]:
  """The pieces of each fragment: the leaves laid end to end, in tree order, cut in F runs.

  Fragment ``f`` holds the values between about ``f·S/F`` and ``(f+1)·S/F`` of the
  ``S`` in all. A cut moves to the nearest leaf boundary when one lies within
  ``S/(8F)``, so that a leaf is split only where no boundary is near and its pieces are
  no slivers; else to the nearest boundary between two rows (along the first axis) of
  the leaf it falls in. Each fragment then holds ``S/F`` values to within the larger of
  ``S/(4F)`` and one row of a leaf it cuts, one run of consecutive rows per leaf, and at
  most ``F - 1`` leaves are split. Where the rows are too few or too coarse (a leaf with
  fewer rows than fragments) the fragments come out uneven, some even empty, and
  :func:`diloco` warns.

  Deterministic, from the shapes alone: every device and every call cuts the same tree
  the same way.

  Args:
    shapes: the shape of each leaf, in ``jax.tree.flatten`` order.
    fragments: ``F``.

  Returns:
    Per fragment, its :class:`Piece`\\ s in leaf order.
  """
  rows = np.array([_rows(tuple(s)) for s in shapes], np.int64)
  row_size = np.array([np.prod(s, dtype=np.int64) for s in shapes], np.int64) // rows
  starts = np.concatenate([[0], np.cumsum(rows * row_size)])  # each leaf's first value
  leaf_rows = np.concatenate([[0], np.cumsum(rows)])  # each leaf's first row, all rows counted
  total, n = int(starts[-1]), int(leaf_rows[-1])
  cuts = [0]  # the global row each fragment starts at
  for f in range(1, fragments):
    ideal = f * total / fragments
    near = int(np.argmin(np.abs(starts - ideal)))  # the nearest leaf boundary
    if abs(starts[near] - ideal) <= total / (8 * fragments):
      g = int(leaf_rows[near])
    else:  # the nearest boundary between rows of the leaf the cut falls in (ties: lower)
      i = int(np.searchsorted(starts, ideal, side="right")) - 1
      r = int(np.ceil((ideal - starts[i]) / row_size[i] - 0.5))
      g = int(leaf_rows[i]) + min(max(r, 0), int(rows[i]))
    if n >= fragments:  # every fragment gets a row, and leaves one to each after it
      cuts.append(min(max(g, cuts[-1] + 1), n - (fragments - f)))
    else:  # too few rows to go round: some fragments stay empty
      cuts.append(max(g, cuts[-1]))
  cuts.append(n)
  out = []
  for lo, hi in zip(cuts[:-1], cuts[1:]):
    pieces = []
    for i, (first, r) in enumerate(zip(leaf_rows[:-1].tolist(), rows.tolist())):
      start, stop = max(lo - first, 0), min(hi - first, r)
      if start < stop:
        pieces.append(Piece(i, start, stop))
    out.append(pieces)
  return out


def fragment_offsets(sync_every: int, fragments: int) -> list[int]:
  """Step offsets of the fragments, spread evenly over the period: ``f·H // F``."""
  return [f * sync_every // fragments for f in range(fragments)]


def diloco(
  inner: optax.GradientTransformation,
  outer: optax.GradientTransformation,
  *,
  sync_every: int,
  axis_name: Any = transforms.AXIS_REQUIRED,
  exchange: optax.GradientTransformation | None = None,
  fragments: int | None = None,
  fast_axis: Any = None,
  overlap: bool = False,
) -> optax.GradientTransformation:
  r"""DiLoCo: ``sync_every`` local steps per replica, then an outer step on the mean drift.

  Each device is a replica with its own parameters ``θ_i``. Every step it applies
  ``inner`` (any optax transformation, e.g. ``optax.adamw``) to its own gradient, with
  no communication. Every ``H = sync_every``-th step the replicas sync: with ``θ`` the
  parameters of the last sync (the *anchor*, the same on every device),

  .. math::
    Δ = \mathrm{exchange}\big(θ - θ_i\big) \approx \tfrac{1}{K}\textstyle\sum_i (θ - θ_i),
    \qquad θ \leftarrow θ + \mathrm{outer}(Δ),

  and every replica continues from the new ``θ`` (its inner optimizer's state carries
  on; only the parameters are reset). ``exchange`` is any jaxcomp exchange over
  ``axis_name`` (e.g. ``jc.qsgd(bits=4, axis_name=...)``, with its error feedback,
  whose state advances on sync steps only); ``None`` averages ``Δ`` densely (one
  all-reduce per dtype, :func:`jaxcomp.pmean_tree`). ``outer`` sees ``Δ`` as a
  gradient: ``optax.sgd(1.0)`` sets ``θ`` to the replicas' mean, the paper's
  ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` extrapolates past it. With
  ``sync_every=1``, ``exchange=None``, ``inner=optax.sgd(lr)`` and
  ``outer=optax.sgd(1.0)`` it is data-parallel SGD with learning rate ``lr``.

  **The parameters are per device.** ``update`` takes this replica's gradient and
  parameters and returns this replica's updates: ``inner``'s between syncs, and
  ``θ_new - θ_i`` on a sync step, so that ``optax.apply_updates`` puts every replica on
  the new anchor (to one rounding of ``θ_i + (θ_new - θ_i)``; the next pseudo-gradient
  is taken from the anchor, so the rounding does not build up). Under ``jax.pmap`` the
  parameters are per device anyway. Under ``jax.shard_map`` hold them with a leading
  device axis, like a :func:`jaxcomp.per_device_state` (globally ``(K, *shape)``,
  ``P(axis_name)``), initialise the state from the replicated parameters, and evaluate
  ``state.anchor``::

    tx = jc.diloco(optax.adamw(1e-3), optax.sgd(0.7, momentum=0.9, nesterov=True),
                   sync_every=50, axis_name="b", exchange=jc.qsgd(bits=4, axis_name="b"))
    specs = jc.state_specs(tx, params, axis_name="b", num_devices=K)
    opt_state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)
    replicas = jax.tree.map(lambda x: jnp.broadcast_to(x, (K, *x.shape)), params)

    def train_step(replicas, opt_state, batch):   # in_specs (P("b"), specs, P("b"))
      p = jax.tree.map(lambda x: x[0], replicas)  # this replica: varies over "b"
      grads = jax.grad(loss)(p, batch)            # its local gradient (no psum)
      updates, opt_state = tx.update(grads, opt_state, p)
      p = optax.apply_updates(p, updates)
      return jax.tree.map(lambda x: x[None], p), opt_state

  One compiled program serves every step: each fragment's sync is a ``lax.cond`` on the
  step count, the same on every device, so every device enters the exchange's
  collectives on the same steps and none waits alone; steps without a sync run no
  collective at all.

  ``fragments=F`` (Streaming DiLoCo): the parameters are cut into F fragments of about
  equal size, and fragment ``f`` syncs on the steps ``t ≡ f·H // F (mod H)`` (``t``
  counts from 1), each with its own anchor entries, outer state and exchange state.
  The leaves, laid end to end in tree order, are cut into F runs; a cut that falls
  inside a leaf splits it between two rows of its first axis (:func:`fragment_pieces`),
  so a model whose layers are stacked along a leading axis splits between layers. Every
  value still syncs once per ``H`` steps, but a sync step sends one fragment, about
  ``1/F`` of the bytes. The exchange sees a split leaf's rows as a leaf of that shape,
  and so does its filter (under the default one, a piece of fewer than 1024 values is
  averaged dense; the cuts leave no slivers). Where the rows are too coarse to balance
  the fragments within 1.5x of the mean (a leaf with fewer rows than fragments), a
  warning says so and how to fix it.

  **Overlapped outer steps** (``overlap=True``). A sync then waits on no exchange: the
  mean it starts is applied one sync later, so that a runtime that dispatches the
  exchange apart from the inner steps can run it alongside the next ``H`` of them
  (Streaming DiLoCo's overlap, with a delay of one whole round). Each replica keeps
  ``B_i``, its parameters at the start of its round, and the state holds ``\bar Δ``,
  the mean of the previous sync (``pending``). At sync ``s``, per fragment,

  .. math::
    Δ_i = B_i - θ_i, \qquad \bar Δ_s = \mathrm{exchange}(Δ_i), \qquad
    θ \leftarrow θ + \mathrm{outer}(\bar Δ_{s-1}), \qquad
    θ_i \leftarrow θ + (θ_i - B_i), \qquad B_i \leftarrow θ_i,

  and ``\bar Δ_s`` is kept for sync ``s + 1``; at the first sync nothing is pending and
  the anchor and the outer state stay as they are. So every replica's progress reaches
  the anchor one sync late, the anchor follows DiLoCo's recursion fed the means of one
  sync before, and meanwhile each replica keeps its own unsynced progress on top of the
  anchor, as the eager updates of Kale et al. (2025) use the local pseudo-gradient in
  place of the mean not yet arrived. With one replica and ``outer=optax.sgd(1.0)`` the
  syncs leave the replica's trajectory as it was (``θ = B_i + \bar Δ_{s-1}`` before
  each sync). Where this departs from the papers (as we read their descriptions, not
  checked line by line against their algorithms): Streaming DiLoCo overlaps by a delay
  of ``τ`` inner steps, shorter than ``H``, and mixes the replica with the late anchor
  by a factor ``α``; the eager variant uses this replica's fresh pseudo-gradient in
  place of its own stale one in the mean it applies, a step that differs between
  replicas. Here the delay is one round, the mean applied is the whole
  previous sync's, the same on every device (the anchor stays replicated and
  checkpoints as one array), and the replica's fresh progress is added back on top of
  the anchor rather than mixed in. In one compiled program the sync step still
  contains the exchange's collectives; the exchange is hidden only where it is
  dispatched as a program of its own whose result is read one sync later
  (``docs/benchmarks.md``, "Overlapped outer steps", measures and prices it). Costs
  two parameter-sized buffers more: ``B_i`` per device and the pending mean,
  replicated.

  **Replicas that are nodes** (``fast_axis``). The DiLoCo paper's replica, and
  torchft's, is a worker of several accelerators. On a 2-D mesh ``(slow, fast)`` of N
  nodes of L devices, ``axis_name=slow`` and ``fast_axis=fast`` make each node one
  replica: every step the devices of a node average their gradients densely over
  ``fast_axis`` (:func:`jaxcomp.pmean_tree`, one all-reduce per dtype on the fast link)
  and apply ``inner`` to that mean, so they hold the same replica and inner state; a
  sync averages over the nodes only. Δ being the same on the devices of a node, it is
  exchanged two-level without a reduce-scatter (:func:`jaxcomp.two_level` with
  ``same_in_node=True``): each device takes its 1/L shard of Δ, ``exchange`` (built
  with ``axis_name=slow``) averages the shards over the nodes, and an all-gather over
  ``fast_axis`` reassembles the mean; ``None`` does the same with a dense mean. The slow
  link so carries one Δ per node, not L copies of it, and the exchange's state
  (residuals) is 1/L of Δ's size per device. Hold the parameters one row per device
  (globally ``(N·L, *shape)``, ``P((slow, fast))``, the rows of a node equal) or one per
  node (``(N, *shape)``, ``P(slow)``, the gradient taken with respect to
  ``jc.vary(p, fast)``), and place the state with ``jc.state_specs(tx, params,
  axis_name=(slow, fast), num_devices=N·L, mesh=mesh)`` (``docs/guides/two_level.md``).

  Bytes per device per step: the exchange's bytes for the whole model divided by ``H``
  on average (:func:`jaxcomp.wire_report` reports that: the sync's collectives count
  ``1/H`` per step); a sync step itself sends all of them (``fragments=None``) or one
  fragment's.

  State (:class:`DiLoCoState`): the step count, the anchor and the outer states are
  replicated; the inner optimizer's and the exchange's states are per device and
  already wrapped: :func:`jaxcomp.per_device_state` hands ``diloco`` back unchanged
  (wrapping it, as every other method, is correct); pass the exchange unwrapped.
  :func:`jaxcomp.state_specs` places every part.

  A non-finite gradient makes that replica's pseudo-gradient, hence the mean and the
  anchor, non-finite on every device at the next sync (visible, never hidden).
  :func:`jaxcomp.skip_nonfinite` does not apply: its decision reads updates that are the
  same on every device, and DiLoCo's differ between syncs.

  Args:
    inner: the replicas' optimizer, applied to the local gradient every step.
    outer: the optimizer of the anchor, applied to the averaged pseudo-gradient.
    sync_every: ``H``, the steps between syncs (of each fragment), ``>= 1``.
    axis_name: the data-parallel axis the replicas live on (``None``: one replica; the
      mean is the pseudo-gradient itself).
    exchange: a jaxcomp exchange over ``axis_name`` returning the mean of its input
      (``jc.qsgd``, ``jc.onebit_sgd``, ``jc.powersgd``, ...), unwrapped; ``None``: a
      dense float mean. One whose result depends on no collective over ``axis_name``
      (built with ``axis_name=None`` or for another axis, or an optax transform that
      averages nothing) is an error when the sync is traced, under ``jax.pmap`` and
      ``jax.shard_map`` alike: each replica would step the anchor alone.
    fragments: ``F``, the number of fragments, ``1 <= F <= sync_every``; ``None``: all
      leaves sync together.
    fast_axis: the mesh axis of the devices inside a node, which then is one replica
      (``axis_name`` the axis over the nodes); ``exchange`` must be one jaxcomp exchange
      over ``axis_name`` that :func:`jaxcomp.two_level` can run on shards. ``None``:
      every device is a replica.
    overlap: apply each sync's outer step one sync late, each replica keeping its own
      progress meanwhile (above); not with ``fast_axis``.

  Returns:
    An ``optax.GradientTransformation`` whose ``update(grads, state, params)`` needs
    this replica's ``params`` and returns this replica's updates.

  Raises:
    ValueError: ``sync_every < 1``; ``fragments`` outside ``[1, sync_every]``;
      ``update`` without ``params``; under ``jax.shard_map``,
      replicated parameters; an exchange that does not average over ``axis_name``;
      ``fast_axis`` equal to (or in) ``axis_name``, or without ``axis_name``; with
      ``fast_axis``, an exchange over another axis than ``axis_name``, and, under
      ``jax.shard_map``, a gradient already summed over ``fast_axis``.
    TypeError: with ``fast_axis``, an exchange that is not one jaxcomp exchange.
    NotImplementedError: with ``fast_axis``, an exchange :func:`jaxcomp.two_level`
      cannot run on shards yet; ``overlap=True`` with ``fast_axis``.

  Example:
    >>> import jax.numpy as jnp, optax, jaxcomp as jc
    >>> tx = jc.diloco(optax.sgd(0.5), optax.sgd(1.0), sync_every=2, axis_name=None)
    >>> params, grads = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)  # t = 1: a local step
    >>> params = optax.apply_updates(params, updates)
    >>> params["w"].tolist(), state.anchor["w"].tolist()
    ([-0.5, -0.5], [0.0, 0.0])
    >>> updates, state = tx.update(grads, state, params)  # t = 2: a sync
    >>> params = optax.apply_updates(params, updates)
    >>> params["w"].tolist(), state.anchor["w"].tolist()
    ([-1.0, -1.0], [-1.0, -1.0])

  References:
    Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen. *DiLoCo:
    Distributed Low-Communication Training of Language Models*. 2023.
    https://arxiv.org/abs/2311.08105

    Douillard, Donchev, Rush, Kale, Rusu, Hasan, Szlam, et al. *Streaming DiLoCo with
    overlapping communication: Towards a Distributed Free Lunch*. 2025.
    https://arxiv.org/abs/2501.18512

    Kale, Douillard, Donchev. *Eager Updates For Overlapped Communication and
    Computation in DiLoCo*. 2025. https://arxiv.org/abs/2502.12996
  """
  o = _options(inner, outer, exchange, sync_every, axis_name, fragments, fast_axis, overlap)
  return transforms.places_own_state(
    optax.GradientTransformation(
      lambda params: _init(o, params),
      lambda grads, state, params=None: _update(o, grads, state, params),
    )
  )


class _Options(NamedTuple):
  """:func:`diloco`'s options, checked (the transforms wrapped for per-device state)."""

  inner: optax.GradientTransformation  # per_device_state(inner)
  outer: optax.GradientTransformation
  exchange: optax.GradientTransformation | None  # per_device_state(exchange), or None
  sync_every: int
  num_fragments: int
  offsets: tuple[int, ...]  # the step offset of each fragment's sync in the period
  axis_name: Any
  fast_axis: Any  # None: every device a replica; else the axis of a node's devices
  overlap: bool  # the outer step one sync late, each replica keeping its own progress


def _options(
  inner, outer, exchange, sync_every, axis_name, fragments, fast_axis, overlap
) -> _Options:
  """The factory's argument checks, in one place: an :class:`_Options`, or the error
  (``ValueError``; with ``fast_axis`` also :func:`_node_exchange`'s)."""
  transforms.require_axis_name(axis_name, "jc.diloco")
  _check_transform(inner, "inner")
  _check_transform(outer, "outer")
  _check_transform(exchange, "exchange", optional=True)
  if (
    isinstance(sync_every, bool) or not isinstance(sync_every, (int, np.integer)) or sync_every < 1
  ):
    raise ValueError(f"jc.diloco: sync_every must be an integer >= 1, got {sync_every!r}")
  sync_every = int(sync_every)
  num_fragments = 1 if fragments is None else fragments
  if (
    isinstance(num_fragments, bool)
    or not isinstance(num_fragments, (int, np.integer))
    or not 1 <= num_fragments <= sync_every
  ):
    raise ValueError(
      f"jc.diloco: fragments must be an integer in [1, sync_every={sync_every}] (each "
      f"fragment syncs on its own step of the period) or None, got {fragments!r}"
    )
  num_fragments = int(num_fragments)
  if not isinstance(overlap, bool):
    raise ValueError(f"jc.diloco: overlap must be True or False, got {overlap!r}")
  if overlap and fast_axis is not None:
    raise NotImplementedError(
      f"jc.diloco: overlap=True with fast_axis={fast_axis!r} is not implemented: the "
      f"round-start parameters it keeps per device would vary over the fast axis where "
      f"a node's replica is held once per node (P(slow)), and the updates built from "
      f"them could not be typed like those parameters without a collective over the "
      f"fast axis on every sync; this combination is not written nor tested. Use "
      f"overlap with every device a replica (fast_axis=None)."
    )
  if fast_axis is not None:
    exchange = _node_exchange(exchange, axis_name, fast_axis)
  return _Options(
    inner=transforms.per_device_state(inner),
    outer=outer,
    exchange=None if exchange is None else transforms.per_device_state(exchange),
    sync_every=sync_every,
    num_fragments=num_fragments,
    offsets=tuple(fragment_offsets(sync_every, num_fragments)),
    axis_name=axis_name,
    fast_axis=fast_axis,
    overlap=overlap,
  )


def _node_exchange(exchange, axis_name, fast_axis):
  """Replicas that are nodes: the checks of ``fast_axis`` against ``axis_name``, and the
  exchange run two-level on each device's shard of the node's pseudo-gradient
  (:func:`jaxcomp.two_level` with ``same_in_node=True``), or ``None`` for the dense mean."""
  if axis_name is None:
    raise ValueError(
      f"jc.diloco: fast_axis={fast_axis!r} makes the replicas nodes, which need "
      f"axis_name=<the axis over the nodes> (the slow axis), got axis_name=None"
    )
  if isinstance(fast_axis, (tuple, list)) or fast_axis in _axis_names(axis_name):
    raise ValueError(
      f"jc.diloco: fast_axis must be one mesh axis (the devices inside a node) other "
      f"than axis_name (the axis over the nodes); got fast_axis={fast_axis!r}, "
      f"axis_name={axis_name!r}"
    )
  if exchange is None:
    return None
  info = transforms.exchange_info(exchange)
  if info is None:
    raise TypeError(
      f"jc.diloco(fast_axis={fast_axis!r}): the exchange runs on each device's 1/L shard "
      f"of the node's pseudo-gradient (jc.two_level), so it must be one jaxcomp exchange "
      f"built with axis_name={axis_name!r} (e.g. jc.qsgd(bits=4, axis_name="
      f"{axis_name!r})), not a chain, an optax transform or a jc.two_level (diloco wraps "
      f"the exchange itself)"
    )
  if info.axis_name is None or _axis_names(info.axis_name) != _axis_names(axis_name):
    raise ValueError(
      f"jc.diloco(fast_axis={fast_axis!r}): the exchange must average over the nodes, "
      f"axis_name={axis_name!r}, but {info.who} was built with "
      f"axis_name={info.axis_name!r}; build it with axis_name={axis_name!r} (the fast "
      f"axis is averaged densely inside the node)"
    )
  try:
    return two_level_lib.two_level(exchange, fast_axis=fast_axis, same_in_node=True)
  except NotImplementedError as e:
    raise NotImplementedError(
      f"jc.diloco(fast_axis={fast_axis!r}) runs the exchange on each device's shard of "
      f"the node's pseudo-gradient (jc.two_level), which {info.who} cannot do yet: {e}"
    ) from e


class _Partition(NamedTuple):
  """The parameters' leaves, their treedef, and the pieces of each fragment."""

  leaves: list
  treedef: Any
  pieces: list  # per fragment, its pieces in leaf order

  def cut(self, leaves, piece: Piece):
    """``piece`` of ``leaves[piece.leaf]`` (the leaf itself when it holds all rows)."""
    x = leaves[piece.leaf]
    if (piece.start, piece.stop) == (0, _rows(np.shape(x))):
      return x
    return x[piece.start : piece.stop]

  def tree(self, f: int, xs) -> Any:
    """Fragment ``f``'s tree: ``xs`` (one per piece) at its leaves, ``MaskedNode`` elsewhere."""
    at = {p.leaf: x for p, x in zip(self.pieces[f], xs)}
    return self.treedef.unflatten([at.get(i, optax.MaskedNode()) for i in range(len(self.leaves))])

  def fragment(self, f: int, leaves) -> Any:
    """Fragment ``f``'s tree of the parameter-shaped ``leaves``."""
    return self.tree(f, [self.cut(leaves, p) for p in self.pieces[f]])


def _split(o: _Options, params) -> _Partition:
  """The tree cut into fragments (:func:`fragment_pieces`); a warning when they are
  uneven beyond 1.5x of the mean."""
  leaves, treedef = jax.tree.flatten(params)
  shapes = [tuple(np.shape(x)) for x in leaves]
  pieces = fragment_pieces(shapes, o.num_fragments)
  _warn_uneven(pieces, shapes, [path for path, _ in treeutil.flat(params)[0]])
  return _Partition(leaves, treedef, pieces)


def _warn_uneven(pieces, shapes, paths) -> None:
  """A warning, naming the coarsest leaf, when the largest fragment exceeds 1.5x the mean."""
  row_size = [int(np.prod(s, dtype=np.int64)) // _rows(s) for s in shapes]
  loads = [sum((p.stop - p.start) * row_size[p.leaf] for p in ps) for ps in pieces]
  mean = sum(loads) / len(loads)
  if not mean or max(loads) <= 1.5 * mean:
    return
  coarse = max(range(len(shapes)), key=lambda i: (row_size[i], -i))
  warnings.warn(
    f"jc.diloco: fragments={len(pieces)} are not balanced within 1.5x of the mean: the "
    f"largest holds {max(loads):,} of {sum(loads):,} values ({max(loads) / mean:.2f}x the "
    f"mean; {loads.count(0)} empty), because a leaf is cut only between the rows of its "
    f"first axis and the parameter at {jax.tree_util.keystr(paths[coarse])} has "
    f"{_rows(shapes[coarse])} row(s) of {row_size[coarse]:,} values. Pass fewer "
    f"fragments, or give the large parameters a first axis of many rows (stack the "
    f"layers of a model along axis 0, or reshape a parameter to (rows, -1)).",
    stacklevel=5,
  )


def _init(o: _Options, params) -> DiLoCoState:
  """The anchor at ``params``, the inner state, and per fragment the outer and exchange
  states (of the fragment's pieces, the other leaves masked; an empty fragment's:
  ``optax.EmptyState()``)."""
  for path, leaf in treeutil.flat(params)[0]:
    treeutil.check_leaf(path, leaf, "jc.diloco needs floating-point parameters")
  part = _split(o, params)
  frags = [part.fragment(f, part.leaves) if ps else None for f, ps in enumerate(part.pieces)]
  return DiLoCoState(
    count=jnp.zeros((), jnp.int32),
    anchor=jax.tree.map(jnp.asarray, params),
    inner_state=o.inner.init(params),
    outer_state=tuple(optax.EmptyState() if t is None else o.outer.init(t) for t in frags),
    exchange_state=tuple(
      optax.EmptyState() if t is None or o.exchange is None else o.exchange.init(t) for t in frags
    ),
    round_start=transforms.PerDeviceState(jax.tree.map(lambda x: jnp.asarray(x)[None], params))
    if o.overlap
    else None,
    pending=jax.tree.map(jnp.zeros_like, params) if o.overlap else None,
  )


def _check_update(o: _Options, grads, params) -> None:
  """Under shard_map (check_vma): per-device parameters, local gradients."""
  if o.axis_name is None or not collectives.tracks_varying(o.axis_name):
    return
  for path, p in treeutil.flat(params)[0]:
    if o.axis_name not in collectives.varying_axes(p):
      raise ValueError(
        f"jc.diloco: the parameters at {jax.tree_util.keystr(path)} are replicated "
        f"over axis {o.axis_name!r}, but DiLoCo's replicas drift apart between syncs: "
        f"hold the parameters per device (a leading device axis, P({o.axis_name!r}), "
        f"one row per replica) and pass this replica's row to update."
      )
  for path, g in treeutil.flat(grads)[0]:
    collectives.check_local(path, g, o.axis_name)
    if o.fast_axis is not None:
      collectives.check_local(path, g, o.fast_axis)


def _axis_names(axis_name) -> frozenset:
  return frozenset(axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,))


def _check_averages(o: _Options, delta, ex_state, anchor) -> None:
  """Refuses an exchange whose result does not depend on a collective over the axis.

  Read off the exchange's traced update (:func:`collective_trace.output_axes`), once per
  trace of the sync: it costs nothing per step, and holds under ``jax.pmap`` and
  ``shard_map(check_vma=False)``, where values carry no varying type. Without it, an
  exchange built with ``axis_name=None`` (or another axis, or an optax transform of
  one's own that does no collective) lets each replica apply its own pseudo-gradient,
  and the anchors, which must be the same on every device, drift apart silently.
  """
  closed, (mean, _) = jax.make_jaxpr(o.exchange.update, return_shape=True)(delta, ex_state, anchor)
  paths = [path for path, _ in treeutil.flat(mean)[0]]
  want = _axis_names(o.axis_name)
  for path, axes in zip(paths, collective_trace.output_axes(closed)):
    if not want <= axes:
      over = ", ".join(sorted(map(repr, axes))) or "none"
      raise ValueError(
        f"jc.diloco: the exchange's result at {jax.tree_util.keystr(path)} depends on no "
        f"collective over axis {o.axis_name!r} (its collectives run over: {over}), so "
        f"each replica would step the anchor with its own pseudo-gradient and the "
        f"replicas' anchors would drift apart. Build the exchange with "
        f"axis_name={o.axis_name!r}, the axis jc.diloco syncs over (e.g. "
        f"jc.qsgd(bits=4, axis_name={o.axis_name!r})), or pass exchange=None for a dense "
        f"mean; a transform of your own must average over {o.axis_name!r} (lax.pmean)."
      )


def _mean_of(o: _Options, delta, ex_state, anchor):
  """The exchanged mean of the pseudo-gradient tree, and the exchange's new state."""
  if o.exchange is None:
    if o.axis_name is None:
      return delta, ex_state
    if o.fast_axis is not None:  # two-level: 1/L of Δ per device over the slow axis
      leaves, treedef = jax.tree.flatten(hierarchy.local_shards(delta, o.fast_axis))
      means, _ = collectives.dense_means(leaves, o.axis_name)
      return hierarchy.gather_shards(treedef.unflatten(means), delta, o.fast_axis), ex_state
    leaves, treedef = jax.tree.flatten(delta)
    means, _ = collectives.dense_means(leaves, o.axis_name)
    return treedef.unflatten(means), ex_state
  try:
    if o.axis_name is not None:
      _check_averages(o, delta, ex_state, anchor)
    mean, ex_state = o.exchange.update(delta, ex_state, anchor)
  except NameError as e:  # a collective over an axis that is not bound
    raise ValueError(
      f"jc.diloco: the exchange runs a collective over an axis that is not bound "
      f"({e}); build it with axis_name={o.axis_name!r}, the axis jc.diloco syncs over."
    ) from e
  if o.axis_name is not None and collectives.tracks_varying(o.axis_name):
    for path, m in treeutil.flat(mean)[0]:
      if o.axis_name in collectives.varying_axes(m):
        raise ValueError(
          f"jc.diloco: the exchange's result at {jax.tree_util.keystr(path)} still "
          f"differs between devices on axis {o.axis_name!r}: the exchange does not "
          f"average over it (built with another axis_name, or None?); build it with "
          f"axis_name={o.axis_name!r}."
        )
      if o.fast_axis is not None and o.fast_axis in collectives.varying_axes(m):
        raise ValueError(  # two_level all-gathers over the fast axis: a bug if reached
          f"jc.diloco: the exchange's result at {jax.tree_util.keystr(path)} differs "
          f"between the devices of a node (axis {o.fast_axis!r})"
        )
  return mean, ex_state


def _sync(o: _Options, part: _Partition, f: int, u, a, p, outer_state, ex_state):
  """Fragment ``f``'s sync: the pseudo-gradient's mean, the outer step from the anchor,
  and each replica's update that lands it on the new anchor. ``u``, ``a``, ``p``: the
  fragment's pieces of the inner updates, the anchor and the parameters."""
  with jax.named_scope(collective_trace.every_scope(o.sync_every)):
    # Δ = θ - (θ_i + u_i), taken as (θ - θ_i) - u_i: exactly -u_i while the
    # replica sits on the anchor (sync_every=1), with no rounding of θ_i + u_i.
    delta = [
      ((a_.astype(_F32) - p_.astype(_F32)) - u_.astype(_F32)).astype(p_.dtype)
      for u_, a_, p_ in zip(u, a, p)
    ]
    mean, ex_state_new = _mean_of(o, part.tree(f, delta), ex_state, part.tree(f, a))
    outer_u, outer_new = o.outer.update(mean, outer_state, part.tree(f, a))
    outer_u = jax.tree.leaves(outer_u)  # the pieces, in leaf order
    a_new = [optax.apply_updates(a_, v.astype(a_.dtype)) for a_, v in zip(a, outer_u)]
    u_new = [(an - p_).astype(u_.dtype) for an, p_, u_ in zip(a_new, p, u)]
  match = lambda new, old: jax.tree.map(wrappers._match_varying, new, old)  # pylint: disable=protected-access
  return (
    match(u_new, u),
    match(a_new, a),
    match(outer_new, outer_state),
    match(ex_state_new, ex_state),
  )


def _stay(u, a, p, outer_state, ex_state):
  """A fragment off its sync step: the inner updates as they are, the state unchanged."""
  del p
  return u, a, outer_state, ex_state


def _first_sync(o: _Options, f: int) -> int:
  """The step of fragment ``f``'s first sync (``t`` counts from 1)."""
  return o.offsets[f] or o.sync_every


def _sync_overlapped(
  o: _Options, part: _Partition, f: int, t, u, a, p, b, m, outer_state, ex_state
):
  """Fragment ``f``'s sync, one sync late: this round's progress is exchanged, the
  previous sync's mean ``m`` steps the anchor, and the replica lands on the new anchor
  plus its own progress. ``b``, ``m``: the fragment's pieces of the round-start
  parameters and of the pending mean."""
  with jax.named_scope(collective_trace.every_scope(o.sync_every)):
    # Δ_i = B_i - (θ_i + u_i), taken as (B_i - θ_i) - u_i, as _sync does from the anchor.
    delta = [
      ((b_.astype(_F32) - p_.astype(_F32)) - u_.astype(_F32)).astype(p_.dtype)
      for u_, b_, p_ in zip(u, b, p)
    ]
    mean, ex_state_new = _mean_of(o, part.tree(f, delta), ex_state, part.tree(f, a))

    def outer_step(a, m, outer_state):
      outer_u, outer_new = o.outer.update(part.tree(f, m), outer_state, part.tree(f, a))
      a_new = [
        optax.apply_updates(a_, v.astype(a_.dtype)) for a_, v in zip(a, jax.tree.leaves(outer_u))
      ]
      return a_new, outer_new

    # Nothing is pending at the first sync: the anchor and the outer state stay put.
    a_new, outer_new = lax.cond(
      t > _first_sync(o, f), outer_step, lambda a, m, s: (a, s), a, m, outer_state
    )
    # θ_new = A_new + (θ_i + u_i - B_i): the update is (A_new - B_i) + u_i, no rounding of θ_i.
    u_new = [
      ((an.astype(_F32) - b_.astype(_F32)) + u_.astype(_F32)).astype(u_.dtype)
      for an, b_, u_ in zip(a_new, b, u)
    ]
    # The next round starts where optax.apply_updates puts the replica, bit for bit.
    b_new = [optax.apply_updates(p_, un) for p_, un in zip(p, u_new)]
    m_new = [x.astype(m_.dtype) for x, m_ in zip(jax.tree.leaves(mean), m)]
  match = lambda new, old: jax.tree.map(wrappers._match_varying, new, old)  # pylint: disable=protected-access
  return (
    match(u_new, u),
    match(a_new, a),
    match(b_new, b),
    match(m_new, m),
    match(outer_new, outer_state),
    match(ex_state_new, ex_state),
  )


def _stay_overlapped(t, u, a, p, b, m, outer_state, ex_state):
  """:func:`_stay` for ``overlap=True``: the round-start and pending pieces unchanged."""
  del t, p
  return u, a, b, m, outer_state, ex_state


def _joined(parts: list):
  """A leaf from its pieces, in row order."""
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _update(o: _Options, grads, state: DiLoCoState, params):
  """The inner step on this replica's gradient; each fragment due this step syncs."""
  if params is None:
    raise ValueError(
      "jc.diloco: update needs params (this replica's parameters): tx.update(grads, state, params)"
    )
  part = _split(o, params)
  if part.treedef != jax.tree.structure(state.anchor):
    raise ValueError(
      f"jc.diloco: params have tree {part.treedef}, but init saw {jax.tree.structure(state.anchor)}"
    )
  _check_update(o, grads, params)
  if o.fast_axis is not None:  # the node is the replica: its devices' mean gradient
    grads = collectives.pmean_tree(grads, o.fast_axis)
  inner_u, inner_state = o.inner.update(grads, state.inner_state, params)
  u_leaves = part.treedef.flatten_up_to(inner_u)
  if o.fast_axis is not None:  # typed like the parameters (per device, or per node)
    u_leaves = [wrappers._match_varying(u, p) for u, p in zip(u_leaves, part.leaves)]  # pylint: disable=protected-access
  a_leaves = part.treedef.flatten_up_to(state.anchor)
  if o.overlap:
    b_leaves = part.treedef.flatten_up_to(jax.tree.map(lambda x: x[0], state.round_start.inner))
    m_leaves = part.treedef.flatten_up_to(state.pending)
  else:
    b_leaves = m_leaves = [None] * len(a_leaves)
  t = state.count + 1
  out = [[] for _ in u_leaves]  # per leaf, its pieces' updates in row order
  new_anchor = [[] for _ in a_leaves]
  new_b, new_m = [[] for _ in a_leaves], [[] for _ in a_leaves]
  outer_states, exchange_states = [], []
  for f, pieces in enumerate(part.pieces):
    u, a, p = ([part.cut(xs, q) for q in pieces] for xs in (u_leaves, a_leaves, part.leaves))
    b, m = ([part.cut(xs, q) for q in pieces] if o.overlap else [] for xs in (b_leaves, m_leaves))
    o_f, e = state.outer_state[f], state.exchange_state[f]
    if pieces:  # an empty fragment (too few rows to go round) has nothing to sync
      due = (t - o.offsets[f]) % o.sync_every == 0
      if o.overlap:
        sync = functools.partial(_sync_overlapped, o, part, f)
        u, a, b, m, o_f, e = lax.cond(due, sync, _stay_overlapped, t, u, a, p, b, m, o_f, e)
      else:
        u, a, o_f, e = lax.cond(due, functools.partial(_sync, o, part, f), _stay, u, a, p, o_f, e)
    for q, u_, a_ in zip(pieces, u, a):
      out[q.leaf].append(u_)
      new_anchor[q.leaf].append(a_)
    for q, b_, m_ in zip(pieces, b, m):
      new_b[q.leaf].append(b_)
      new_m[q.leaf].append(m_)
    outer_states.append(o_f)
    exchange_states.append(e)
  overlapped = {}
  if o.overlap:
    round_start = part.treedef.unflatten([_joined(x)[None] for x in new_b])
    overlapped = dict(
      round_start=transforms.PerDeviceState(round_start),
      pending=part.treedef.unflatten([_joined(x) for x in new_m]),
    )
  new_state = DiLoCoState(
    count=t,
    anchor=part.treedef.unflatten([_joined(x) for x in new_anchor]),
    inner_state=inner_state,
    outer_state=tuple(outer_states),
    exchange_state=tuple(exchange_states),
    **overlapped,
  )
  return part.treedef.unflatten([_joined(x) for x in out]), new_state
