"""HSDP: parameters sharded inside a node, replicated across nodes, the cross-node
gradient exchange compressed."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax
import optax

from jaxcomp._src.exchanges import collectives
from jaxcomp._src.exchanges import hierarchy
from jaxcomp._src.methods import transforms
from jaxcomp._src.methods import two_level
from jaxcomp._src.plumbing import treeutil

GRADS = ("shards", "full")

# two_level's placement of the wrapped exchange's state and its checks, shared as they are.
_check_inner = two_level._check_inner  # pylint: disable=protected-access
_fold_fast_index = two_level._fold_fast_index  # pylint: disable=protected-access
_place = two_level._place  # pylint: disable=protected-access
_unplace = two_level._unplace  # pylint: disable=protected-access

#: While :func:`recording_inits` runs: a list each :func:`hsdp` ``init`` appends its
#: ``grads`` to, so that :func:`jaxcomp.state_specs` can tell a chain that holds
#: parameters sharded over the fast axis from one that would average a shard as if it
#: were the whole parameter, and :func:`jaxcomp.wire_report` which gradients ``update``
#: takes. A context variable: traces on other threads do not interfere.
_INITS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
  "jaxcomp_hsdp_inits", default=None
)


@contextlib.contextmanager
def recording_inits():
  """Yields a list that gets the ``grads`` of every :func:`hsdp` ``init`` in the block."""
  log: list = []
  token = _INITS.set(log)
  try:
    yield log
  finally:
    _INITS.reset(token)


def _whole(shards, l: int):
  """Stand-ins for the filter: the whole weights of which ``shards`` are the rows that
  ``P(fast)`` gives one device, ``(L · d0, *rest)``."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((l * x.shape[0],) + tuple(x.shape[1:]), x.dtype), shards
  )


def _check_rows(tree, l: int, fast_axis, what: str) -> None:
  """A ``ValueError`` unless every leaf of ``tree`` can be cut into ``l`` row shards."""
  for path, x in treeutil.flat(tree)[0]:
    treeutil.check_leaf(path, x)
    if x.ndim == 0 or x.shape[0] % l:
      raise ValueError(
        f"jc.hsdp: {what} at {jax.tree_util.keystr(path)} has shape {x.shape}: HSDP "
        f"shards every leaf along its first axis over {fast_axis!r} ({l} devices), which "
        f"must divide it (as P({fast_axis!r}) and jc.fsdp_gather need). Reshape or pad "
        f"the leaf, or keep it out of the HSDP parameters (a replicated leaf goes "
        f"through jc.two_level)"
      )


def _check_like(grads, params, what: str) -> None:
  """A ``ValueError`` where a gradient shard is not shaped like its parameter shard."""
  if params is None:
    return
  for (path, g), (_, p) in zip(treeutil.flat(grads)[0], treeutil.flat(params)[0]):
    if tuple(g.shape) != tuple(p.shape):
      raise ValueError(
        f"jc.hsdp: the {what} at {jax.tree_util.keystr(path)} has shape {g.shape}, its "
        f"parameter shard {p.shape}: params are this device's shards (P(fast) rows)"
      )


def hsdp(tx: optax.GradientTransformation, *, fast_axis: Any, grads: str = "shards"):
  r"""HSDP: parameters sharded over ``fast_axis`` (FSDP inside a node), replicated over
  the nodes, whose gradient exchange between nodes is ``tx``, compressed.

  On a 2-D mesh ``(slow, fast)`` of N nodes of L devices, each parameter ``W`` of shape
  ``(d0, *rest)`` is held as L row shards ``W^{(f)}`` of ``(d0/L, *rest)``, placed
  ``P(fast)``: device f of every node holds shard f. This is
  :func:`jaxcomp.two_level` without its last step: the mean over the fast axis is a
  dense reduce-scatter, ``tx`` (built with ``axis_name=<slow>``) averages each shard
  over the nodes, compressed, and the result stays a shard,

  .. math::
    u^{(f)} = \mathrm{tx}_n\Big(\frac{1}{L} \sum_{l=1}^{L} g_{n,l}^{(f)}\Big)
    \approx \frac{1}{NL} \sum_{n,l} g_{n,l}^{(f)},

  the update of the parameter shard the device holds, for an optimizer chained after
  it on the shards (``optax.adam``'s moments then take 1/L of the model per device, the
  point of sharding). Two ways to get the gradient in, as ``grads`` says:

  * ``"shards"``: the weights are gathered per layer with ``w = jc.fsdp_gather(shard,
    axis_name=fast)``, whose backward reduce-scatters over the fast axis already: the
    gradient of a shard is the node's mean of that shard, and ``update`` takes those.
    Only ``tx``'s slow exchange remains (the fast collectives run in the backward).
  * ``"full"``: ``update`` takes each device's full-size local gradient (weights
    gathered by the user, or by XLA from a sharded array) and reduce-scatters it over
    the fast axis first, cut along the first axis into the rows ``P(fast)`` holds.

  Either way the leaves are cut along their first axis, which L must divide (a
  ``ValueError`` otherwise: unlike :func:`jaxcomp.two_level`, whose flattened, padded
  shards stay internal, HSDP's shards are the parameters' own layout). ``tx``'s filter
  is asked about each whole weight, ``(L·d0, *rest)``: a 64 × 32 matrix (2048 values)
  has shards of 16 × 32 on L = 4 devices, which the default filter (at least 1024
  values) would send dense, silently. ``tx``'s state is the shards' and placed as
  :func:`jaxcomp.two_level` places it (:class:`jaxcomp.TwoLevelState`: per device, or
  once per shard of a node).

  ``init`` and ``update`` run inside ``jax.shard_map`` over the ``(slow, fast)`` mesh
  and take the parameter shards (``in_specs`` ``P(fast)``; ``init`` cannot tell a whole
  replicated leaf from a shard, :func:`jaxcomp.state_specs` refuses the mix-up). With
  ``check_vma`` on, differentiate with respect to ``jc.vary(shards, slow)`` (they vary
  over ``fast`` already), so that JAX does not all-reduce the gradient densely over the
  nodes itself. :func:`jaxcomp.state_specs` and :func:`jaxcomp.wire_report` take
  ``axis_name=(slow, fast)`` and ``param_specs=P(fast)``::

    tx = optax.chain(jc.hsdp(jc.qsgd(bits=4, axis_name="node"), fast_axis="gpu"),
                     optax.adam(1e-3))
    specs = jc.state_specs(tx, params, axis_name=("node", "gpu"),
                           num_devices=mesh.size, mesh=mesh, param_specs=P("gpu"))

  A separate wrapper rather than a flag of :func:`jaxcomp.two_level`: the contract
  differs (its parameters, ``init``'s and ``update``'s, are shards, not the whole
  replicated leaves), and "HSDP" is the name FSDP users look for.

  Supported, as inside :func:`jaxcomp.two_level`: the :func:`jaxcomp.compress` family
  (``jc.qsgd``, ``jc.onebit_sgd``, ``jc.ef_signsgd``, ``jc.sparsify``) with any
  collective but ``"reduce_scatter"``, :func:`jaxcomp.dgc` (top-k per shard, the node
  its worker) and :func:`jaxcomp.onebit_adam` (the optimizer,
  elementwise, on the shards: chain nothing after it).

  Args:
    tx: a jaxcomp exchange built with ``axis_name`` the slow (between-node) axis.
    fast_axis: the mesh axis of the devices inside a node, the one the parameters are
      sharded over.
    grads: ``"shards"`` (``update`` takes the gradients of the shards, already the
      node's mean, as :func:`jaxcomp.fsdp_gather` returns them) or ``"full"`` (each
      device's full-size local gradient).

  Returns:
    An ``optax.GradientTransformation`` on the parameter shards, with state
    :class:`jaxcomp.TwoLevelState`; it places its own state
    (:func:`jaxcomp.per_device_state` hands it back unchanged).

  References:
    Zhao et al. *PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel*
    (hybrid sharding). VLDB 2023. https://arxiv.org/abs/2304.11277

    Wang et al. *ZeRO++: Extremely Efficient Collective Communication for Giant Model
    Training* (hierarchical partitioning, qgZ). 2023. https://arxiv.org/abs/2306.10209
  """
  if grads not in GRADS:
    raise ValueError(f"jc.hsdp: grads must be 'shards' or 'full', got {grads!r}")
  _check_inner(tx, fast_axis, "jc.hsdp")
  places_own = transforms.places_own(tx)

  def init_fn(params):
    l = collectives.axis_size(fast_axis)
    _check_rows(params, 1, fast_axis, "a parameter shard")
    log = _INITS.get()
    if log is not None:
      log.append(grads)
    with treeutil.leaf_views(_whole(params, l)), hierarchy.shards_over(fast_axis):
      inner = tx.init(params)
    inner = _fold_fast_index(inner, fast_axis)
    return two_level.TwoLevelState(_place(inner, places_own, fast_axis))

  def update_fn(updates, state, params=None):
    l = collectives.axis_size(fast_axis)  # a clear error where the axis is not bound
    for path, g in treeutil.flat(updates)[0]:
      treeutil.check_leaf(path, g)
      collectives.check_local(path, g, fast_axis)
    if grads == "full":
      _check_rows(updates, l, fast_axis, "the gradient")
      shards = hierarchy.node_shards(updates, fast_axis)
    else:
      shards = updates
    _check_like(shards, params, "gradient shard" if grads == "shards" else "gradient's shard")
    inner = _unplace(state.inner, places_own)
    with treeutil.leaf_views(_whole(shards, l)), hierarchy.shards_over(fast_axis):
      out, inner = tx.update(shards, inner, params)
    return out, two_level.TwoLevelState(_place(inner, places_own, fast_axis))

  # The state is placed above: jc.per_device_state hands the wrapper back unchanged.
  return transforms.places_own_state(optax.GradientTransformation(init_fn, update_fn))
