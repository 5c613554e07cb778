"""The fast-axis half of a two-level exchange: shards of a node's mean, and back.

A cluster has L devices per node on a fast link (NVLink, TPU ICI) and nodes on a slow
one. :func:`jaxcomp.two_level` averages inside the node by a dense reduce-scatter over
the fast axis (:func:`node_shards`: device f of the node gets the node's mean of shard
f of every leaf), hands the shards to a compressed exchange over the slow axis, and
all-gathers the result over the fast axis (:func:`gather_shards`). Only the middle step
crosses the slow link, with 1/L of each leaf per device, so a node sends about one
compressed gradient instead of L.

A leaf's shard is cut so that no copy is needed where it can be avoided: along the first
axis when L divides it (``(d0/L, *rest)``, the rows ``P(fast)`` would give device f),
else from the flattened leaf padded with zeros to a multiple of L (``(ceil(n/L),)``).
The padding is averaged as zeros and dropped after the gather.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.exchanges import collectives

Array = jax.Array


def shard_shape(shape, l: int) -> tuple[int, ...]:
  """The shape of one of the ``l`` shards of a leaf of ``shape``: ``(d0/l, *rest)``
  when ``l`` divides the first axis, else ``(ceil(n/l),)`` of the flattened leaf."""
  shape = tuple(int(d) for d in shape)
  if shape and shape[0] % l == 0:
    return (shape[0] // l,) + shape[1:]
  n = int(np.prod(shape, dtype=np.int64))
  return (-(-n // l),)


def _rows(x: Array, l: int) -> Array:
  """``x`` as its ``l`` shards stacked on a new first axis, ``(l, *shard_shape)``
  (zero-padded where the shards are cut from the flattened leaf)."""
  shard = shard_shape(x.shape, l)
  size = int(np.prod(shard, dtype=np.int64))
  flat = x.reshape(-1)
  if size * l != flat.size:
    flat = jnp.pad(flat, (0, size * l - flat.size))
  return flat.reshape((l,) + shard)


def local_shards(tree, axis_name):
  """This device's shard of every leaf of ``tree`` (no communication): shard
  ``lax.axis_index(axis_name)``, as :func:`node_shards` would hand it the mean of."""
  l = collectives.axis_size(axis_name)
  index = lax.axis_index(axis_name)
  return jax.tree.map(lambda x: _rows(jnp.asarray(x), l)[index], tree)


def node_shards(tree, axis_name):
  """The mean over ``axis_name`` of every leaf of ``tree``, this device's shard of it.

  One dense ``psum_scatter`` per dtype for all leaves
  (:func:`collectives.psum_scatter_tree`); per device ``(L-1)/L`` of the leaves' bytes
  over the fast link, half an all-reduce's. Sums in the leaves' dtype, as ``lax.pmean``.
  """
  l = collectives.axis_size(axis_name)

  def stacked(x):
    rows = _rows(x, l)  # (l, *shard): at least 2-D
    return rows.reshape((l * rows.shape[1],) + rows.shape[2:])

  return collectives.psum_scatter_tree(jax.tree.map(stacked, tree), axis_name)


def gather_shards(shards, like, axis_name):
  """The leaves of ``like`` (shapes and dtypes) reassembled from every device's shard
  over ``axis_name``: one all-gather for all leaves (:func:`collectives.gather_tree`),
  the padding dropped. The result is typed invariant over ``axis_name``."""
  gathered = collectives.gather_tree(shards, axis_name)

  def whole(g, x):
    n = int(np.prod(np.shape(x), dtype=np.int64))
    return g.reshape(-1)[:n].reshape(np.shape(x)).astype(x.dtype)

  return jax.tree.map(whole, gathered, like)


#: While :func:`shards_over` runs: the mesh axis over which the arrays a transform is
#: given are the shards of whole leaves. A context variable: traces on other threads do
#: not see it.
_SHARD_AXIS: contextvars.ContextVar = contextvars.ContextVar("jaxcomp_shard_axis", default=None)


@contextlib.contextmanager
def shards_over(axis_name):
  """Inside the block, :func:`sum_over_shards` sums over ``axis_name``: the wrapped
  transform runs on shards of each leaf cut over that axis (:func:`jaxcomp.two_level`,
  :func:`jaxcomp.hsdp`), and a quantity of the whole leaf, such as DGC's clipping norm,
  is the sum of its shards' parts."""
  token = _SHARD_AXIS.set(axis_name)
  try:
    yield
  finally:
    _SHARD_AXIS.reset(token)


def sum_over_shards(x: Array) -> Array:
  """``x``, a sum over this device's shards, summed over every shard of the leaves
  (``lax.psum`` over :func:`shards_over`'s axis; ``x`` itself outside it). Zero padding
  adds nothing to a sum of squares."""
  axis = _SHARD_AXIS.get()
  return x if axis is None else lax.psum(x, axis)
