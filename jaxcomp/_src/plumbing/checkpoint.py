"""Checkpointing helpers: typed PRNG keys as raw data, sharded abstract restore targets.

A jaxcomp state holds typed PRNG keys (``jax.random.key``), ``optax.MaskedNode()``
leaves and, under ``jax.shard_map``, per-device leaves with a leading device axis. A
checkpointer sees plain arrays once :func:`unwrap_keys` has replaced each key by its
``jax.random.key_data`` (not every Orbax release restores a typed key, and other
serializers take none); :func:`wrap_keys` rebuilds the keys with the implementation of
the restore target's keys. :func:`restore_target` gives that target: the state's shapes
and dtypes with the ``NamedSharding`` of each leaf, so the restored arrays land on the
mesh as ``init`` would have placed them, per-device residuals split over the data axis.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax


def _is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _key_data_sharding(sharding: Any, extra_dims: int) -> Any:
  """The sharding of a key array's raw data: the key's, with the trailing data axes
  (``jax.random.key_data`` appends them) unsharded."""
  if isinstance(sharding, NamedSharding):
    return NamedSharding(
      sharding.mesh, P(*sharding.spec, *(None,) * extra_dims), memory_kind=sharding.memory_kind
    )
  return sharding  # None, or single-device: valid for any rank


def unwrap_keys(tree: Any) -> Any:
  """Replaces every typed PRNG key in ``tree`` by its raw key data (``uint32``).

  Works on arrays and on ``jax.ShapeDtypeStruct`` (an abstract restore target): an
  abstract key becomes the abstract key data, sharded like the key along its axes.
  Other leaves, and empty nodes such as ``optax.MaskedNode()``, are kept as they are.

  Args:
    tree: a pytree, e.g. ``{"params": params, "opt_state": opt_state}``.

  Returns:
    ``tree`` with no typed keys: what a checkpointer saves, or restores into.

  Example:
    >>> import jax, jaxcomp as jc
    >>> state = {"key": jax.random.key(0), "count": jax.numpy.zeros((), "int32")}
    >>> jc.unwrap_keys(state)["key"].dtype
    dtype('uint32')
    >>> back = jc.wrap_keys(jc.unwrap_keys(state), state)
    >>> bool((jax.random.key_data(back["key"]) == jax.random.key_data(state["key"])).all())
    True
  """

  def unwrap(x):
    if not _is_key(x):
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
      sharding = _key_data_sharding(x.sharding, data.ndim - len(x.shape))
      return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.random.key_data(x)

  return jax.tree.map(unwrap, tree)


def _key_impl(like: Any) -> Any:
  """``jax.random.key_impl`` of a key array or of an abstract one (traced to get it)."""
  if not isinstance(like, jax.ShapeDtypeStruct):
    return jax.random.key_impl(like)
  found = []

  def probe(k):
    found.append(jax.random.key_impl(k))
    return k

  jax.eval_shape(probe, jax.ShapeDtypeStruct(like.shape, like.dtype))
  return found[0]


def wrap_keys(tree: Any, like: Any) -> Any:
  """Inverse of :func:`unwrap_keys`: rebuilds the typed keys of ``like`` in ``tree``.

  Where ``like`` has a typed key (array or ``jax.ShapeDtypeStruct``), the leaf of
  ``tree`` (its raw data, e.g. as restored from a checkpoint) is wrapped with
  ``jax.random.wrap_key_data`` using ``like``'s implementation (threefry, rbg, ...),
  so the restored keys draw the same bits as the saved ones.

  Args:
    tree: a pytree from :func:`unwrap_keys` (or restored from its checkpoint).
    like: a pytree of the same structure with the typed keys, e.g. the restore target.

  Returns:
    ``tree`` with typed keys where ``like`` has them.
  """

  def wrap(x, ref):
    return jax.random.wrap_key_data(x, impl=_key_impl(ref)) if _is_key(ref) else x

  return jax.tree.map(wrap, tree, like)


def restore_target(
  tx: optax.GradientTransformation,
  params: Any,
  *,
  mesh: jax.sharding.Mesh,
  specs: Any,
  param_specs: Any = None,
) -> Any:
  """Abstract ``tx`` state to restore a checkpoint into: shapes, dtypes and shardings.

  ``tx.init`` is traced (not run) inside ``jax.shard_map`` with ``out_specs=specs``, as
  a training loop initialises the state, and every leaf gets
  ``NamedSharding(mesh, spec)``: leaves of a :func:`jaxcomp.per_device_state` come
  back split over the data axis, one row per device, the rest replicated. (The
  shardings ``jax.eval_shape`` reports refer to an abstract mesh, which a checkpointer
  cannot place arrays on.) Typed keys stay typed: pass the target through
  :func:`unwrap_keys` for the checkpointer, and to :func:`wrap_keys` after it.

  Args:
    tx: the optax transformation whose state was saved.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``), as passed to ``init``.
    mesh: the mesh to place the restored state on.
    specs: the state's ``PartitionSpec`` pytree (:func:`jaxcomp.state_specs`).
    param_specs: the parameters' ``PartitionSpec`` pytree for tensor-parallel weights,
      as given to :func:`jaxcomp.state_specs` (``None``: replicated parameters). ``init``
      is traced on each device's shard, as the training loop runs it.

  Returns:
    A pytree of ``jax.ShapeDtypeStruct`` with the structure of ``tx.init(params)``.
  """
  if param_specs is None:
    param_specs = jax.tree.map(lambda _: P(), params)
  # Stand-ins placed as the loop places the parameters: on an Explicit mesh shard_map
  # checks that its inputs' shardings match in_specs.
  stand_ins = jax.tree.map(
    lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
    params,
    param_specs,
  )
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=(param_specs,), out_specs=specs)
  shapes = jax.eval_shape(init, stand_ins)
  return jax.tree.map(
    lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
    shapes,
    specs,
  )
