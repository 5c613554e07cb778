"""Tree helpers shared by the transforms: leaf records and the gradient-vs-init check."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def flat(tree):
  """``(path, leaf)`` pairs and the treedef of ``tree``."""
  return jax.tree_util.tree_flatten_with_path(tree)


def check_leaf(path, leaf, what: str = "jaxcomp transforms need floating-point gradients") -> None:
  """Raises a ``TypeError`` naming ``path`` unless ``leaf`` has a floating dtype.

  Codecs, residuals and means are floating-point arithmetic; an integer or boolean leaf
  would be silently truncated, so it is refused at ``init`` and ``update`` alike.
  """
  dtype = getattr(leaf, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{what}; the leaf at {jax.tree_util.keystr(path)} has dtype {dtype}")


def default_filter(path: tuple, leaf) -> bool:
  """Compress leaves with at least 1024 elements and at least 2 dimensions.

  Biases, norms' scales and small tensors go through a dense ``pmean`` (or, under
  :func:`jaxcomp.fsdp_gather` and :func:`jaxcomp.gather_weights`, a dense gather and
  reduce-scatter): they are a negligible share of the bytes, the most sensitive to
  quantization, and a payload's per-block scales would cost more than they save. The thresholds
  are jaxcomp's choice, the default of every method; the papers each draw the line
  their own way:

  * QSGD (Alistarh et al., §5) leaves tensors of fewer than 10K values unquantized,
    whatever their rank; ``filter=lambda path, leaf: leaf.size >= 10_000`` does the same;
  * DGC's reference code (Lin et al.) compresses the tensors of more than one dimension
    and sends the others dense, whatever their size;
  * 1-bit SGD (Seide et al., §3) quantizes the models' gradient matrices, column by
    column, and sets no size threshold;
  * EF-signSGD (Karimireddy et al., Algorithm 1) compresses the whole gradient.

  Args:
    path: the leaf's key path (unused).
    leaf: the gradient leaf, or an array-like with its shape (only ``ndim`` and ``size``
      are read; the FSDP gathers pass the full weight's shape, not the shard's).

  Returns:
    Whether the leaf is compressed.
  """
  del path
  return leaf.ndim >= 2 and leaf.size >= 1024


#: While :func:`leaf_views` runs: ``{keystr(path): stand-in}``, the leaves a filter is
#: asked about in place of the arrays a transform holds. A context variable, not a module
#: global: traces on other threads do not see it.
_LEAF_VIEWS: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
  "jaxcomp_leaf_views", default=None
)


@contextlib.contextmanager
def leaf_views(tree):
  """Inside the block, :func:`selected` asks a filter about the leaf of ``tree`` at the
  same path (e.g. a ``jax.ShapeDtypeStruct`` of the whole parameter) instead of the
  array the transform holds.

  :func:`jaxcomp.two_level` runs a transform on 1/L shards of each leaf, flat vectors
  when L does not divide the first axis: asked about a shard, the default filter would
  send every such leaf dense (fewer than 2 dimensions), silently. The filter must decide
  from the original leaf's shape, as it would without the wrapper.
  """
  views = {jax.tree_util.keystr(path): leaf for path, leaf in flat(tree)[0]}
  token = _LEAF_VIEWS.set(views)
  try:
    yield
  finally:
    _LEAF_VIEWS.reset(token)


def selected(filter_fn, path, leaf) -> bool:
  """``filter_fn(path, leaf)`` as a Python bool.

  The choice decides the state's structure and which collectives are traced, so it
  must be static: a traced answer is a ``TypeError`` rather than a tracer leak. Inside
  :func:`leaf_views` the filter is asked about the stand-in at ``path``.
  """
  views = _LEAF_VIEWS.get()
  if views is not None:
    leaf = views.get(jax.tree_util.keystr(path), leaf)
  chosen = filter_fn(path, leaf)
  if isinstance(chosen, jax.core.Tracer):
    raise TypeError(
      "filter must decide from the leaf's path, shape and dtype only (it returned a traced value)"
    )
  return bool(chosen)


@jax.tree_util.register_pytree_node_class
class LeafShapes:
  """The shapes and dtypes of the leaves ``init`` saw, as a pytree node with no leaves.

  Held in a transform's state so that ``update`` can tell a gradient that does not
  match the parameters (a different shape, dtype or set of keys) from one that does:
  without it a leaf of another shape would be averaged against a stale residual, or
  broadcast into one, silently. It carries no arrays (the record is static pytree
  metadata), so it costs nothing on the device, needs no sharding, and a checkpoint
  restored into ``init``'s structure brings it back unchanged.
  """

  __slots__ = ("paths", "shapes", "dtypes")

  def __init__(self, paths: tuple, shapes: tuple, dtypes: tuple):
    self.paths = paths
    self.shapes = shapes
    self.dtypes = dtypes

  @classmethod
  def of(cls, tree) -> LeafShapes:
    leaves, _ = flat(tree)
    return cls(
      tuple(p for p, _ in leaves),
      tuple(tuple(int(d) for d in np.shape(x)) for _, x in leaves),
      tuple(str(jax.numpy.result_type(x)) for _, x in leaves),
    )

  def tree_flatten(self):
    return (), (self.paths, self.shapes, self.dtypes)

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    return cls(*aux)

  def __eq__(self, other):
    return isinstance(other, LeafShapes) and (
      (self.paths, self.shapes, self.dtypes) == (other.paths, other.shapes, other.dtypes)
    )

  def __hash__(self):
    return hash((self.paths, self.shapes, self.dtypes))

  def __repr__(self):
    return f"LeafShapes({len(self.paths)} leaves)"

  def check(self, updates: Any, who: str) -> None:
    """Raises ``ValueError`` unless ``updates`` has ``init``'s keys, shapes and dtypes.

    The message names the leaf path and both shapes (or dtypes), or which keys only the
    gradient has and which only the parameters had.
    """
    got = LeafShapes.of(updates)
    if got.paths != self.paths:
      keystr = jax.tree_util.keystr
      extra = [keystr(p) for p in got.paths if p not in set(self.paths)]
      missing = [keystr(p) for p in self.paths if p not in set(got.paths)]
      parts = []
      if extra:
        parts.append(
          f"the gradient has {', '.join(extra)}, which the parameters given to init did not have"
        )
      if missing:
        parts.append(
          f"the parameters given to init had {', '.join(missing)}, which the gradient lacks"
        )
      if not parts:
        parts.append("the leaves come in another order or nesting")
      raise ValueError(
        f"{who}: the gradient's tree does not match init's: " + "; ".join(parts) + "."
      )
    for path, want, have, want_t, have_t in zip(
      self.paths, self.shapes, got.shapes, self.dtypes, got.dtypes
    ):
      if want != have:
        raise ValueError(
          f"{who}: the gradient at {jax.tree_util.keystr(path)} has shape {have}, but "
          f"init saw shape {want} there; pass gradients shaped like the parameters "
          f"the state was initialised with."
        )
      if want_t != have_t:
        raise ValueError(
          f"{who}: the gradient at {jax.tree_util.keystr(path)} has dtype {have_t}, but "
          f"init saw dtype {want_t} there; cast the gradient (or re-initialise the "
          f"state for the new dtype)."
        )


def mark_nonfinite(x: jax.Array, finite: jax.Array) -> jax.Array:
  """``x`` with its first entry set to NaN where ``finite`` is false (O(1), no pass).

  For outputs that stand in for a mean the devices agreed was non-finite but that do
  not carry the NaN themselves (a prediction sent in place of an exchanged layer): the
  mean must stay visibly non-finite, on every device alike.
  """
  if x.size == 0:
    return x
  first = x.reshape(-1)[0]
  nan = jnp.asarray(jnp.nan, x.dtype)
  return x.reshape(-1).at[0].set(jnp.where(finite, first, nan)).reshape(x.shape)
