"""What the multi-process trainers share: joining ``jax.distributed`` with bounded fault
detection, Orbax checkpoints that resume bit-exactly, and a digest of the parameters.

Used by the MNIST-1D demo (``examples/mnist1d``), the transformer LM (``examples/lm``)
and the multi-process launcher (``benchmarks/launch.py``).

* :func:`init_distributed` joins the job with ``fault_timeout`` as the coordination
  service's heartbeat timeout and XLA's CPU collective timeout, so that a dead or cut-off
  peer fails the job within that bound; :func:`exit_at_once_on_error` then leaves
  without waiting in ``jax.distributed``'s shutdown barrier for the lost peer.
* :func:`checkpoint_manager`, :func:`save_checkpoint` and :func:`restore_checkpoint`
  keep the params, the whole optimizer state (per-device residuals and typed keys
  included, each process writing and reading its own devices' rows) and the progress
  as JSON; :func:`run_fingerprint` and :func:`check_fingerprint` refuse a checkpoint of
  other settings.
* :func:`params_digest`: a sha256 of the parameters' bytes, to compare runs.
* :class:`Divergence`, :func:`all_finite` and :func:`diverged_exit_code`: a run that goes
  non-finite says so, in the tables, the JSON, the plots and the exit code;
  :func:`bytes_cells`: a row whose exchange never ran says so instead of its bytes.
* The trainers' set-up and command lines: :func:`use_cpu_devices`,
  :func:`add_common_flags`, :func:`add_fault_timeout_flag`, :func:`flag_overrides`,
  :func:`parse_methods`, :func:`parse_sets`, :func:`data_mesh` and :func:`write_results`
  (the table printed, results.md and results.json).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import traceback
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

import jaxcomp as jc

#: Seconds before a lost peer fails the job (``--fault-timeout``): the heartbeat timeout
#: and the collective timeout. A peer cut off mid-step is detected after about this
#: long (docs/benchmarks.md has the measured times), well within a minute.
DEFAULT_FAULT_TIMEOUT = 30


# ----------------------------------------------------------------------------- distributed


def cpu_platform_selected() -> bool:
  """Whether JAX may run on CPU here: ``JAX_PLATFORMS`` unset, empty or naming cpu."""
  names = [p.strip().lower() for p in os.environ.get("JAX_PLATFORMS", "").split(",")]
  names = [n for n in names if n]
  return not names or "cpu" in names


def check_coordinator(address: str) -> None:
  """Raises ValueError unless ``address`` is ``HOST:PORT`` with a port in 1..65535."""
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"coordinator must be HOST:PORT, got {address!r}")


def check_fault_timeout(seconds: int) -> None:
  """Raises ValueError unless ``seconds`` is a whole number of seconds, at least 1."""
  if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 1:
    raise ValueError(f"--fault-timeout must be a whole number of seconds >= 1, got {seconds!r}")


def collective_timeout_flags(seconds: int) -> list[str]:
  """``XLA_FLAGS`` that fail a CPU collective waiting ``seconds`` for its peers.

  ``xla_cpu_collective_timeout_seconds`` bounds a collective across processes (gloo's
  wait for the peers; XLA's default is 30 minutes). The in-process rendezvous of a
  process's own devices keeps XLA's own bound
  (``xla_cpu_collective_call_terminate_timeout_seconds``, 40 s): its devices are
  threads of one process, which a lost link does not separate.
  """
  check_fault_timeout(seconds)
  return [f"--xla_cpu_collective_timeout_seconds={seconds}"]


def init_distributed(
  coordinator: str,
  num_processes: int,
  process_id: int,
  *,
  devices_per_process: int | None = None,
  initialization_timeout: int = 300,
  fault_timeout: int | None = DEFAULT_FAULT_TIMEOUT,
) -> None:
  """Joins ``jax.distributed``; must run before anything initialises JAX's backends.

  When JAX may use the CPU, first gives the CPU backend ``devices_per_process`` devices
  and gloo collectives (both only shape the CPU backend: on a GPU host ``jax.devices()``
  stays the GPUs, which use NCCL).

  ``fault_timeout`` bounds how long a lost peer goes unnoticed: it is the coordination
  service's heartbeat timeout (a process that sends no heartbeat for that long, being
  dead or cut off, fails the job: every process aborts), the time a finishing process
  waits for the others at shutdown, and XLA's CPU collective timeout
  (:func:`collective_timeout_flags`: a collective whose peers are alive but never
  arrive fails).

  Args:
    coordinator: ``HOST:PORT`` of the coordination service, run by process 0.
    num_processes: N, the number of processes.
    process_id: this process, in ``[0, N)``.
    devices_per_process: CPU devices of this process (None: JAX's default).
    initialization_timeout: seconds to wait for every process to connect.
    fault_timeout: seconds, see above (None: JAX's and XLA's defaults, 100 s of
      heartbeats, 300 s at shutdown, 30 min per collective).

  Raises:
    ValueError: on bad arguments, or when the CPU backend does not end up with
      ``devices_per_process`` local devices.
    RuntimeError: when JAX's backends were initialised already.
  """
  check_coordinator(coordinator)
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(
      f"need 0 <= process_id < num_processes, got process_id "
      f"{process_id}, num_processes {num_processes}"
    )
  if devices_per_process is not None and devices_per_process < 1:
    raise ValueError(f"devices_per_process must be positive, got {devices_per_process}")
  timeouts = {}
  if fault_timeout is not None:
    check_fault_timeout(fault_timeout)
    timeouts = {
      "heartbeat_timeout_seconds": fault_timeout,
      "shutdown_timeout_seconds": fault_timeout,
    }
    # Read once, when the backend is created: that is after this function.
    os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""), *collective_timeout_flags(fault_timeout)]
    ).strip()
  if cpu_platform_selected():
    try:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      if devices_per_process is not None:
        jax.config.update("jax_num_cpu_devices", devices_per_process)
    except RuntimeError as e:
      raise RuntimeError(
        "init_distributed must run before JAX initialises its backends "
        "(before any jax.devices() or computation)"
      ) from e
  jax.distributed.initialize(
    coordinator,
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=initialization_timeout,
    **timeouts,
  )
  if (
    devices_per_process is not None
    and jax.default_backend() == "cpu"
    and jax.local_device_count() != devices_per_process
  ):
    raise ValueError(
      f"asked for {devices_per_process} CPU devices per process, got {jax.local_device_count()}"
    )


@contextlib.contextmanager
def exit_at_once_on_error():
  """On any error in the block, print the traceback and exit at once with code 1.

  ``os._exit`` skips ``atexit``, where ``jax.distributed.shutdown()`` would wait in its
  barrier for a peer that is gone; the process that saw the error leaves now, and its
  exit (or the heartbeat timeout) tells the others.
  """
  try:
    yield
  except BaseException:  # pylint: disable=broad-exception-caught
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_dir(workdir: str, method: str) -> str:
  """``workdir/checkpoints/<method>``, absolute: where ``method``'s checkpoints go."""
  return os.path.abspath(os.path.join(workdir, "checkpoints", method))


def checkpoint_manager(config, workdir: str | None, method: str):
  """Orbax manager of ``workdir/checkpoints/<method>/``; None without checkpointing
  (``config.checkpoint_every`` 0 or no ``workdir``).

  Orbax is imported here only: it is needed only with ``config.checkpoint_every``.
  Saves are asynchronous (written while training goes on); the two latest are kept.
  Orbax writes a step into a temporary directory and renames it once every process has
  written its shards, so a save cut short by a crash is never the latest step; such
  leftovers are deleted when the manager opens. Every process must create it (in a
  multi-process run the processes write their own shards, process 0 the metadata).
  """
  if not config.checkpoint_every or workdir is None:
    return None
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  return ocp.CheckpointManager(
    checkpoint_dir(workdir, method),
    options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True, cleanup_tmp_directories=True),
  )


def run_fingerprint(method: str, config, num_devices: int, **settings) -> dict[str, Any]:
  """What a checkpoint must agree on to be resumed bit-exactly: the method, the device
  count, other ``settings`` of the run and the config (JSON), less the fields that do
  not change the parameters' trajectory (how often to checkpoint, which methods the run
  trains)."""
  fields = dataclasses.asdict(config)
  for name in ("checkpoint_every", "methods"):
    fields.pop(name, None)
  return json.loads(
    json.dumps({"method": method, "num_devices": num_devices, **settings, "config": fields})
  )


def check_fingerprint(saved: dict[str, Any] | None, expected: dict[str, Any], where: str) -> None:
  """Raises ValueError naming the differing settings unless ``saved == expected``."""
  if saved == expected:
    return
  if saved is None:
    raise ValueError(
      f"the checkpoint in {where} records no run settings; remove it or pick another workdir"
    )
  diff = []
  for key in sorted(set(saved) | set(expected)):
    a, b = saved.get(key), expected.get(key)
    if key == "config" and isinstance(a, dict) and isinstance(b, dict):
      diff += [
        f"{k}: {a.get(k)!r} there, {b.get(k)!r} now"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
      ]
    elif a != b:
      diff.append(f"{key}: {a!r} there, {b!r} now")
  raise ValueError(
    f"the checkpoint in {where} belongs to another run ({'; '.join(diff)}): resuming it "
    "would not reproduce the uninterrupted run; remove it or pick another workdir"
  )


def save_checkpoint(checkpoints, step: int, params, opt_state, progress: dict) -> None:
  """Saves params and optimizer state (typed keys as raw data) and ``progress`` (JSON)
  as ``step``. Every process saves its own devices' shards; the JSON is process 0's."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  state = jc.unwrap_keys({"params": params, "opt_state": opt_state})
  progress = json.loads(json.dumps(progress))  # a copy: the save is asynchronous
  checkpoints.save(
    step,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress)
    ),
  )


def restore_checkpoint(checkpoints, tx, init_params, *, mesh, state_specs, local_params=False):
  """``(step, params, opt_state, progress)`` of the latest complete checkpoint.

  The arrays are restored into an abstract target, not a freshly initialised state:
  params replicated (with ``local_params``, one row per device of the 1-D ``mesh``, as
  DiLoCo's replicas hold them), the optimizer state placed by ``state_specs``
  (per-device residuals and keys split over the data axis), each process reading only
  its own devices' rows, so the compiled step takes them as they are.
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  replicated = jax.NamedSharding(mesh, P())
  params = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(np.shape(p), p.dtype, sharding=replicated), init_params
  )
  target = {"opt_state": jc.restore_target(tx, params, mesh=mesh, specs=state_specs)}
  if local_params:
    rows = jax.NamedSharding(mesh, P(mesh.axis_names[0]))
    params = jax.tree.map(
      lambda p: jax.ShapeDtypeStruct((mesh.size, *p.shape), p.dtype, sharding=rows), params
    )
  target["params"] = params
  step = checkpoints.latest_step()
  restored = checkpoints.restore(
    step,
    args=ocp.args.Composite(
      state=ocp.args.StandardRestore(jc.unwrap_keys(target)), progress=ocp.args.JsonRestore()
    ),
  )
  state = jc.wrap_keys(restored.state, target)
  return step, state["params"], state["opt_state"], restored.progress


# ----------------------------------------------------------------------------- digests


def local_leaves(tree) -> list[np.ndarray]:
  """Host copies of the leaves; of a replicated ``jax.Array``, its first local shard."""
  leaves = []
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      leaf = leaf.addressable_data(0)
    leaves.append(np.ascontiguousarray(jax.device_get(leaf)))
  return leaves


def params_digest(params) -> str:
  """sha256 over every leaf's shape, dtype and bytes, in ``jax.tree.leaves`` order."""
  h = hashlib.sha256()
  for leaf in local_leaves(params):
    h.update(f"{leaf.shape}{leaf.dtype}".encode())
    h.update(leaf.tobytes())
  return h.hexdigest()


# ----------------------------------------------------------------------------- divergence

#: The flag that lets a trainer exit 0 although a method diverged.
ALLOW_DIVERGED_FLAG = "--allow-diverged"


@functools.cache
def _all_finite_fn(mesh):
  def fn(leaves):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))

  return jax.jit(fn, out_shardings=jax.NamedSharding(mesh, P()))


def all_finite(tree) -> bool:
  """Whether every floating-point leaf of ``tree`` is finite everywhere.

  The leaves are global arrays on one mesh (replicated, per device or sharded, over
  every process's devices): the check is one jitted reduction whose answer every
  process gets, so every process must call it at the same point of the run.
  """
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not leaves:
    return True
  sharding = getattr(leaves[0], "sharding", None)
  if not isinstance(sharding, jax.NamedSharding):  # host arrays or one device
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in leaves)
  return bool(_all_finite_fn(sharding.mesh)(leaves).addressable_data(0))


@dataclasses.dataclass
class Divergence:
  """Watches a run for non-finite values; ``step`` is where it went non-finite, or None.

  Training losses are cheap to watch (the host has them for every step); parameters
  and evaluation metrics are checked at the evaluation points and at the end
  (:meth:`check`). A non-finite training loss alone is not a divergence, as a step the
  NaN guard (``jc.skip_nonfinite``) skipped leaves the parameters finite and training
  goes on; a check that finds the parameters or the metric non-finite is one, and
  dates it to the first non-finite training loss since the last sound check (else to
  the check itself). Once diverged the run stays diverged (``step`` is kept).
  """

  step: int | None = None  # the first non-finite step of a diverged run
  first_nonfinite_loss: int | None = None  # since the last sound check

  def loss(self, step: int, value: float) -> None:
    """Records the training loss of ``step`` (the mean over the devices)."""
    if self.first_nonfinite_loss is None and not math.isfinite(value):
      self.first_nonfinite_loss = step

  def check(self, step: int, *finite: bool) -> bool:
    """At ``step``, whether the parameters, the metric... were finite (``finite``);
    returns whether the run has diverged by now.

    Every process must call it at the same steps with the same ``finite`` (from global
    checks: :func:`all_finite`, a metric reduced over the mesh). A process watching only
    its own devices' losses may not have seen the first non-finite one: the date is the
    earliest over the processes (one host all-gather, when diverging).
    """
    if self.step is None:
      if all(finite):
        self.first_nonfinite_loss = None
      else:
        self.step = earliest_over_processes(self.first_nonfinite_loss) or step
    return self.step is not None

  @property
  def diverged(self) -> bool:
    return self.step is not None

  def state(self) -> dict[str, int | None]:
    """A JSON record (checkpoints keep it): ``Divergence(**d.state())`` resumes it."""
    return dataclasses.asdict(self)


def earliest_over_processes(step: int | None) -> int | None:
  """The smallest ``step`` any process holds (None: none); a collective when
  multi-process, which every process must call."""
  if jax.process_count() == 1:
    return step
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  held = multihost_utils.process_allgather(np.int32(-1 if step is None else step))
  held = [int(s) for s in np.ravel(held) if s >= 0]
  return min(held) if held else None


def diverged_note(step: int | None) -> str:
  """The table cell of a diverged method's metric: ``diverged at step N``."""
  return f"diverged at step {step}"


def bytes_cells(r: dict[str, Any], unit: str = "step") -> tuple[str, str]:
  """The bytes and ratio cells of a method's row in a results table: ``n/a`` without a
  byte count, and ``none sent (first exchange at step N)`` when the run stopped before
  the exchange whose bytes they report ever ran (``r["exchanged"]`` false; the trainers'
  ``first_exchange_step``)."""
  if r["bytes_received"] is None:
    return "n/a", "n/a"
  if not r.get("exchanged", True):
    return f"none sent (first exchange at {unit} {r['first_exchange_step']})", "n/a"
  return f"{r['bytes_received']:,.0f}", f"{r['ratio']:.1f}x"


def diverged_exit_code(
  results: dict[str, dict[str, Any]], *, allow: bool, unit: str = "step"
) -> int:
  """The trainer's exit code: 1 when a method of ``results`` diverged (each record's
  ``nonfinite_step`` not None), with a line on stderr naming them, unless ``allow``
  (``--allow-diverged``); else 0."""
  diverged = {m: r["nonfinite_step"] for m, r in results.items() if r.get("nonfinite_step")}
  if not diverged:
    return 0
  names = ", ".join(f"{m} at {unit} {step}" for m, step in diverged.items())
  if allow:
    print(f"warning: diverged (non-finite loss or parameters): {names}", file=sys.stderr)
    return 0
  print(
    f"error: diverged (non-finite loss or parameters): {names}; their rows say so in the"
    f" table and in results.json. {ALLOW_DIVERGED_FLAG} exits 0 anyway.",
    file=sys.stderr,
  )
  return 1


# ----------------------------------------------------------------------------- trainers


def use_cpu_devices(n: int) -> None:
  """Gives the CPU backend ``n`` devices, so the exchange runs for real between them.

  Must run before JAX initialises its backends; if they are already up (imported late)
  they keep their devices. On a GPU host the setting is inert: the GPUs are the devices.
  """
  if cpu_platform_selected():
    try:
      jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
      pass


def add_common_flags(parser: argparse.ArgumentParser) -> None:
  """The flags every trainer has: ``--set FIELD=VALUE`` (:func:`parse_sets`) and
  ``--allow-diverged`` (:func:`diverged_exit_code`)."""
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="FIELD=VALUE",
    help="override any config field (repeatable), e.g. --set diloco_sync_every=5",
  )
  parser.add_argument(
    ALLOW_DIVERGED_FLAG,
    action="store_true",
    help="exit 0 even when a method diverged (went non-finite; exit code 1 otherwise)",
  )


def add_fault_timeout_flag(parser, who: str) -> None:
  """``--fault-timeout SECONDS`` (default :data:`DEFAULT_FAULT_TIMEOUT`); ``who`` names
  what fails the run: "process" or "worker"."""
  parser.add_argument(
    "--fault-timeout",
    type=int,
    default=DEFAULT_FAULT_TIMEOUT,
    metavar="SECONDS",
    help=f"a {who} that sends no heartbeat for SECONDS (dead, or cut off) or a collective"
    " that waits SECONDS for its peers fails the run (0: JAX's and XLA's defaults,"
    f" 100 s and 30 min; default {DEFAULT_FAULT_TIMEOUT})",
  )


def flag_overrides(args, flags: Sequence[tuple[str, str, int | None]]) -> dict[str, Any]:
  """``(flag, field, minimum)`` triples -> ``{field: value}`` for the flags given on the
  command line (not None), each checked against its minimum (None: any value)."""
  overrides = {}
  for flag, field, minimum in flags:
    value = getattr(args, flag, None)
    if value is None:
      continue
    if minimum is not None and value < minimum:
      bound = "positive" if minimum == 1 else f">= {minimum}"
      raise ValueError(f"--{flag.replace('_', '-')} must be {bound}, got {value}")
    overrides[field] = value
  return overrides


def parse_methods(text: str, allowed: Sequence[str], flag: str = "--methods") -> tuple[str, ...]:
  """``"dense,onebit"`` -> ``("dense", "onebit")``, each one of ``allowed``."""
  methods = tuple(m.strip() for m in text.split(",") if m.strip())
  unknown = [m for m in methods if m not in allowed]
  if unknown or not methods:
    raise ValueError(f"{flag}: unknown {unknown}; choose from {','.join(allowed)}")
  return methods


def parse_sets(config, items: Sequence[str]) -> dict[str, Any]:
  """``--set FIELD=VALUE`` pairs as overrides of ``config``'s fields, each VALUE parsed
  as the field's current value's type (bool from true/false, tuples comma-separated)."""
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  out = {}
  for item in items:
    name, sep, text = item.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in fields:
      raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
    current = fields[name]
    try:
      if isinstance(current, bool):
        if text.lower() not in ("true", "false", "1", "0"):
          raise ValueError(text)
        value = text.lower() in ("true", "1")
      elif isinstance(current, tuple):
        value = tuple(v.strip() for v in text.split(",") if v.strip())
      else:
        value = type(current)(text)
    except ValueError as e:
      raise ValueError(f"--set {item!r}: {text!r} is not a {type(current).__name__}") from e
    out[name] = value
  return out


def data_mesh(axis: str) -> jax.sharding.Mesh:
  """The data-parallel mesh: every device of every process on one explicit axis."""
  k = jax.device_count()
  return jax.make_mesh((k,), (axis,), axis_types=(jax.sharding.AxisType.Explicit,))


def write_results(workdir: str, table: str, record: dict[str, Any]) -> None:
  """Prints the results table and writes it to ``WORKDIR/results.md``, and ``record``
  (config, devices, every method's results) to ``WORKDIR/results.json``."""
  print(table)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(record, f, indent=2)
