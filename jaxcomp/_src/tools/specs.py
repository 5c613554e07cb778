"""Where an optimizer state lives on a mesh: the ``PartitionSpec``\\ s of ``tx.init``."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from jaxcomp._src.exchanges import pipeline
from jaxcomp._src.methods import hsdp
from jaxcomp._src.methods import transforms
from jaxcomp._src.methods.transforms import PerDeviceState
from jaxcomp._src.methods.two_level import NodeShardState
from jaxcomp._src.plumbing import treeutil


def _names(axis) -> tuple:
  if axis is None:
    return ()
  return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def _spec_axes(spec: P) -> tuple:
  """The mesh axes a ``PartitionSpec`` names, in order."""
  out = []
  for entry in spec:
    for name in _names(entry):
      if name not in out:
        out.append(name)
  return tuple(out)


def _is_spec(x) -> bool:
  return x is None or isinstance(x, P)


def _param_specs(params, param_specs, axis_name) -> list:
  """The flat list of ``PartitionSpec``\\ s of ``params`` (validated).

  The data axis may shard a leaf along its first dimension only, alone (``P(axis_name,
  ...)``: the shards of a reduce-scatter, :func:`_check_takes_shards`).
  """
  leaves, _ = treeutil.flat(params)
  if param_specs is None:
    return [P()] * len(leaves)
  specs = pipeline.leaf_specs(param_specs, params)
  out = []
  for (path, leaf), spec in zip(leaves, specs):
    spec = P() if spec is None else spec
    if not isinstance(spec, P):
      raise TypeError(
        f"param_specs at {jax.tree_util.keystr(path)} must be a PartitionSpec, got {spec!r}"
      )
    if len(spec) > np.ndim(leaf):
      raise ValueError(
        f"param_specs at {jax.tree_util.keystr(path)}: {spec} has more "
        f"entries than the leaf has dimensions ({np.shape(leaf)})"
      )
    clash = set(_spec_axes(spec)) & set(_names(axis_name))
    # Along the first dimension: all the data axes (a reduce-scatter's shards), or the
    # fast one of two (HSDP's shards, fast_sharded).
    first = _names(spec[0]) if len(spec) else ()
    if clash and (
      (first != _names(axis_name) and not fast_sharded(spec, axis_name))
      or clash & set(_spec_axes(P(*spec[1:])))
    ):
      raise ValueError(
        f"param_specs at {jax.tree_util.keystr(path)} shards over {sorted(clash)}, the "
        f"data axis, other than along the first dimension alone: parameters sharded "
        f"over the data axis are P({axis_name!r}, ...) (a reduce-scatter's shards), or "
        f"for axis_name=(slow, fast), P(fast, ...) (jc.hsdp's shards); shard them over "
        f"the other mesh axes otherwise"
      )
    out.append(spec)
  return out


def data_sharded(spec: P, axis_name) -> bool:
  """Whether ``spec`` shards its leaf over the data axis (along the first dimension)."""
  return len(spec) > 0 and _names(spec[0]) == _names(axis_name)


def hsdp_axes(axis_name) -> tuple:
  """``(slow, fast)`` of a :func:`jaxcomp.hsdp` exchange's ``axis_name=(slow, fast)``."""
  names = _names(axis_name)
  if len(names) != 2:
    raise ValueError(f"a jc.hsdp exchange takes axis_name=(slow, fast), got {axis_name!r}")
  return names


def fast_sharded(spec: P, axis_name) -> bool:
  """Whether ``spec`` shards its leaf over the last (fast) of two or more data axes
  alone, along the first dimension: :func:`jaxcomp.hsdp`'s parameter shards."""
  names = _names(axis_name)
  return len(names) > 1 and len(spec) > 0 and _names(spec[0]) == names[-1:]


def _check_takes_shards(tx, params, layout, axis_name, takes_shards: bool | None = None):
  """``tx.init`` traced; a ``ValueError`` when ``param_specs`` shard leaves over the data
  axis but no transform of ``tx`` takes shards (a ``collective="reduce_scatter"``
  exchange): an all-gather or two-phase exchange would average each shard as if it were
  the whole parameter; and when one does but ``param_specs`` shard nothing over it.
  ``takes_shards=True`` declares a chain that takes shards through an exchange of its
  own (``lax.psum_scatter``, or none in ``tx`` for FSDP), which cannot be detected."""
  return trace_state(tx, params, layout, axis_name, takes_shards)[0]


def trace_state(tx, params, layout, axis_name, takes_shards: bool | None = None):
  """:func:`_check_takes_shards`'s checks, and ``(state, grads)``: ``grads`` the
  ``grads=`` of the :func:`jaxcomp.hsdp` in ``tx`` (``None`` without one)."""
  if takes_shards not in (None, True, False):
    raise ValueError(f"takes_shards must be None, True or False, got {takes_shards!r}")
  with transforms.recording_shard_inits() as log, hsdp.recording_inits() as hsdp_log:
    state = _trace_init(tx, params, layout)
  _check_hsdp(params, layout, axis_name, hsdp_log)
  sharded = [
    jax.tree_util.keystr(path)
    for (path, _), spec in zip(treeutil.flat(params)[0], layout.specs)
    if data_sharded(spec, axis_name)
  ]
  if takes_shards is False and log:
    raise ValueError(
      "takes_shards=False, but a transform of tx takes parameter shards "
      "(collective='reduce_scatter')"
    )
  took = bool(log) or bool(takes_shards)
  if took and not sharded:
    raise ValueError(
      f"tx takes parameter shards (collective='reduce_scatter' or takes_shards=True) but "
      f"param_specs shard no leaf over the data axis {axis_name!r}: pass param_specs as "
      f"given to shard_map's in_specs (e.g. P({axis_name!r}) for every leaf)"
    )
  if sharded and not took:
    raise ValueError(
      f"param_specs shard {', '.join(sharded)} over the data axis {axis_name!r}, but no "
      f"transform of tx takes shards: only collective='reduce_scatter' returns this "
      f"device's shard of the mean; replicate data-parallel parameters over the data "
      f"axis otherwise, or pass takes_shards=True for a chain whose own exchange does "
      f"(a lax.psum_scatter, or FSDP's inside the backward)"
    )
  return state, (hsdp_log[0] if hsdp_log else None)


def _check_hsdp(params, layout, axis_name, log: list) -> None:
  """A ``ValueError`` when ``param_specs`` shard leaves over the fast axis alone but no
  :func:`jaxcomp.hsdp` takes them (another exchange would average each shard as if it
  were the whole parameter), or the reverse, or when an hsdp's leaves are not all so."""
  leaves = [jax.tree_util.keystr(path) for path, _ in treeutil.flat(params)[0]]
  fast = [p for p, spec in zip(leaves, layout.specs) if fast_sharded(spec, axis_name)]
  if fast and not log:
    raise ValueError(
      f"param_specs shard {', '.join(fast)} over {_names(axis_name)[-1]!r} alone, but no "
      f"jc.hsdp in tx takes such shards: another exchange would average each shard as "
      f"if it were the whole parameter (wrap the exchange in jc.hsdp)"
    )
  if log and len(fast) != len(leaves):
    rest = [p for p in leaves if p not in fast]
    raise ValueError(
      f"tx holds its parameters as jc.hsdp shards, but param_specs do not shard "
      f"{', '.join(rest)} as P({_names(axis_name)[-1]!r}, ...): pass param_specs as "
      f"given to shard_map's in_specs (every leaf P(fast)), with axis_name=(slow, fast)"
    )


def _axis_sizes(params, other: tuple, mesh) -> dict:
  """Sizes of the mesh axes ``other``: from ``mesh``, the params' shardings, or the
  mesh set with ``jax.set_mesh``."""
  candidates = []
  if mesh is not None:
    candidates.append(dict(mesh.shape))
  for leaf in jax.tree.leaves(params):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.NamedSharding):
      candidates.append(dict(sharding.mesh.shape))
      break
  ambient = jax.sharding.get_abstract_mesh()
  if ambient is not None and not getattr(ambient, "empty", False) and ambient.axis_names:
    candidates.append(dict(ambient.shape))
  for sizes in candidates:
    if all(a in sizes for a in other):
      return sizes
  raise ValueError(
    f"param_specs shard the parameters over {list(other)}: pass mesh=... (or params "
    f"placed with a NamedSharding on that mesh, or set it with jax.set_mesh) so that "
    f"the state can be traced with each device's shard shapes"
  )


def abstract_state(
  tx: optax.GradientTransformation,
  params,
  *,
  axis_name,
  num_devices: int,
  param_specs=None,
  mesh=None,
  takes_shards: bool | None = None,
):
  """Shapes and dtypes of ``tx.init(params)`` traced inside ``jax.shard_map``.

  The trace runs over an abstract mesh (no devices needed): ``axis_name`` of
  ``num_devices`` devices, plus the axes ``param_specs`` shard the parameters over, so
  the state is traced with the shapes of one device's shards, as ``init`` sees them
  under ``shard_map(tx.init, in_specs=(param_specs,))``. ``params`` may hold arrays or
  ``jax.ShapeDtypeStruct``. The result is one device's (local) state.
  """
  layout = mesh_layout(params, param_specs, axis_name, num_devices, mesh)
  return _check_takes_shards(tx, params, layout, axis_name, takes_shards)


class _Layout(NamedTuple):
  specs: list  # a PartitionSpec per parameter leaf
  mesh: Any  # the AbstractMesh the state is traced over
  local: list  # each parameter's shard shape
  full: list  # each parameter's local gradient shape (not cut over the data axis)


def mesh_layout(params, param_specs, axis_name, num_devices, mesh) -> _Layout:
  """The parameters' specs, validated, and the abstract mesh to trace over."""
  specs = _param_specs(params, param_specs, axis_name)
  data = _names(axis_name)
  if not data or len(set(data)) != len(data):
    raise ValueError(f"axis_name must name one mesh axis or a tuple of them, got {axis_name!r}")
  if (
    isinstance(num_devices, bool)
    or not isinstance(num_devices, (int, np.integer))
    or (num_devices < 1)
  ):
    raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
  other = tuple(dict.fromkeys(a for s in specs for a in _spec_axes(s) if a not in data))
  sizes = _data_sizes(params, data, other, num_devices, mesh)
  amesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in data + other), data + other)
  local, full = [], []
  for (path, leaf), spec in zip(treeutil.flat(params)[0], specs):
    for dim, entry in enumerate(spec):
      parts = int(np.prod([sizes[a] for a in _names(entry)])) if entry is not None else 1
      if np.shape(leaf)[dim] % parts:
        raise ValueError(
          f"param at {jax.tree_util.keystr(path)}: dimension {dim} of shape "
          f"{np.shape(leaf)} does not divide over {entry} ({parts} shards)"
        )
    local.append(_local_shape(np.shape(leaf), spec, sizes))
    full.append(_local_shape(np.shape(leaf), without(spec, axis_name), sizes))
  return _Layout(specs, amesh, local, full)


def _data_sizes(params, data: tuple, other: tuple, num_devices: int, mesh) -> dict:
  """Sizes of the data axes ``data`` and the other axes ``other``; a ``ValueError``
  where ``num_devices`` is not the data axes' device count on the mesh.

  With one data axis its size is ``num_devices``; with several (a two-level exchange
  over ``(slow, fast)``) their sizes come from the mesh, and their product must be
  ``num_devices``.
  """
  sizes = {}
  if other or mesh is not None or len(data) > 1:
    need = other + (data if len(data) > 1 else ())
    sizes = _axis_sizes(params, need, mesh) if need else dict(mesh.shape)
  if len(data) == 1:
    if data[0] in sizes and sizes[data[0]] != num_devices:
      raise ValueError(
        f"num_devices={num_devices} but the mesh's axis {data[0]!r} has "
        f"{sizes[data[0]]} devices: pass num_devices=mesh.shape[{data[0]!r}]"
      )
    return {**sizes, data[0]: int(num_devices)}
  total = int(np.prod([sizes[a] for a in data]))
  if total != num_devices:
    raise ValueError(
      f"num_devices={num_devices} but the mesh's axes {data} have {total} devices "
      f"together: pass num_devices={total}"
    )
  return sizes


def without(spec: P, axis) -> P:
  """``spec`` with ``axis`` (a mesh axis or a tuple of them) left out of every entry."""
  entries = []
  for entry in spec:
    names = tuple(a for a in _names(entry) if a not in _names(axis))
    entries.append(None if not names else names[0] if len(names) == 1 else names)
  return P(*entries)


def _trace_init(tx, params, layout: _Layout):
  leaves, treedef = treeutil.flat(params)
  # Each stand-in carries its spec's sharding: on a mesh whose axes are Explicit (the
  # default of AbstractMesh in newer jax) shard_map checks that its inputs are sharded
  # as in_specs say, and an unsharded stand-in would be refused.
  shapes = treedef.unflatten(
    [
      jax.ShapeDtypeStruct(
        np.shape(x), jnp.result_type(x), sharding=jax.NamedSharding(layout.mesh, spec)
      )
      for (_, x), spec in zip(leaves, layout.specs)
    ]
  )
  init = jax.shard_map(
    tx.init,
    mesh=layout.mesh,
    in_specs=(treedef.unflatten(layout.specs),),
    out_specs=P(),
    check_vma=False,
  )
  return jax.eval_shape(init, shapes)


def _local_shape(shape, spec, sizes) -> tuple:
  out = list(shape)
  for dim, entry in enumerate(spec):
    if entry is not None:
      out[dim] //= int(np.prod([sizes[a] for a in _names(entry)]))
  return tuple(out)


def _leaf_spec(
  layout: _Layout, axis_name, single: bool, x, where: str, per_device: bool, local: bool, param
) -> P:
  """The spec of one state leaf ``x`` (see :func:`state_specs`): ``param`` is the index
  of the parameter it belongs to, or None; ``per_device`` inside a per_device_state;
  ``local`` for accumulated local gradients."""
  specs, locals_ = layout.specs, layout.local
  shape = tuple(x.shape)
  if param is None and single and shape in (locals_[0], (1,) + locals_[0]):
    param = 0
  spec = (
    None
    if param is None
    else tuple(specs[param]) + (None,) * (len(locals_[param]) - len(specs[param]))
  )
  if per_device:
    on_data = spec is not None and data_sharded(P(*spec), axis_name)
    if on_data and shape == (1,) + layout.full[param]:
      return P(axis_name, *without(P(*spec), axis_name))  # a full-size local residual
    if spec is not None and not on_data and shape == (1,) + locals_[param]:
      return P(axis_name, *without(P(*spec), axis_name))  # an hsdp shard's: not P(fast)
    axes = () if spec is None else _spec_axes(without(P(*spec), axis_name))
    if axes:
      return P((axis_name,) + axes, *([None] * (len(shape) - 1)))
    return P(axis_name)
  if local:  # accumulated local gradients, no leading axis
    if spec is None or shape != locals_[param]:
      raise ValueError(
        f"state at {where}: accumulated gradients must be shaped like their parameter"
      )
    if not shape:
      raise ValueError(
        f"state at {where}: the accumulated gradient of a 0-d parameter differs "
        f"between devices but has no dimension to hold one value per device under "
        f"shard_map; give the parameter shape (1,)"
      )
    return P((axis_name,) + _names(spec[0]), *spec[1:])
  if spec is not None:
    if shape == locals_[param]:
      return P(*spec)
    if _spec_axes(P(*spec)):
      raise ValueError(
        f"state at {where} has shape {shape} for a parameter sharded as "
        f"{P(*spec)} (shard shape {locals_[param]}): jc.state_specs cannot tell how "
        f"it is sharded"
      )
  return P()


def state_specs(
  tx: optax.GradientTransformation,
  params,
  *,
  axis_name,
  num_devices: int,
  param_specs=None,
  mesh=None,
  takes_shards: bool | None = None,
):
  """PartitionSpecs of ``tx``'s state for ``jax.shard_map`` data parallelism.

  The state of ``tx.init(params)`` traced inside ``jax.shard_map(tx.init,
  in_specs=(param_specs,))`` gets, leaf by leaf:

  * inside a :func:`per_device_state` (one row per device: residuals, device-folded
    keys, counters): ``P(axis_name, *spec)`` for a leaf shaped like its parameter
    (``spec`` that parameter's spec), ``P((axis_name, *axes))`` for one that is not
    (a two-phase chunk residual: it differs between the parameter's shards too), and
    ``P(axis_name)`` for the rest; for a parameter sharded over ``axis_name`` itself
    (a ``collective="reduce_scatter"`` exchange's shards), a leaf shaped like its
    full-size local gradient (an error-feedback residual) is ``P(axis_name, None,
    *rest)``;
  * inside a :class:`jaxcomp.NodeShardState` (a :func:`jaxcomp.two_level` exchange's
    state held once per shard of a node, e.g. 1-bit Adam's moments): ``P(fast_axis)``;
  * the accumulated gradients of ``optax.MultiSteps`` and :func:`multi_steps` (local
    sums of local gradients, so per device, held without a leading axis): the
    parameter's spec with ``axis_name`` in front of its first dimension's axes;
  * elsewhere (an optimizer after the exchange, whose updates are the same on every
    data-parallel device, or its shard of them): the parameter's spec for a leaf shaped
    like its parameter (Adam's moments of a tensor-parallel kernel, or of a ZeRO shard,
    are sharded like it), else ``P()``.

  A leaf belongs to a parameter when it sits in a subtree with the parameters' tree
  structure (how optax and jaxcomp store per-parameter state).

  Args:
    tx: the whole optimizer, e.g. ``optax.chain(jc.per_device_state(...), optax.adam(..))``.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``), global shapes.
    axis_name: the data-parallel mesh axis the gradients are averaged over.
    num_devices: its size.
    param_specs: a pytree of ``PartitionSpec`` for ``params`` (or a prefix of it), as
      passed to ``shard_map``'s ``in_specs``: over the *other* mesh axes (tensor
      parallelism), and over ``axis_name`` along the first dimension where a
      ``collective="reduce_scatter"`` exchange takes the parameters' shards (ZeRO);
      with ``axis_name=(slow, fast)``, ``P(fast)`` for every leaf where a
      :func:`jaxcomp.hsdp` exchange takes them (HSDP: per-device state is then
      ``P((slow, fast))``, an optimizer's moments after it ``P(fast)``); ``None``: the
      parameters are replicated.
    mesh: the mesh, when ``param_specs`` name other axes and neither the params'
      shardings nor ``jax.set_mesh`` say their sizes.
    takes_shards: ``None``: whether ``tx`` takes the parameters' shards is detected (a
      jaxcomp ``collective="reduce_scatter"`` exchange in it); ``True``: ``tx`` does
      through an exchange of its own (ZeRO written with ``lax.psum_scatter``, or FSDP,
      whose exchange runs in the backward and ``tx`` holds only the optimizer);
      ``False``: it does not.

  Returns:
    A pytree of ``PartitionSpec`` with the structure of ``tx.init(params)``.

  Raises:
    ValueError: ``num_devices`` differs from the mesh's ``axis_name`` size; a spec
      shards over ``axis_name`` other than along the first dimension, or does not divide
      its dimension; ``param_specs`` shard over ``axis_name`` but no transform of ``tx``
      takes shards, or the reverse; ``param_specs`` shard over the fast axis alone but
      no :func:`jaxcomp.hsdp` takes the shards, or one does and not every leaf is so; a
      state leaf would vary over a mesh axis it cannot be sharded along (a 0-d
      per-device leaf).
  """
  layout = mesh_layout(params, param_specs, axis_name, num_devices, mesh)
  state = _check_takes_shards(tx, params, layout, axis_name, takes_shards)
  locals_ = layout.local
  leaves, treedef = treeutil.flat(params)
  single = treedef.num_nodes == 1  # params is one array: match leaves by shape alone

  def param_items(node):
    """``node``'s items per parameter when it has the parameters' structure, else None."""
    kinds = (jax.ShapeDtypeStruct, PerDeviceState, NodeShardState, optax.MultiStepsState)
    if single or isinstance(node, kinds):
      return None
    try:
      items = treedef.flatten_up_to(node)
    except (ValueError, TypeError):
      return None
    shaped = [x for x in items if hasattr(x, "shape")]
    if len(shaped) + sum(isinstance(x, (optax.MaskedNode, type(None))) for x in items) != len(
      items
    ):
      return None
    if type(node) is type(params) and not isinstance(params, (tuple, list)):
      return items  # a dict (or other mapping) of the parameters' keys
    # Tuples and lists match by structure too easily (a (count, key) pair): ask for at
    # least one leaf shaped like its parameter as well.
    hits = sum(
      tuple(x.shape) in (loc, (1,) + loc) for x, loc in zip(items, locals_) if hasattr(x, "shape")
    )
    return items if hits else None

  def leaf_spec(x, where: str, per_device: bool, local: bool, param: int | None):
    spec_ = _leaf_spec(layout, axis_name, single, x, where, per_device, local, param)
    entries = list(spec_)
    while entries and entries[-1] is None:  # P('b', None) is P('b'): keep the short form
      entries.pop()
    return P(*entries)

  def walk(node, where: str, per_device: bool, local: bool):
    def special(x):
      kinds = (PerDeviceState, NodeShardState, optax.MultiStepsState)
      return isinstance(x, kinds) or (param_items(x) is not None)

    def one(path, x):
      here = where + jax.tree_util.keystr(path)
      if isinstance(x, PerDeviceState):
        return PerDeviceState(walk(x.inner, here + ".inner", True, local))
      if isinstance(x, NodeShardState):  # a two-level exchange's state per node shard
        return NodeShardState(jax.tree.map(lambda _: P(x.axis), x.inner), x.axis)
      if isinstance(x, optax.MultiStepsState):
        return x._replace(
          mini_step=walk(x.mini_step, here, per_device, local),
          gradient_step=walk(x.gradient_step, here, per_device, local),
          inner_opt_state=walk(x.inner_opt_state, here + ".inner_opt_state", per_device, local),
          acc_grads=walk(x.acc_grads, here + ".acc_grads", per_device, True),
          skip_state=walk(x.skip_state, here + ".skip_state", per_device, local),
        )
      items = param_items(x)
      if items is not None:
        return treedef.unflatten(
          [
            item
            if not hasattr(item, "shape")
            else leaf_spec(item, here + jax.tree_util.keystr(p), per_device, local, i)
            for i, (item, (p, _)) in enumerate(zip(items, leaves))
          ]
        )
      return leaf_spec(x, here, per_device, local, None)

    return jax.tree_util.tree_map_with_path(one, node, is_leaf=special)

  return walk(state, "opt_state", False, False)
