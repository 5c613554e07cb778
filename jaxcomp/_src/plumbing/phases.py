r"""Where a compiled step's time goes: gradient, encode, exchange, decode, the rest.

:func:`profile_phases` runs a compiled step a few times under ``jax.profiler.trace``
and reads back the trace's per-op events (XLA names every executed HLO op in the
``hlo_op`` stat of its event, on CPU thunks and on GPU kernels). Each op is assigned a
phase from the compiled HLO:

==============  =====================================================================
``exchange``    a collective (all-gather, all-reduce, all-to-all, …), including the
                time it waits for the slowest device to arrive
``encode``      any op traced under ``jax.named_scope("jaxcomp_encode")``: jaxcomp's
                transforms put error feedback, quantization, selection and packing
                there
``decode``      ``jax.named_scope("jaxcomp_decode")``: unpacking, summing and
                averaging the received payloads
``gradient``    forward and backward pass (``jvp``/``transpose`` in the op's name)
``update``      everything else (the optimizer, the loss's mean, copies)
==============  =====================================================================

A collective is ``exchange`` (also a loop or conditional that holds one); any other op
takes the phase that most of the ops fused into it belong to (of nested jaxcomp scopes
the innermost counts; unscoped ops do not vote, so a decode fused with the optimizer's
first elementwise op is ``decode``; ties go to the earlier row of the table). A loop or
conditional counts through the ops it runs (only innermost
events are summed). Times are seconds per call and per local device; ``idle`` is the
wall time per call not covered by any op: host overhead, launch, the Python between
calls. On CPU the thunk executor may run independent ops at once, so on more than one
core the phases can add up to more than the wall time.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from collections.abc import Mapping
import dataclasses
import glob
import os
import re
import statistics
import tempfile
import time
from typing import Any
import warnings

import jax

ENCODE_SCOPE = "jaxcomp_encode"
DECODE_SCOPE = "jaxcomp_decode"
FALLBACK_SCOPE = "jaxcomp_fallback"  # rarely taken fallback exchanges (wire_report: apart)
PHASES = ("gradient", "encode", "exchange", "decode", "update")

# HLO opcodes that move data between devices (sync and async forms).
_COLLECTIVES = (
  "all-gather",
  "all-reduce",
  "all-to-all",
  "collective-permute",
  "reduce-scatter",
  "collective-broadcast",
  "ragged-all-to-all",
  "all-gather-start",
  "all-gather-done",
  "all-reduce-start",
  "all-reduce-done",
  "collective-permute-start",
  "collective-permute-done",
)

_KERNELS = (*_COLLECTIVES, "fusion", "custom-call", "dot", "convolution")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(
  r"(?:calls|to_apply|body|condition|branch_computations|"
  r"true_computation|false_computation)=\{?([^,}]*(?:,\s*%[\w.\-]+)*)\}?"
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class PhaseProfile:
  """Seconds per call of a profiled step, per local device, split by phase.

  Attributes:
    step_s: median wall time of one call (the profiled calls, profiler on).
    phases: ``{phase: seconds per call}`` for :data:`PHASES`; ``idle`` is ``step_s``
      minus their sum (negative when ops overlapped).
    top_ops: per phase, its five costliest HLO ops as ``(name, seconds per call)``.
    calls: how many calls were profiled.
    untraced: the kernels of the step's entry computation (fusions, collectives,
      custom calls, dots, convolutions: each runs on every call) of which the trace
      holds no event. When not empty the profile is incomplete: their time is in
      ``idle``. jax 0.12's CPU runtime under ``jax.distributed`` loses events of a
      step's collectives and of ops that run after them; a CPU trace under load can
      lose every event (then every kernel is listed).
  """

  PHASES = PHASES  # the phase names, in table order (``idle`` comes after them)

  step_s: float
  phases: Mapping[str, float]
  top_ops: Mapping[str, tuple[tuple[str, float], ...]]
  calls: int
  untraced: tuple[str, ...] = ()

  def __str__(self) -> str:
    parts = [f"{p} {1e3 * self.phases[p]:.1f}" for p in (*self.PHASES, "idle")]
    note = f"; {len(self.untraced)} kernels untraced: incomplete" if self.untraced else ""
    return f"step {1e3 * self.step_s:.1f} ms = " + " + ".join(parts) + f" (ms){note}"


def _hlo_text(hlo) -> str:
  if isinstance(hlo, str):
    return hlo
  if hasattr(hlo, "as_text"):
    return hlo.as_text()
  raise TypeError(f"hlo must be a jax.stages.Compiled or its as_text(); got {type(hlo)}")


def module_name(hlo) -> str:
  """The ``HloModule`` name of a compiled step (what trace events call ``hlo_module``)."""
  m = re.match(r"\s*HloModule\s+([\w.\-]+)", _hlo_text(hlo))
  if m is None:
    raise ValueError("not HLO text: it does not start with 'HloModule NAME'")
  return m.group(1)


def op_phases(hlo) -> dict[str, str]:
  """``{HLO instruction name: phase}`` for every instruction of a compiled module.

  An instruction's phase comes from its opcode (collectives: ``exchange``) and from the
  ``op_name`` metadata of its own and its called computations' instructions (a fusion
  is the ops fused into it), by the rules of the module docstring.
  """
  text = _hlo_text(hlo)
  comp_ops: dict[str, list[str]] = collections.defaultdict(list)  # op_names inside
  comp_calls: dict[str, set[str]] = collections.defaultdict(set)  # computations called
  comp_coll: dict[str, bool] = collections.defaultdict(bool)
  instructions: list[tuple[str, str, list[str], set[str]]] = []
  for current, _, name, opcode, line in _instructions(text):
    names = _OP_NAME.findall(line)
    called = set()
    for c in _CALLS.findall(line):
      called.update(x.strip().lstrip("%") for x in c.split(",") if x.strip())
    comp_ops[current].extend(names)
    comp_calls[current].update(called)
    if opcode in _COLLECTIVES:
      comp_coll[current] = True
    instructions.append((name, opcode, names, called))

  def closure(comps: set[str]) -> tuple[list[str], bool]:
    seen, stack, ops, coll = set(), list(comps), [], False
    while stack:
      c = stack.pop()
      if c in seen:
        continue
      seen.add(c)
      ops += comp_ops.get(c, [])
      coll = coll or comp_coll.get(c, False)
      stack.extend(comp_calls.get(c, ()))
    return ops, coll

  out = {}
  for name, opcode, names, called in instructions:
    inner, coll = closure(called)
    if opcode in _COLLECTIVES or coll:
      out[name] = "exchange"
      continue
    votes = collections.Counter(_scope_phase(o) for o in names + inner)
    votes.pop("update", None)
    # The phase most of its ops come from; CSE can leave a shared constant or mask of
    # one phase inside another phase's fusion.
    out[name] = max(("encode", "decode", "gradient"), key=lambda p: votes[p]) if votes else "update"
  return out


def _instructions(text: str):
  """``(computation, in the entry computation, name, opcode, line)`` per instruction of
  HLO text."""
  current, entry = None, False
  for line in text.splitlines():
    if line.rstrip().endswith("{") and " = " not in line:
      m = _COMPUTATION.match(line)
      current = m.group(1) if m else current
      entry = line.startswith("ENTRY")
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m is not None and current is not None:
      yield current, entry, m.group(1), m.group(2), line


def _entry_kernels(hlo) -> set[str]:
  """Names of the entry computation's kernels (fusions, collectives, custom calls,
  dots, convolutions): each runs, and is traced, on every call."""
  return {
    name
    for _, entry, name, opcode, _ in _instructions(_hlo_text(hlo))
    if entry and opcode in _KERNELS
  }


def _scope_phase(op_name: str) -> str:
  """The phase of one op from its ``op_name``: its innermost jaxcomp scope, else
  ``gradient`` for autodiff's ops, else ``update``."""
  enc, dec = op_name.rfind(ENCODE_SCOPE), op_name.rfind(DECODE_SCOPE)
  if enc >= 0 or dec >= 0:
    return "encode" if enc > dec else "decode"
  if "jvp(" in op_name or "transpose(" in op_name:
    return "gradient"
  return "update"


def _stat(event, key):
  for k, v in event.stats:
    if k == key:
      return v
  return None


def _innermost(events):
  """Events of one timeline that contain no other event of it."""
  events = sorted(events, key=lambda e: (e[0], -e[1]))
  keep = []
  for i, (start, dur, name) in enumerate(events):
    end = start + dur
    nxt = events[i + 1] if i + 1 < len(events) else None
    if nxt is not None and nxt[0] < end and nxt[0] + nxt[1] <= end:
      continue  # the next event starts inside this one: this one is a container
    keep.append((start, dur, name))
  return keep


def _read_trace(logdir: str, module: str):
  """The op events of ``module`` in the trace under ``logdir``, by timeline, as
  ``(start_ns, duration_ns, op)``; the (plane, device) pairs they ran on; and the other
  modules the trace has op events of."""
  files = sorted(
    glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime
  )
  if not files:
    raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {logdir}")
  data = jax.profiler.ProfileData.from_file(files[-1])
  per_line = collections.defaultdict(list)
  devices = set()
  others = set()
  for plane in data.planes:
    for line in plane.lines:
      for e in line.events:
        op = _stat(e, "hlo_op")
        if op is None:
          continue
        name = _stat(e, "hlo_module")
        if name != module:
          if name is not None:
            others.add(name)
          continue
        device = _stat(e, "device_ordinal")
        if device is not None:
          devices.add((plane.name, device))
        per_line[(plane.name, line.name)].append((e.start_ns, e.duration_ns, op))
  return per_line, devices, others


def profile_phases(
  run: Callable[[], Any], hlo, *, calls: int = 5, logdir: str | None = None
) -> PhaseProfile:
  """Profiles ``calls`` calls of ``run`` and splits their time by phase.

  Args:
    run: runs one step of the compiled program ``hlo`` and blocks until it is done
      (e.g. ``lambda: jax.block_until_ready(step(*args))``; with donated arguments,
      let it carry the state from call to call). Call it once before, so that the
      profiled calls are warm.
    hlo: the step's ``jax.stages.Compiled`` (``jitted.lower(...).compile()``) or its
      ``as_text()``: names the module whose ops are counted and their phases.
    calls: how many calls to profile (at least 1).
    logdir: where the trace is written (default: a temporary directory, removed).

  Returns:
    A :class:`PhaseProfile`, per call and per local device of this process. Where the
    trace lost kernels' events it says so (``untraced``, a ``RuntimeWarning``), an empty
    trace included.

  Raises:
    RuntimeError: the trace holds op events of other programs but none of ``hlo``'s.
  """
  if calls < 1:
    raise ValueError(f"calls must be at least 1, got {calls}")
  phases_of = op_phases(hlo)
  module = module_name(hlo)
  tmp = None
  if logdir is None:
    tmp = tempfile.TemporaryDirectory(prefix="jaxcomp_profile_")
    logdir = tmp.name
  try:
    walls = []
    with jax.profiler.trace(logdir):
      for _ in range(calls):
        start = time.perf_counter()
        run()
        walls.append(time.perf_counter() - start)
    per_line, devices, others = _read_trace(logdir, module)
  finally:
    if tmp is not None:
      tmp.cleanup()
  if not per_line and others:
    raise RuntimeError(
      f"the trace has no op events of module {module!r}, only of {sorted(others)}: did "
      "run() call this compiled step?"
    )
  seen = {op for events in per_line.values() for _, _, op in events}
  untraced = tuple(sorted(_entry_kernels(hlo) - seen))
  if not per_line:
    # An empty trace is the profiler's loss (or a run() that ran nothing compiled), not
    # a wrong step: the profile says it is empty rather than abort a run over it, which
    # under jax.distributed would stop every process.
    warnings.warn(
      f"the trace holds no op events at all (the profiler lost them, or run() ran no "
      f"compiled program): the profile is empty, all {len(untraced)} of the step's "
      "kernels untraced",
      RuntimeWarning,
      stacklevel=2,
    )
  elif untraced:
    warnings.warn(
      f"the trace has no event of {len(untraced)} of the step's kernels: the profile "
      "is incomplete, their time is counted as idle",
      RuntimeWarning,
      stacklevel=2,
    )
  totals = collections.Counter()
  by_op = collections.Counter()
  for events in per_line.values():
    for _, dur, op in _innermost(events):
      phase = phases_of.get(op, "update")
      totals[phase] += dur
      by_op[(phase, op)] += dur
  scale = 1e-9 / (calls * max(len(devices), 1))
  phases = {p: totals[p] * scale for p in PHASES}
  step_s = statistics.median(walls)
  phases["idle"] = step_s - sum(phases[p] for p in PHASES)
  top = {}
  for p in PHASES:
    ops = sorted(((op, t * scale) for (q, op), t in by_op.items() if q == p), key=lambda x: -x[1])[
      :5
    ]
    top[p] = tuple(ops)
  return PhaseProfile(step_s=step_s, phases=phases, top_ops=top, calls=calls, untraced=untraced)
