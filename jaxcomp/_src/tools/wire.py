"""Wire accounting: the bytes a transform's ``update`` really moves through collectives.

The transform's ``update`` is traced inside ``jax.shard_map`` over an abstract mesh of
``num_devices`` devices (no devices needed, any K), and every collective in the traced
program is read with its operand sizes. Per device and per step, with B the operand's
bytes on one device and K the axis size (ring algorithms):

=================  ====================
collective         bytes received
=================  ====================
all_gather         (K-1)·B
all_to_all         (K-1)/K·B
psum (all-reduce)  2(K-1)/K·B
psum_scatter       (K-1)/K·B
ppermute           B
=================  ====================

and as much is sent. The dense baseline is a ``pmean`` of every parameter in its own
dtype (2 bytes a value for a bfloat16 leaf, 4 for float32), as plain JAX would exchange
its gradient (a ``psum_scatter`` of a leaf sharded over the data axis).
Of a ``lax.cond``/``lax.switch`` only the branch that moves the most bytes is counted
(one branch runs per step; e.g. the first warm-up stage of :func:`jaxcomp.dgc`), so the
report is an upper bound there; report the steady state of such a transform without it
(``jc.dgc(..., warmup_steps=0)``). Collectives traced under
``jax.named_scope(every_scope(n))`` run once every ``n`` steps (e.g. the sync of
:func:`jaxcomp.diloco`): they count ``1/n`` of their bytes per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

# The trace reader lives in plumbing (methods use it too); its names are this module's.
from jaxcomp._src.plumbing.collective_trace import SAME_AS as SAME_AS
from jaxcomp._src.plumbing.collective_trace import TRAFFIC as TRAFFIC
from jaxcomp._src.plumbing.collective_trace import CollectiveOp as CollectiveOp
from jaxcomp._src.plumbing.collective_trace import canonical as canonical
from jaxcomp._src.plumbing.collective_trace import collective_ops as collective_ops
from jaxcomp._src.plumbing.collective_trace import every_scope as every_scope
from jaxcomp._src.plumbing.collective_trace import merge_ops as merge_ops
from jaxcomp._src.plumbing.collective_trace import regular_bytes
from jaxcomp._src.tools import specs


@dataclasses.dataclass(frozen=True)
class WireReport:
  """Bytes per device per step of a transform's collectives, vs a dense pmean (or a
  baseline step)."""

  num_devices: int
  bytes_sent: float
  bytes_received: float
  dense_bytes: float
  ops: tuple[CollectiveOp, ...]
  fallback_bytes: float = 0.0  # bytes of the rare fallback path, when it is taken
  # What dense_bytes prices: the dense exchange of wire_report in the leaves' dtypes
  # ("dense float32"; None reads the same); the baseline's name for step_wire_report
  # (NaN dense_bytes when it had none).
  baseline: str | None = None

  @property
  def by_axis(self) -> dict[tuple, float]:
    """Bytes received per device per step (fallback paths left out), by the mesh axes
    of the collectives that moved them: on a ``(slow, fast)`` mesh,
    ``report.by_axis[("slow",)]`` is what crosses the slow link (a two-level exchange's
    compressed shards) and ``report.by_axis[("fast",)]`` what stays inside a node."""
    out: dict[tuple, float] = {}
    for op in self.ops:
      if not op.fallback:
        out[op.axes] = out.get(op.axes, 0.0) + op.bytes_received
    return out

  @property
  def ratio(self) -> float:
    """The compression ratio, dense bytes received over the transform's bytes received."""
    return self.dense_bytes / self.bytes_received if self.bytes_received else float("inf")

  def __str__(self) -> str:
    base = self.baseline or "dense float32"
    against = (
      f"  ({base} {self.dense_bytes:,.0f} B, ratio {self.ratio:.2f}x)"
      if self.dense_bytes == self.dense_bytes  # not NaN: there is a baseline
      else ""
    )
    lines = [
      f"wire report, K={self.num_devices} devices, per device per step:",
      f"  received {self.bytes_received:,.0f} B{against}",
    ]
    split = len({op.axes for op in self.ops}) > 1
    if split:
      for axes, b in self.by_axis.items():
        lines.append(f"  over {'x'.join(map(str, axes)) or '-'}: {b:,.0f} B")
    for op in self.ops:
      lines.append(
        f"  {op.primitive:<22} operand {op.operand_bytes:>12,} B x{op.count:<3}"
        f" -> {op.bytes_received:,.0f} B"
        + (f"  over {'x'.join(map(str, op.axes))}" if split else "")
        + (f"  (once every {op.every} steps)" if op.every > 1 else "")
        + ("  (fallback only)" if op.fallback else "")
      )
    if self.fallback_bytes:
      lines.append(
        f"  a step that takes the fallback path receives {self.fallback_bytes:,.0f} B more"
      )
    return "\n".join(lines)


def wire_report(
  tx,
  params,
  *,
  axis_name,
  num_devices: int,
  param_specs=None,
  mesh=None,
  takes_shards: bool | None = None,
) -> WireReport:
  """Bytes per device per step that ``tx.update`` sends and receives through collectives.

  ``tx.init`` and ``tx.update`` are traced inside ``jax.shard_map`` over an abstract
  mesh with ``num_devices`` devices on ``axis_name`` (no real devices are needed); the
  bytes are read from the operands of the collectives in the traced program, and priced
  by the ring convention in this module's docstring; a collective that runs once every
  ``n`` steps (the sync of :func:`jaxcomp.diloco`) counts ``1/n`` of its bytes. The
  dense baseline is ``lax.pmean`` of every leaf of ``params`` in the leaf's own dtype,
  of itemsize b (4 for float32, 2 for bfloat16): ``2(K-1)/K · b · N`` bytes; for the
  leaves ``param_specs`` shard over ``axis_name`` (a ``collective="reduce_scatter"``
  exchange, which returns this device's shard) it is a ``psum_scatter``:
  ``(K-1)/K · b · N``. For a :func:`jaxcomp.hsdp` exchange it is dense HSDP's: the
  ``lax.pmean`` of the shard over the S nodes, ``2(S-1)/S · b · N/L``, after (for
  ``grads="full"``) a ``psum_scatter`` over the L devices of a node, ``(L-1)/L · b · N``.

  Args:
    tx: an ``optax.GradientTransformation`` (e.g. a chain starting with ``jc.qsgd``).
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``), global shapes;
      gradients are taken to have the same dtypes and each device's full-size local
      shapes (not cut over ``axis_name``).
    axis_name: the axis name ``tx`` averages over, or a tuple of them (a
      :func:`jaxcomp.two_level` exchange over ``(slow, fast)``: each collective is
      priced at its own axes' devices, and :attr:`WireReport.by_axis` splits the bytes
      by axis).
    num_devices: K, the number of devices on that axis (>= 2); for a tuple of axes,
      their devices together (``mesh.size`` on a 2-D mesh, whose sizes ``mesh`` gives).
    param_specs: the parameters' ``PartitionSpec``\\ s, as for :func:`jaxcomp.state_specs`
      (``None``: replicated); ``update`` is traced with each device's shards. For a
      :func:`jaxcomp.hsdp` exchange ``P(fast)``, with ``axis_name=(slow, fast)``: its
      gradients are then the shards' (``grads="shards"``) or full-size (``"full"``).
    mesh: the mesh, when ``param_specs`` name other axes (see :func:`jaxcomp.state_specs`).
    takes_shards: as for :func:`jaxcomp.state_specs`: ``True`` for a chain that takes
      shards through an exchange of its own (a ``lax.psum_scatter``).

  Returns:
    A :class:`WireReport`; ``str()`` of it is a readable table.
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 2:
    raise ValueError(f"num_devices must be an integer >= 2, got {num_devices!r}")
  if axis_name is None:
    raise ValueError("wire_report needs the axis_name the transform averages over")
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)
  layout = specs.mesh_layout(params, param_specs, axis_name, num_devices, mesh)
  state, hsdp_grads = specs.trace_state(tx, params, layout, axis_name, takes_shards)
  leaves, treedef = jax.tree.flatten(params)
  grad_specs = [specs.without(spec, axis_name) for spec in layout.specs]
  if hsdp_grads == "shards":  # jc.hsdp(grads="shards"): the gradients of the shards
    grad_specs = list(layout.specs)

  def placed(spec_list):
    return treedef.unflatten(
      [
        jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=jax.NamedSharding(layout.mesh, sp))
        for p, sp in zip(leaves, spec_list)
      ]
    )

  ops = collective_ops(
    lambda g, s, p: tx.update(g, s, p)[0],
    placed(grad_specs),
    state,
    placed(layout.specs),
    axis_name=axis_name,
    num_devices=num_devices,
    in_specs=(treedef.unflatten(grad_specs), P(), treedef.unflatten(layout.specs)),
    mesh=layout.mesh,
  )
  received = float(sum(op.bytes_received for op in ops if not op.fallback))
  fallback = float(sum(op.bytes_received for op in ops if op.fallback))
  k = num_devices
  dense = 0.0
  for spec, shape, p in zip(layout.specs, layout.full, leaves):
    n = int(np.prod(shape, dtype=np.int64))
    scattered = specs.data_sharded(spec, axis_name)
    # A bfloat16 model's gradients are exchanged in bfloat16 by plain JAX: pricing them
    # as float32 would double the baseline and every ratio against it.
    b = jnp.dtype(p.dtype).itemsize
    if hsdp_grads is not None:  # dense HSDP: pmean of the shard over the slow axis
      slow, fast = (layout.mesh.shape[a] for a in specs.hsdp_axes(axis_name))
      dense += 2 * (slow - 1) / slow * b * n / fast
      if hsdp_grads == "full":  # after a psum_scatter over the fast one
        dense += (fast - 1) / fast * b * n
      continue
    dense += (1 if scattered else 2) * (k - 1) / k * b * n
  dtypes = sorted({jnp.dtype(p.dtype).name for p in leaves})
  return WireReport(
    num_devices=k,
    bytes_sent=received,
    bytes_received=received,
    dense_bytes=dense,
    ops=merge_ops(ops),
    fallback_bytes=fallback,
    baseline="dense " + "/".join(dtypes),
  )


def step_wire_report(
  step, *args, axis_name, num_devices: int, baseline=None, in_specs=None, mesh=None
) -> WireReport:
  """Bytes per device per step that any per-device ``step`` function moves.

  :func:`wire_report` prices a transform's ``update``; this prices a whole step, such
  as a sharded (FSDP) step whose weights are gathered in the forward
  (:func:`jaxcomp.gather_weights`, :func:`jaxcomp.fsdp_gather`) and whose gradients are
  reduce-scattered in the backward of each layer: every collective of the traced
  ``step(*args)``, forward and backward, inside ``lax.scan`` (times its length) and
  under ``jax.checkpoint`` (a rematerialized gather counts again), priced by the table of
  this module's docstring.

  Args:
    step: the function one device runs (inside ``jax.shard_map``), e.g. ``lambda
      shards, x: jax.grad(loss)(shards, x)``; its outputs are not used.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct``), as one device sees them.
    axis_name: the axis its collectives run over.
    num_devices: K, the number of devices on that axis (>= 2).
    baseline: a step to compare against, traced with the same ``args`` (e.g. the dense
      FSDP step, float32 gather and ``psum_scatter``); its bytes received are the
      report's ``dense_bytes``. ``None``: ``dense_bytes`` is NaN and there is no ratio.
    in_specs, mesh: as for ``jax.shard_map``, when the arguments are not replicated
      over an abstract mesh of ``num_devices`` devices on ``axis_name``.

  Returns:
    A :class:`WireReport`.
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 2:
    raise ValueError(f"num_devices must be an integer >= 2, got {num_devices!r}")
  if not callable(step) or (baseline is not None and not callable(baseline)):
    raise TypeError("step and baseline must be callables that run on one device")
  kw = dict(axis_name=axis_name, num_devices=num_devices, in_specs=in_specs, mesh=mesh)
  ops = collective_ops(step, *args, **kw)
  dense = float("nan")
  if baseline is not None:
    dense = regular_bytes(collective_ops(baseline, *args, **kw))
  received = regular_bytes(ops)
  return WireReport(
    num_devices=num_devices,
    bytes_sent=received,
    bytes_received=received,
    dense_bytes=dense,
    ops=merge_ops(ops),
    fallback_bytes=float(sum(op.bytes_received for op in ops if op.fallback)),
    baseline="baseline step" if baseline is not None else None,
  )
