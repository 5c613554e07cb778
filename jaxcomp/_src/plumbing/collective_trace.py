"""The collectives of a traced program, read off its jaxpr with their operand bytes.

:func:`collective_ops` traces a function inside ``jax.shard_map`` (over an abstract mesh:
no devices needed, any K) and returns a :class:`CollectiveOp` per collective, priced by
:data:`TRAFFIC` (the bytes one device receives per run, ring algorithms, with B the
operand's bytes on one device and K the axis size; the table is in
:func:`jaxcomp.wire_report`'s module). Of a ``lax.cond``/``lax.switch`` only the branch
that moves the most bytes counts; collectives under ``jax.named_scope(phases.FALLBACK_SCOPE)``
are marked ``fallback``; those under ``jax.named_scope(every_scope(n))`` count ``1/n``.

It is plumbing, not a tool, because methods read it too: :func:`jaxcomp.qsvrg_wire_report`
counts QSVRG's bits with it and :func:`jaxcomp.diloco` scopes its sync with
:func:`every_scope` and checks with :func:`output_axes` that its exchange averages over
its axis; the wire report (``tools/wire.py``) builds on it.
"""

from __future__ import annotations

import dataclasses
import re

import jax
from jax.extend import core as _core
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxcomp._src.plumbing import phases

#: Primitive names jax gives the same collective (by version, and by ``check_vma``).
SAME_AS = {
  "all_gather_invariant": "all_gather",
  "psum_invariant": "psum",
  "psum2": "psum",
  "reduce_scatter": "psum_scatter",
}


def canonical(primitive: str) -> str:
  """The one name of a collective that jax spells several ways (``psum_invariant`` ->
  ``psum``); other names unchanged."""
  return SAME_AS.get(primitive, primitive)


TRAFFIC = {  # by canonical name
  "all_gather": lambda b, k: (k - 1) * b,
  "all_to_all": lambda b, k: (k - 1) * b / k,
  "psum": lambda b, k: 2 * (k - 1) * b / k,
  "pmax": lambda b, k: 2 * (k - 1) * b / k,
  "pmin": lambda b, k: 2 * (k - 1) * b / k,
  "psum_scatter": lambda b, k: (k - 1) * b / k,
  "ppermute": lambda b, k: b,
}


_EVERY = re.compile(r"jaxcomp_every_(\d+)")


def every_scope(n: int) -> str:
  """The ``jax.named_scope`` of collectives that run once every ``n`` steps: the wire
  report counts ``1/n`` of their bytes per step (nested scopes multiply)."""
  return f"jaxcomp_every_{int(n)}"


def _every(name_stack: str) -> int:
  return int(np.prod([int(n) for n in _EVERY.findall(name_stack)], dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective of the traced update."""

  primitive: str
  operand_bytes: int  # B: bytes of the operand on one device
  count: int  # how many times it runs per step (scan trip counts)
  bytes_received: float  # per device per step, by the convention above
  fallback: bool = False  # only on a rare fallback path (not in bytes_received)
  every: int = 1  # runs once every this many steps (bytes_received is per step: / every)
  axes: tuple = ()  # the mesh axes it communicates over, sorted
  devices: int = 0  # K it was priced at: its axes' devices (0: not recorded)


def _nbytes(aval) -> int:
  dtype = aval.dtype
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return 0
  return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _sub_jaxprs(value):
  if isinstance(value, _core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, _core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def regular_bytes(ops) -> float:
  """Bytes received of the ops that run every step (not on the fallback path)."""
  return sum(op.bytes_received for op in ops if not op.fallback)


def _axis_devices(axes: tuple, k: int, sizes: dict | None) -> int:
  """The devices a collective over ``axes`` spans: the product of their sizes in
  ``sizes`` (the mesh's), or ``k`` where the mesh does not say."""
  if not sizes or not axes or any(a not in sizes for a in axes):
    return k
  return int(np.prod([sizes[a] for a in axes], dtype=np.int64))


def _walk(jaxpr, k: int, mult: int, out: list, sizes: dict | None = None) -> None:
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if canonical(name) in TRAFFIC:
      b = sum(_nbytes(v.aval) for v in eqn.invars)
      stack = str(eqn.source_info.name_stack)
      fallback = phases.FALLBACK_SCOPE in stack
      every = _every(stack)
      axes = tuple(sorted(_collective_axes(eqn), key=str))
      devices = _axis_devices(axes, k, sizes)
      traffic = mult * TRAFFIC[canonical(name)](b, devices) / every
      out.append(CollectiveOp(name, b, mult, traffic, fallback, every, axes, devices))
    if name == "cond":
      # One branch runs per step: count the branch that moves the most bytes (an upper
      # bound; e.g. the first warm-up stage of jc.dgc). Collectives under the
      # jaxcomp_fallback scope (a rare path, e.g. Elias coding's overflow) are kept
      # apart, as the costliest such branch.
      per_branch = []
      for branch in eqn.params["branches"]:
        ops: list = []
        for sub in _sub_jaxprs(branch):
          _walk(sub, k, mult, ops, sizes)
        per_branch.append(ops)
      regular = max(per_branch, key=regular_bytes)
      rare = max(per_branch, key=lambda ops: sum(op.bytes_received for op in ops if op.fallback))
      out.extend(op for op in regular if not op.fallback)
      out.extend(op for op in rare if op.fallback)
      continue
    inner = mult * int(eqn.params.get("length", 1)) if name == "scan" else mult
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        _walk(sub, k, inner, out, sizes)


def collective_ops(
  fn, *args, axis_name, num_devices: int, in_specs=None, mesh=None
) -> list[CollectiveOp]:
  """A :class:`CollectiveOp` per collective of the traced ``fn`` (not merged).

  ``fallback`` marks collectives under ``jax.named_scope("jaxcomp_fallback")``: a rare
  path (taken when a capacity overflowed) that is reported apart.

  ``fn(*args)`` is traced inside ``jax.shard_map`` over an abstract mesh of
  ``num_devices`` devices, every argument replicated (so each device sees ``args``);
  or over ``mesh`` with ``in_specs`` (the arguments then carry their shardings). Each
  collective is priced at the devices of the mesh axes it runs over (on a ``(slow,
  fast)`` mesh, an all-gather over ``fast`` at the fast axis's size), and records them
  in ``axes``.
  """
  if mesh is None:
    mesh = jax.sharding.AbstractMesh((num_devices,), (axis_name,))
  mapped = jax.shard_map(
    fn, mesh=mesh, in_specs=P() if in_specs is None else in_specs, out_specs=P(), check_vma=False
  )
  closed = jax.make_jaxpr(mapped)(*args)
  out: list = []
  _walk(closed.jaxpr, num_devices, 1, out, dict(mesh.shape))
  return out


def merge_ops(ops) -> tuple[CollectiveOp, ...]:
  """Merges the ops of :func:`collective_ops` by (primitive, operand bytes, fallback,
  every, axes, devices)."""
  merged: dict[tuple, list] = {}
  for op in ops:
    key = (op.primitive, op.operand_bytes, op.fallback, op.every, op.axes, op.devices)
    entry = merged.setdefault(key, [0, 0.0])
    entry[0] += op.count
    entry[1] += op.bytes_received
  return tuple(
    CollectiveOp(n, b, c, r, rare, every, axes, k)
    for (n, b, rare, every, axes, k), (c, r) in merged.items()
  )


def _collective_axes(eqn) -> frozenset:
  """The named axes a collective equation communicates over; empty for other equations."""
  if canonical(eqn.primitive.name) not in TRAFFIC:
    return frozenset()
  axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  return frozenset(a for a in axes if not isinstance(a, int))  # ints: vmapped positional axes


def _every_axis(jaxpr) -> frozenset:
  """Every named axis a collective anywhere in ``jaxpr`` communicates over."""
  out = frozenset()
  for eqn in jaxpr.eqns:
    out |= _collective_axes(eqn)
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        out |= _every_axis(sub)
  return out


def _is_call(eqn, subs) -> bool:
  """Whether ``eqn`` runs its one sub-jaxpr once on its operands, outputs to outputs."""
  return (
    eqn.primitive.name not in ("scan", "while")  # loops carry values between iterations
    and len(subs) == 1
    and len(subs[0].invars) == len(eqn.invars)
    and len(subs[0].outvars) == len(eqn.outvars)
  )


def _flow(jaxpr, in_axes) -> list:
  """The axes each output of ``jaxpr`` depends on through collectives, given its inputs'."""
  env: dict = {}
  read = lambda v: frozenset() if isinstance(v, _core.Literal) else env.get(v, frozenset())
  for v, axes in zip(jaxpr.invars, in_axes):
    env[v] = axes
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    subs = [sub for value in eqn.params.values() for sub in _sub_jaxprs(value)]
    if eqn.primitive.name == "cond":  # the index, then the branches' operands
      outs = [ins[0]] * len(eqn.outvars)
      for sub in subs:
        outs = [a | b for a, b in zip(outs, _flow(sub, ins[1:]))]
    elif _is_call(eqn, subs):  # jit, custom_jvp/vjp, remat, a nested shard_map
      outs = _flow(subs[0], ins)
    else:  # loops and the rest: every output depends on every input and collective inside
      axes = frozenset().union(*ins, *(_every_axis(sub) for sub in subs))
      outs = [axes] * len(eqn.outvars)
    own = _collective_axes(eqn)
    for v, axes in zip(eqn.outvars, outs):
      env[v] = axes | own
  return [read(v) for v in jaxpr.outvars]


def output_axes(closed) -> list[frozenset]:
  """For each output of a traced function (a ``ClosedJaxpr``, e.g. from
  ``jax.make_jaxpr``), the named axes of the collectives its value depends on.

  An output computed from this device's inputs alone depends on none: under
  ``jax.pmap`` or ``shard_map(check_vma=False)``, where values carry no varying type,
  this tells a mean over an axis from a local value. Through loops (``scan``,
  ``while``) every output counts as depending on every collective inside, so a
  missing axis is certain, a present one an upper bound.
  """
  return _flow(closed.jaxpr, [frozenset()] * len(closed.jaxpr.invars))
