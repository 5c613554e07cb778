"""Two-level exchange: dense inside a node, compressed between nodes."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import hierarchy
from jaxcomp._src.methods import transforms
from jaxcomp._src.plumbing import treeutil


class TwoLevelState(NamedTuple):
  """State of :func:`two_level`: the wrapped exchange's state for this device's shards
  (1/L of each leaf), placed by the wrapper.

  What differs between all devices (error-feedback residuals, keys) sits in
  :class:`jaxcomp.PerDeviceState` wrappers (``P((slow, fast))`` under
  :func:`jaxcomp.state_specs`); what the devices of every node hold alike for their
  shard (1-bit Adam's moments, the same on every node after the slow exchange) in
  :class:`NodeShardState` (``P(fast)``).
  """

  inner: Any  # the wrapped exchange's state, its parts wrapped by where they live


@jax.tree_util.register_pytree_node_class
class NodeShardState:
  """State held once per shard of a node: every leaf with a leading axis of 1, placed
  ``P(axis)`` (one row per device of the fast axis, replicated over the slow one)."""

  __slots__ = ("inner", "axis")

  def __init__(self, inner, axis):
    self.inner = inner  # every leaf shape=(1, *shard state shape)
    self.axis = axis  # the fast mesh axis (static)

  def tree_flatten(self):
    return (self.inner,), self.axis

  @classmethod
  def tree_unflatten(cls, axis, children):
    return cls(children[0], axis)

  def __repr__(self):
    return f"NodeShardState({self.inner!r}, axis={self.axis!r})"


def _check_inner(tx, fast_axis, wrapper: str = "jc.two_level") -> transforms.ExchangeInfo:
  """The wrapped exchange's record; a clear error for one that cannot run on shards
  (``wrapper``: the name the errors give, ``jc.two_level`` or ``jc.hsdp``)."""
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"{wrapper} wraps a jaxcomp exchange, got {tx!r}")
  info = transforms.exchange_info(tx)
  if info is None:
    raise TypeError(
      f"{wrapper} wraps one jaxcomp exchange built with axis_name=<the slow axis> "
      "(jc.compress, jc.qsgd, jc.onebit_sgd, jc.ef_signsgd, jc.sparsify, jc.onebit_adam, "
      "jc.dgc, jc.powersgd), "
      "not a chain or another optax transform: it must know that the transform averages "
      f"over the slow axis. Chain the optimizer after {wrapper}(...)"
    )
  # PowerSGD runs a schedule of its own under jc.two_level (whole matrices, rows split
  # over the node); jc.hsdp hands tx shards and wants shards back, which that schedule
  # does not do.
  if info.shardable is not None and (info.two_level is None or wrapper != "jc.two_level"):
    raise NotImplementedError(f"{wrapper} does not support {info.who} yet: {info.shardable}")
  if info.collective == "reduce_scatter":
    raise ValueError(
      f"{wrapper}: {info.who} was built with collective='reduce_scatter', which returns "
      f"shards over the slow axis; the exchange over the slow axis must return the whole "
      f"mean of what it is given (use 'auto')"
    )
  axes = info.axis_name if isinstance(info.axis_name, (tuple, list)) else (info.axis_name,)
  if info.axis_name is None or fast_axis in axes:
    raise ValueError(
      f"{wrapper}(..., fast_axis={fast_axis!r}) needs an exchange built with "
      f"axis_name=<the slow axis>, another mesh axis; {info.who} has "
      f"axis_name={info.axis_name!r}"
    )
  return info


def _views(tree):
  """Stand-ins for the filter: the whole leaves' shapes and dtypes."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _fold_fast_index(state, fast_axis):
  """``state`` with the fast-axis index folded into its (scalar) typed keys.

  The wrapped exchange folds the slow-axis index into its keys; the L devices of a node
  would otherwise draw the same random bits for their different shards. Folding keeps
  the draws of a shard independent of its neighbours' and leaves what must be shared
  over the slow axis (``RandomK(shared=True)``'s indices) shared.
  """
  index = lax.axis_index(fast_axis)

  def fold(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) and x.ndim == 0:
      return jax.random.fold_in(x, index)
    return x

  return jax.tree.map(fold, state)


def _is_per_device(x) -> bool:
  return isinstance(x, transforms.PerDeviceState)


def _place(state, places_own: bool, fast_axis):
  """The inner state wrapped by where it lives (:class:`TwoLevelState`): all of it per
  device for an exchange that does not place its own state (the ``jc.compress``
  family); else its :class:`~jaxcomp.PerDeviceState` parts as they are and the rest
  (replicated over the slow axis) in :class:`NodeShardState`."""
  if not places_own:
    return transforms.PerDeviceState(jax.tree.map(lambda x: x[None], state))

  def one(x):
    return x if _is_per_device(x) else NodeShardState(x[None], fast_axis)

  return jax.tree.map(one, state, is_leaf=_is_per_device)


def _unplace(state, places_own: bool):
  """:func:`_place`'s inverse."""
  if not places_own:
    return jax.tree.map(lambda x: x[0], state.inner)

  def one(x):
    return x if _is_per_device(x) else jax.tree.map(lambda y: y[0], x.inner)

  return jax.tree.map(
    one, state, is_leaf=lambda x: _is_per_device(x) or isinstance(x, NodeShardState)
  )


def two_level(
  tx: optax.GradientTransformation, *, fast_axis: Any, same_in_node: bool = False
) -> optax.GradientTransformation:
  r"""Dense inside a node, compressed between nodes: ``tx`` runs on 1/L of the gradient.

  A cluster of N nodes with L devices each runs on a 2-D mesh ``(slow, fast)``: ``fast``
  the L devices of a node (NVLink, TPU ICI), ``slow`` the nodes (InfiniBand, Ethernet,
  DCN). ``tx`` is a jaxcomp exchange built with ``axis_name=<slow>``. Each ``update``

  1. takes the mean over ``fast_axis`` by a dense reduce-scatter: device f of a node
     keeps shard f of the node's mean of every leaf, ``(1/L) Σ_l g_{n,l}`` restricted
     to 1/L of the leaf (cut along the first axis when L divides it, else from the
     flattened leaf zero-padded to a multiple of L);
  2. runs ``tx`` on those shards over the slow axis: the devices f of all N nodes
     exchange shard f compressed, ``tx``'s mean over nodes of the node means;
  3. all-gathers the result over ``fast_axis``.

  The result is the mean over both axes (with ``tx``'s compression), replicated on every
  device. Over the slow link each device sends and receives ``tx``'s bytes for 1/L of
  the gradient, so a node moves about one compressed gradient; a flat exchange over all
  N·L devices moves about L per node (``docs/guides/two_level.md``). ``tx``'s state
  (error-feedback residuals included) is that of the shards, 1/L of the flat
  exchange's, and the wrapper places it (:class:`TwoLevelState`): per device, except
  what the devices of every node hold alike for a shard (1-bit Adam's moments), which
  is held once per shard (:class:`NodeShardState`, ``P(fast_axis)``).

  Which leaves ``tx`` compresses is decided from the whole leaves, as without the
  wrapper: ``tx``'s filter is asked about each original leaf's shape and dtype, not its
  shard's (a shard of a matrix may be a short vector, which the default filter would
  send dense). The codec's buckets and ``collective="auto"``'s route are the shard's.

  Under ``jax.shard_map`` over the ``(slow, fast)`` mesh, with ``check_vma`` on,
  differentiate with respect to ``jc.vary(params, (slow, fast))``; the state places
  itself, so :func:`jaxcomp.per_device_state` hands the wrapper back unchanged (wrap it
  as every other method) and :func:`jaxcomp.state_specs` takes both axes::

    tx = optax.chain(
        jc.per_device_state(jc.two_level(jc.qsgd(bits=4, axis_name="node"),
                                         fast_axis="gpu")),
        optax.adam(1e-3))
    specs = jc.state_specs(tx, params, axis_name=("node", "gpu"),
                           num_devices=mesh.size, mesh=mesh)

  Supported: the :func:`jaxcomp.compress` family (``jc.qsgd``, ``jc.onebit_sgd``,
  ``jc.ef_signsgd``, ``jc.sparsify``) with any collective but ``"reduce_scatter"``,
  :func:`jaxcomp.onebit_adam` (the optimizer, elementwise, on the shards: chain nothing
  after it), :func:`jaxcomp.dgc` (top-k per shard: the node is DGC's worker, clipped
  by the norm of its whole gradient) and :func:`jaxcomp.powersgd`, which runs a
  schedule of its own, flat PowerSGD over the slow axis of the node means with each
  matrix's rows split over the node's devices (``docs/guides/two_level.md``).
  :func:`jaxcomp.mipd` raises ``NotImplementedError`` saying why; other transforms (a
  chain, an optax transform) a ``TypeError``. ``init`` and ``update`` need both axes
  bound (a 2-D mesh under ``jax.shard_map``; ``jax.pmap`` maps one axis).

  ``same_in_node=True`` is for updates that are the same on every device of a node
  already (:func:`jaxcomp.diloco`'s pseudo-gradient with ``fast_axis``): step 1 is
  skipped, each device takes its shard of its own copy (no fast-axis collective before
  the slow exchange, and no rounding: the node's mean of L equal values is the value).

  Args:
    tx: a jaxcomp exchange built with ``axis_name`` the slow (between-node) axis.
    fast_axis: the mesh axis of the devices inside a node.
    same_in_node: the updates are equal on the devices of a node (not checked): take
      this device's shard instead of reduce-scattering over ``fast_axis``.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`TwoLevelState`.

  References:
    Sergeev, Del Balso. *Horovod: fast and easy distributed deep learning in
    TensorFlow* (hierarchical all-reduce). 2018. https://arxiv.org/abs/1802.05799

    Markov et al. *CGX: Adaptive System Support for Communication-Efficient Deep
    Learning*. Middleware 2022. https://arxiv.org/abs/2111.08617
  """
  info = _check_inner(tx, fast_axis)
  if info.two_level is not None:  # a schedule of its own (jc.powersgd's)
    return transforms.places_own_state(info.two_level(fast_axis))
  places_own = transforms.places_own(tx)

  def init_fn(params):
    shards = hierarchy.local_shards(params, fast_axis)
    with treeutil.leaf_views(_views(params)), hierarchy.shards_over(fast_axis):
      inner = tx.init(shards)
    return TwoLevelState(_place(_fold_fast_index(inner, fast_axis), places_own, fast_axis))

  def update_fn(updates, state, params=None):
    collectives.axis_size(fast_axis)  # a clear error where the axis is not bound
    for path, g in treeutil.flat(updates)[0]:
      treeutil.check_leaf(path, g)
      if not same_in_node:
        collectives.check_local(path, g, fast_axis)
    if same_in_node:
      shards = hierarchy.local_shards(updates, fast_axis)
    else:
      shards = hierarchy.node_shards(updates, fast_axis)
    local = None if params is None else hierarchy.local_shards(params, fast_axis)
    with treeutil.leaf_views(_views(updates)), hierarchy.shards_over(fast_axis):
      out, inner = tx.update(shards, _unplace(state.inner, places_own), local)
    new_state = TwoLevelState(_place(inner, places_own, fast_axis))
    return hierarchy.gather_shards(out, updates, fast_axis), new_state

  # The state is placed above (per device, or per shard of a node): jc.per_device_state
  # hands the wrapper back unchanged.
  return transforms.places_own_state(optax.GradientTransformation(init_fn, update_fn))
