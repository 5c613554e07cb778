r"""Multi-process MNIST-1D training on ``jax.distributed``: one launcher, N workers.

From the repository root::

  python -m benchmarks.launch --processes 2 --devices-per-process 2 \
      --method dense,qsgd4,onebit,dgc --config quick --steps 5
  python -m benchmarks.launch --config benchmarks/configs/params2m.py --method dense,onebit
  python -m benchmarks.launch --method dgc --steps 500 --checkpoint-every 50  # resumable

What the launcher does, checks and writes, and what it says when a worker dies:
docs/guides/multiprocess.md. The worker side is :func:`train_worker`, the launcher's
:func:`launch`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
import contextlib
import ctypes
import dataclasses
import fcntl
import json
import os
import pathlib
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import jax

from benchmarks._timing import md_head
from benchmarks._timing import md_row
from examples import common
from examples.mnist1d import configs as example_configs
from examples.mnist1d import train
import jaxcomp as jc

MODULE = "benchmarks.launch"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The benchmarks' own configs, looked up by name before the example's.
CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"
# A worker prints its result as one stdout line: this marker, then the JSON.
RESULT_MARKER = "JAXCOMP_WORKER_RESULT "
#: Seconds before a lost peer fails the job (``--fault-timeout``).
DEFAULT_FAULT_TIMEOUT = common.DEFAULT_FAULT_TIMEOUT
LOCK_NAME = "launch.lock"
PR_SET_PDEATHSIG = 1  # prctl's option (linux/prctl.h)

Prefix = Callable[[int], Sequence[str]]
Env = Mapping[str, str] | Callable[[int], Mapping[str, str]]

# The worker side's distributed set-up, shared with the trainers (examples/common.py).
collective_timeout_flags = common.collective_timeout_flags
init_distributed = common.init_distributed
#: ``params_digest(params)``: sha256 over the leaves' shapes, dtypes and bytes.
params_digest = common.params_digest


# ----------------------------------------------------------------------------- worker


def parse_methods(text: str) -> tuple[str, ...]:
  """``"dense,onebit"`` -> ``("dense", "onebit")``, each one of ``train.ALL_METHODS``."""
  methods = common.parse_methods(text, train.ALL_METHODS, "--method")
  if len(set(methods)) != len(methods):
    raise ValueError(f"--method: repeated method in {text!r}")
  return methods


def config_names() -> list[str]:
  """``--config`` names: the modules of ``benchmarks/configs`` and ``examples/mnist1d/configs``."""
  ours = {p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_")}
  return sorted(ours | set(example_configs.names()))


def load_config(name: str, *, steps=None, seed=None, batch=None, checkpoint_every=None):
  """``get_config()`` of ``name``, a module of ``benchmarks/configs`` or else of
  ``examples/mnist1d/configs`` or a ``.py`` file's path, with the overrides (ints; None:
  the config's) applied."""
  if not name.endswith(".py"):
    if name not in config_names():
      raise ValueError(
        f"--config: unknown {name!r}; choose from {','.join(config_names())} "
        "or give the path of a config file"
      )
    ours = CONFIG_DIR / f"{name}.py"
    name = str(ours) if ours.is_file() else name
  overrides = common.flag_overrides(
    argparse.Namespace(steps=steps, batch=batch, seed=seed, checkpoint_every=checkpoint_every),
    (
      ("steps", "num_steps", 1),
      ("batch", "per_device_batch_size", 1),
      ("seed", "seed", None),
      ("checkpoint_every", "checkpoint_every", 0),
    ),
  )
  return dataclasses.replace(example_configs.load(name).get_config(), **overrides)


def train_worker(
  config, methods: Sequence[str], workdir: str, *, evaluate: bool = False, profile: int = 0
) -> dict[str, Any]:
  """This process's part of training every method in turn (``train.train_method``) on a
  mesh spanning the processes (``jax.distributed`` is up, every process calls this).
  Returns the ``worker{i}.json`` record: the job's shape, and per method the trainer's
  record with ``median_step_time_s`` over the steps after the first (None: none ran)."""
  mesh, data, model, init_params = train.setup(config, workdir)
  pid = jax.process_index()
  result = {
    "process_id": pid,
    "num_processes": jax.process_count(),
    "num_devices": jax.device_count(),
    "local_devices": jax.local_device_count(),
    "platform": jax.default_backend(),
    "num_params": int(sum(p.size for p in jax.tree.leaves(init_params))),
    "global_batch": jax.device_count() * config.per_device_batch_size,
    "init_params_sha256": params_digest(init_params),
    "methods": {},
  }
  run = dict(
    model=model, init_params=init_params, data=data, mesh=mesh, workdir=workdir, profile=profile
  )
  for method in methods:
    record = train.train_method(method, config, evaluate=evaluate, **run)
    times = record["step_times_s"]
    median = statistics.median(times[1:] or times) if times else None
    result["methods"][method] = {
      "method": method,
      "num_steps": config.num_steps,
      "median_step_time_s": median,
      "final_loss": record["losses"][-1],
      **record,
    }
    print(
      f"[process {pid}] {method}: {config.num_steps} steps (from step {record['start_step']}), "
      f"final loss {record['losses'][-1]:.4f}, median step "
      f"{'n/a' if median is None else f'{1e3 * median:.1f} ms'}, "
      f"compile {record['compile_time_s']:.1f} s, params {record['params_sha256'][:16]}",
      flush=True,
    )
  return result


def run_worker(args: argparse.Namespace) -> None:
  """Worker mode: join the job, train, write ``WORKDIR/worker{i}.json`` and print it as
  the :data:`RESULT_MARKER` line, leave together with the others. On an error it exits
  at once (code 1), not waiting in the shutdown barrier for a lost peer."""
  if sys.platform.startswith("linux"):  # SIGKILL when the launcher dies, even by SIGKILL
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
  with common.exit_at_once_on_error():
    overrides = {k: getattr(args, k) for k in ("steps", "seed", "batch", "checkpoint_every")}
    config = load_config(args.config, **overrides)
    methods = parse_methods(args.method)
    init_distributed(
      args.coordinator,
      args.num_processes,
      args.process_id,
      devices_per_process=args.devices_per_process,
      fault_timeout=args.fault_timeout or None,
    )
    result = train_worker(config, methods, args.workdir, evaluate=args.eval, profile=args.profile)
    with open(os.path.join(args.workdir, f"worker{args.process_id}.json"), "w") as f:
      json.dump(result, f, indent=2)
    print(RESULT_MARKER + json.dumps(result), flush=True)
  jax.distributed.shutdown()  # a barrier: no process leaves while others still run


# ----------------------------------------------------------------------------- launcher


class LaunchError(RuntimeError):
  """A worker failed, or the workers timed out; ``outputs`` holds what they printed,
  ``failed`` the worker that failed first (None on a timeout or a missing result)."""

  def __init__(self, message: str, outputs: Sequence[WorkerOutput] = (), *, failed=None):
    super().__init__(message)
    self.outputs = list(outputs)
    self.failed = failed


class WorkdirLockedError(RuntimeError):
  """Another launch holds the workdir (its checkpoints and results)."""


class ParamsMismatchError(RuntimeError):
  """The processes (or one process's devices) ended with different parameters."""


@dataclasses.dataclass
class WorkerOutput:
  """One worker process: its command, exit code (None: still running) and output lines."""

  process_id: int
  command: list[str]
  returncode: int | None = None
  pid: int | None = None
  failed_after_s: float | None = None  # since the start, when it was seen failing
  stdout: list[str] = dataclasses.field(default_factory=list)
  stderr: list[str] = dataclasses.field(default_factory=list)

  def tail(self, lines: int = 30) -> str:
    """The last ``lines`` lines of stderr (of stdout when stderr is empty): the launcher's
    error quotes them."""
    return "\n".join((self.stderr or self.stdout)[-lines:])


def free_port() -> int:
  """A TCP port free now on 127.0.0.1."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_args(
  methods: Sequence[str] | str,
  *,
  config: str = "default",
  devices_per_process: int | None = None,
  steps: int | None = None,
  seed: int | None = None,
  batch: int | None = None,
  workdir: str | None = None,
  evaluate: bool = False,
  profile: int = 0,
  checkpoint_every: int | None = None,
  fault_timeout: int | None = None,
) -> list[str]:
  """The flags of the worker command line shared by all processes (for :func:`launch`),
  checked here so that a bad one fails once, not in N workers. ``fault_timeout`` None
  leaves the workers' default (:data:`DEFAULT_FAULT_TIMEOUT`), 0 JAX's and XLA's own."""
  methods = methods if isinstance(methods, str) else ",".join(methods)
  parse_methods(methods)
  if config.endswith(".py"):
    config = os.path.abspath(config)  # a path the workers find wherever they start
  load_config(config, steps=steps, seed=seed, batch=batch, checkpoint_every=checkpoint_every)
  if fault_timeout:
    common.check_fault_timeout(fault_timeout)
  if profile < 0:
    raise ValueError(f"--profile must be >= 0, got {profile}")
  args = ["--method", methods, "--config", config]
  for flag, value in (
    ("--devices-per-process", devices_per_process),
    ("--steps", steps),
    ("--seed", seed),
    ("--batch", batch),
    ("--workdir", workdir),
    ("--checkpoint-every", checkpoint_every),
    ("--fault-timeout", fault_timeout),
    ("--profile", profile or None),
  ):
    if value is not None:
      args += [flag, str(value)]
  return args + (["--eval"] if evaluate else [])


def worker_commands(
  module: str,
  flags: Sequence[str],
  *,
  processes: int,
  coordinator: str,
  prefix: Prefix | None = None,
) -> list[list[str]]:
  """``[*prefix(i), python, -m, module, *flags, <the job's flags>]`` for each process ``i``:
  ``--num-processes``, ``--coordinator`` (process 0's ``HOST:PORT``) and ``--process-id``;
  ``prefix`` puts e.g. ``ip netns exec NS`` before it."""
  job = ["--num-processes", str(processes), "--coordinator", coordinator]
  return [
    [*(prefix(i) if prefix is not None else ()), sys.executable, "-m", module, *flags, *job]
    + ["--process-id", str(i)]
    for i in range(processes)
  ]


def worker_env(process_id: int, env: Env | None) -> dict[str, str]:
  """This environment, ``env`` (or ``env(process_id)``) on top, the repo on PYTHONPATH."""
  out = dict(os.environ)
  out.update(env(process_id) if callable(env) else (env or {}))
  path = out.get("PYTHONPATH")
  out["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
  out.setdefault("PYTHONUNBUFFERED", "1")
  return out


_ECHO_LOCK = threading.Lock()


def _echo(stream, line: str) -> None:
  with _ECHO_LOCK:  # whole lines: the threads of stdout and stderr share a terminal
    stream.write(line + "\n")
    stream.flush()


def _read_lines(pipe, lines: list[str], echo, label: str) -> None:
  """Reader thread: appends each line of ``pipe`` to ``lines``, echoing it if asked."""
  for line in pipe:
    lines.append(line.rstrip("\n"))
    if echo is not None and not lines[-1].startswith(RESULT_MARKER):
      _echo(echo, f"{label} {lines[-1]}")
  pipe.close()


def kill_groups(procs: Sequence[subprocess.Popen]) -> None:
  """SIGTERM, then SIGKILL 2 s later, to each still-running process's group. (In
  ``jax.distributed`` a worker's preemption notifier catches SIGTERM: only the SIGKILL
  stops it. The SIGTERM is for prefixes that relay it, like sudo.)"""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)  # the worker's own session: it and its children only
    deadline = time.monotonic() + 2.0
    for p in alive:
      with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(max(0.0, deadline - time.monotonic()))


def _root_failure(outputs, procs) -> WorkerOutput | None:
  """The worker whose failure is the cause, of those that exited non-zero so far: one
  killed by a signal first, as its peers then exit with a "lost peer" error of their own,
  often within the same poll interval, which would hide the death that caused it."""
  failed = [(p.returncode, o) for o, p in zip(outputs, procs) if p.poll()]
  signalled = [o for rc, o in failed if rc < 0]
  return (signalled or [o for _, o in failed] or [None])[0]


def run_processes(
  commands: Sequence[Sequence[str]],
  *,
  env: Env | None = None,
  timeout: float | None = None,
  stream: bool = False,
  pass_fds: Sequence[int] = (),
) -> list[WorkerOutput]:
  """Runs ``commands[i]`` as worker ``i``, each in its own session (Ctrl-C reaches only
  this process, which then kills them); all succeed, or all are killed and a
  :class:`LaunchError` says which failed first (or that ``timeout`` seconds passed). With
  ``stream``, their pids and lines are echoed as they come, prefixed ``[wI]``.
  ``pass_fds`` stay open in the workers (the workdir lock's: held while any worker lives)."""
  outputs = [WorkerOutput(i, list(c)) for i, c in enumerate(commands)]
  procs, readers = [], []
  try:
    for out in outputs:
      p = subprocess.Popen(
        out.command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        bufsize=1,
        env=worker_env(out.process_id, env),
        start_new_session=True,
        pass_fds=tuple(pass_fds),
      )
      procs.append(p)
      out.pid = p.pid
      if stream:
        _echo(sys.stderr, f"[launch] worker {out.process_id}: pid {p.pid}")
      for name in ("stdout", "stderr"):  # into out.stdout, echoed to sys.stdout; stderr
        echo = getattr(sys, name) if stream else None
        args = (getattr(p, name), getattr(out, name), echo, f"[w{out.process_id}]")
        readers.append(threading.Thread(target=_read_lines, args=args, daemon=True))
        readers[-1].start()
    start = time.monotonic()
    failed = None
    while failed is None and any(p.poll() is None for p in procs):
      if timeout is not None and time.monotonic() - start > timeout:
        break
      time.sleep(0.05)  # a worker's exit is seen within this
      failed = _root_failure(outputs, procs)
    failed = failed or _root_failure(outputs, procs)
    timed_out = failed is None and any(p.poll() is None for p in procs)
    if failed is not None:
      failed.failed_after_s = time.monotonic() - start
    kill_groups(procs)
    for t in readers:
      t.join(timeout=5.0)  # drain the pipes
    for out, p in zip(outputs, procs):
      out.returncode = p.returncode
    if timed_out:
      tails = [
        f"--- worker {o.process_id} (exit {o.returncode}) ---\n{o.tail(10)}" for o in outputs
      ]
      message = f"workers timed out after {timeout:g} s; last output:\n" + "\n".join(tails)
      raise LaunchError(message, outputs)
    if failed is not None:
      raise LaunchError(
        f"worker {failed.process_id} exited with code "
        f"{failed.returncode}; its output ends with:\n{failed.tail()}",
        outputs,
        failed=failed,
      )
    return outputs
  finally:
    kill_groups(procs)  # on any exception (Ctrl-C included) no worker outlives the launcher


def worker_results(
  commands: Sequence[Sequence[str]], marker: str, *, every: bool = False, **kwargs
) -> Any:
  """Runs ``commands`` (:func:`run_processes`, given ``kwargs``) and returns the JSON that
  process 0 (or, with ``every``, each process, in a list) printed on one stdout line
  after ``marker``; a worker without that line is a :class:`LaunchError`."""
  results = []
  for out in run_processes(commands, **kwargs)[: None if every else 1]:
    line = next((x for x in reversed(out.stdout) if x.startswith(marker)), None)
    if line is None:
      raise LaunchError(
        f"worker {out.process_id} exited without a result line; its output ends with:\n"
        + out.tail(),
        [out],
      )
    results.append(json.loads(line[len(marker) :]))
  return results if every else results[0]


def launch(
  args: Sequence[str],
  *,
  processes: int,
  prefix: Prefix | None = None,
  env: Env | None = None,
  coordinator: str | None = None,
  timeout: float | None = 600.0,
  stream: bool = False,
  pass_fds: Sequence[int] = (),
) -> list[dict[str, Any]]:
  """Runs ``processes`` workers of this module with the flags ``args``
  (:func:`worker_args`) and returns their results (:func:`train_worker`) by process id;
  ``prefix``, ``coordinator`` (default: a free port on 127.0.0.1): as
  :func:`worker_commands`, ``env``: as :func:`worker_env`, the rest as
  :func:`run_processes`. A :class:`LaunchError` when a worker failed or gave no result."""
  if processes < 1:
    raise ValueError(f"processes must be positive, got {processes}")
  if timeout is not None and timeout <= 0:
    raise ValueError(f"timeout must be positive, got {timeout}")
  if coordinator is None:
    coordinator = f"127.0.0.1:{free_port()}"
  common.check_coordinator(coordinator)
  job = dict(processes=processes, coordinator=coordinator, prefix=prefix)
  commands = worker_commands(MODULE, [*args, "--worker"], **job)
  run = dict(env=env, timeout=timeout, stream=stream, pass_fds=pass_fds)
  return worker_results(commands, RESULT_MARKER, every=True, **run)


def check_identical(results: Sequence[dict[str, Any]]) -> None:
  """Raises ParamsMismatchError unless every method ends with the same parameters
  on every device of every process."""
  for method in results[0]["methods"]:
    digests = {r["process_id"]: r["methods"][method]["params_sha256"] for r in results}
    if len(set(digests.values())) != 1:
      raise ParamsMismatchError(f"{method}: the processes' parameters differ: {digests}")
    split = [r["process_id"] for r in results if not r["methods"][method]["local_copies_identical"]]
    if split:
      raise ParamsMismatchError(
        f"{method}: the devices of processes {split} hold different parameters"
      )


def summary(results: Sequence[dict[str, Any]]) -> str:
  """A Markdown table: one row per method, with the step times of every process; a
  diverged method's final loss reads ``diverged at step N``, the bytes of one that never
  reached its exchange ``none sent`` (``common.bytes_cells``)."""
  r0 = results[0]
  head = "method | final loss | test acc (%) | median step (ms) | bytes recv/device/step"
  lines = [
    f"{len(results)} processes x {r0['local_devices']} {r0['platform']} devices, "
    f"{r0['num_params']:,} parameters, global batch {r0['global_batch']}. Median step:"
    " wall time of the steps after the first, in process order.",
    "",
    md_head(f"{head} | ratio vs dense | params sha256 | identical", "lrrrrrll"),
  ]
  for method, m in r0["methods"].items():
    runs = [r["methods"][method] for r in results]
    # Diverged: the same in every process (global losses and parameters).
    loss = (
      common.diverged_note(m["nonfinite_step"]) if m.get("diverged") else f"{m['final_loss']:.4f}"
    )
    ms = [run["median_step_time_s"] for run in runs]
    times = " / ".join("n/a" if t is None else f"{1e3 * t:.1f}" for t in ms)
    same = len({run["params_sha256"] for run in runs}) == 1 and all(
      run["local_copies_identical"] for run in runs
    )
    acc = "n/a" if m["test_accuracy"] is None else f"{100 * m['test_accuracy']:.1f}"
    recv, ratio = common.bytes_cells(m)
    digest = m["params_sha256"][:16]
    lines.append(md_row(method, loss, acc, times, recv, ratio, digest, "yes" if same else "NO"))
  return "\n".join(lines) + phase_table(results)


PHASE_COLUMNS = (*jc.PhaseProfile.PHASES, "idle")  # the columns of a phase table


def phase_row(label: str, phases: dict[str, Any]) -> str:
  """One row of a phase table: ``label``'s cells, the step, then each phase (ms)."""
  return md_row(label, f"{phases['step_ms']:.1f}", *(f"{phases[c]:.1f}" for c in PHASE_COLUMNS))


def phase_table(results: Sequence[dict[str, Any]]) -> str:
  """Markdown: each profiled method's step split by phase (ms), every process; or ""."""
  rows = []
  for method in results[0]["methods"]:
    for r in results:
      ph = r["methods"][method].get("phases")
      if ph:
        lost = f" ({len(ph['untraced'])} kernels untraced)" if ph.get("untraced") else ""
        rows.append(phase_row(f"{method}{lost} | {r['process_id']}", ph))
  if not rows:
    return ""
  head = md_head("method | process | step | " + " | ".join(PHASE_COLUMNS))
  return (
    "\n\nWhere a step's time goes (ms per step, jc.profile_phases over the profiled steps;"
    " exchange includes waiting for the other processes):\n\n" + "\n".join([head, *rows])
  )


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
  """Command-line flags of both modes."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  methods = ",".join(train.ALL_METHODS)
  configs = f"{','.join(config_names())} (benchmarks/configs, examples/mnist1d/configs)"
  for flag, kind, default, text in (
    ("--processes", int, 2, "N worker processes"),
    ("--devices-per-process", int, 1, "CPU devices per process (not used on GPU)"),
    ("--method", str, "dense", f"comma-separated methods of {methods}, trained in turn"),
    ("--config", str, "default", f"one of {configs}, or a .py file's path (get_config())"),
    ("--steps", int, None, "override num_steps"),
    ("--batch", int, None, "override per_device_batch_size"),
    ("--seed", int, None, "override the init/shuffling seed (the data set stays fixed)"),
    ("--workdir", str, "runs/mnist1d_launch", "output directory (worker{i}.json, data cache)"),
    ("--timeout", float, 600.0, "seconds before all workers are killed"),
    ("--coordinator", str, None, "HOST:PORT of the coordinator (default: 127.0.0.1, free port)"),
    ("--profile", int, 0, "after training, split this many more steps by phase (encode, ...)"),
  ):
    parser.add_argument(flag, type=kind, default=default, help=text)
  parser.add_argument("--eval", action="store_true", help="test accuracy after each method")
  parser.add_argument(
    "--checkpoint-every",
    type=int,
    metavar="N",
    help="checkpoint every N steps (and at the last) in WORKDIR/checkpoints/METHOD; the"
    " same command resumes from the latest complete one (0: off, the default)",
  )
  common.add_fault_timeout_flag(parser, "worker")
  parser.add_argument(
    common.ALLOW_DIVERGED_FLAG,
    action="store_true",
    help="exit 0 even when a method diverged (went non-finite; exit code 1 otherwise)",
  )
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker and None in (args.process_id, args.num_processes, args.coordinator):
    parser.error("--worker needs --process-id, --num-processes and --coordinator")
  return args


@contextlib.contextmanager
def workdir_lock(workdir: str):
  """Holds ``WORKDIR/launch.lock`` (an exclusive ``flock``; the file names the owner) for
  one launch at a time, else a :class:`WorkdirLockedError` naming the owner; yields its
  descriptor. The kernel drops it when the last process holding the descriptor ends (pass
  it to the workers: it then lasts while any lives), so a killed launch's is taken over."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOCK_NAME)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    owner = os.pread(fd, 256, 0).decode(errors="replace").strip()
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise WorkdirLockedError(
        f"{workdir} is in use by another launch ({owner or 'owner unknown'}; lock file "
        f"{path}): wait for it to end, or pass another --workdir"
      ) from None
    if owner:  # flock got: the owner ended without releasing it (killed)
      note = f"taking over the stale lock of {owner} (it ended without releasing it): {path}"
      print(f"[launch] {note}", file=sys.stderr)
    os.ftruncate(fd, 0)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()} since {stamp}\n".encode(), 0)
    try:
      yield fd
    finally:
      os.ftruncate(fd, 0)  # released by its owner: an empty file is no stale lock
  finally:
    os.close(fd)


def complete_checkpoints(workdir: str, methods: Sequence[str]) -> dict[str, int | None]:
  """Per method, the latest complete (finalized) checkpoint step in
  ``WORKDIR/checkpoints/<method>``, or None. Orbax writes a step in a temporary
  directory and renames it to the bare step number once every process has written."""
  latest = {}
  for method in methods:
    d = common.checkpoint_dir(workdir, method)
    steps = [int(n) for n in os.listdir(d) if n.isdigit()] if os.path.isdir(d) else []
    latest[method] = max(steps, default=None)
  return latest


# What a failed worker's stderr says, most specific first: pattern -> cause; ``{0}`` is
# the pattern's group. The coordination service names a process that stopped sending
# heartbeats (dead, or cut off); gloo names a collective that waited too long.
_SILENT = "sent no heartbeat within the heartbeat timeout (dead or cut off)"
FAILURE_CAUSES = {
  r"Task (\d+) heartbeat timeout": "lost peer: process {0} " + _SILENT,
  r"(stopped sending heartbeats)": "lost peer: a process " + _SILENT,
  r"Timed out waiting (\d+)ms for \w+ operation": (
    "timeout: a collective waited {0} ms for its peers"
  ),
  r"(?i)(heartbeat)": "lost peer: heartbeats to the coordinator failed",
  r"(?i)(connection (closed|reset|refused)|broken pipe|socket closed)": (
    "lost peer: a connection to it was closed"
  ),
  r"(distributed service detected fatal errors)": (
    "the coordination service reported a failed process"
  ),
}


def failure_cause(*stderrs: Sequence[str]) -> str | None:
  """The most specific of :data:`FAILURE_CAUSES` found in the stderr lines, searched
  in the order given (the failed worker's first), or None."""
  for pattern, cause in FAILURE_CAUSES.items():
    for lines in stderrs:
      for line in reversed(lines):
        found = re.search(pattern, line)
        if found:
          return cause.format(found.group(1))
  return None


def describe_failure(error: LaunchError) -> str:
  """Which worker failed and how: ``worker 1 (pid 42) was killed by SIGKILL after 3.1 s``,
  with the cause its stderr names (lost peer, collective timeout)."""
  w = error.failed
  if w is None:
    return str(error).splitlines()[0]
  rc = w.returncode
  if rc == -signal.SIGABRT:
    how = "aborted (SIGABRT)"
  elif rc is not None and rc < 0:
    try:
      how = f"was killed by {signal.Signals(-rc).name}"
    except ValueError:
      how = f"was killed by signal {-rc}"
  else:
    how = f"exited with code {rc}"
  after = "" if w.failed_after_s is None else f" {w.failed_after_s:.1f} s after the start"
  cause = None
  if rc is None or -rc not in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
    # It died of an error it detected (SIGABRT, exit code): the cause is in its
    # stderr or, when it only heard that another failed, in the others'. (A killed
    # worker's cause is the kill; the others' errors are its consequences.)
    cause = failure_cause(w.stderr, *[o.stderr for o in error.outputs if o is not w])
  return f"worker {w.process_id} (pid {w.pid}) {how}{after}" + (f": {cause}" if cause else "")


def failure_line(
  error: LaunchError,
  *,
  workdir: str,
  methods: Sequence[str],
  checkpoint_every: int | None,
  command: str,
) -> str:
  """One line for a failed launch: what failed, the last complete checkpoints, and the
  command that resumes (the same command) or reruns."""
  latest = complete_checkpoints(workdir, methods) if checkpoint_every else {}
  checkpoints = os.path.join(workdir, "checkpoints")
  if not checkpoint_every:
    where = "no checkpoints kept (--checkpoint-every N keeps them)"
    resume = f"rerun from step 0: {command}"
  elif all(step is None for step in latest.values()):
    where = f"no complete checkpoint in {checkpoints}"
    resume = f"rerun (starts at step 0): {command}"
  else:
    steps = ", ".join(f"{m} step {'none' if s is None else s}" for m, s in latest.items())
    where = f"last complete checkpoint: {steps} ({checkpoints})"
    resume = f"resume with the same command: {command}"
  return f"{describe_failure(error)}; {where}; {resume}"


def run_launcher(args: argparse.Namespace, command: str = "") -> list[dict[str, Any]]:
  """Launcher mode: lock the workdir, start the workers, check their parameters, print
  a summary. ``command`` (the command line that resumes) goes into a failure's line."""
  workdir = os.path.abspath(args.workdir)
  keys = "config devices_per_process steps seed batch profile checkpoint_every fault_timeout"
  forwarded = {k: getattr(args, k) for k in keys.split()}
  flags = worker_args(args.method, workdir=workdir, evaluate=args.eval, **forwarded)
  start = time.perf_counter()
  with workdir_lock(workdir) as lock:
    try:
      results = launch(
        flags,
        processes=args.processes,
        coordinator=args.coordinator,
        timeout=args.timeout,
        stream=True,
        pass_fds=(lock,),
      )
    except LaunchError as e:
      where = dict(workdir=workdir, methods=parse_methods(args.method))
      command = command or f"python -m {MODULE} ..."
      line = failure_line(e, **where, checkpoint_every=args.checkpoint_every, command=command)
      raise LaunchError(line, e.outputs, failed=e.failed) from e
  print(summary(results))
  where = os.path.join(workdir, "worker*.json")
  print(f"wall time {time.perf_counter() - start:.1f} s; results in {where}")
  check_identical(results)
  return results


def raise_keyboard_interrupt(signum, frame):
  """A signal handler: SIGTERM unwinds like Ctrl-C (so cleanup code runs)."""
  del signum, frame
  raise KeyboardInterrupt


def main(argv=None) -> int:
  """Runs the worker or the launcher; returns the exit code (the launcher's: 1 when a
  worker failed or a method diverged, unless ``--allow-diverged`` for the latter)."""
  args = parse_args(argv)
  if args.worker:
    run_worker(args)
    return 0
  # A SIGTERM unwinds like Ctrl-C (run_processes kills the workers on the way out):
  # they run in their own sessions, so a signal to the launcher does not reach them.
  signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
  command = shlex.join(["python", "-m", MODULE, *(sys.argv[1:] if argv is None else argv)])
  try:
    results = run_launcher(args, command)
  except (LaunchError, ParamsMismatchError, WorkdirLockedError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print("interrupted: workers killed", file=sys.stderr)
    return 130
  return common.diverged_exit_code(results[0]["methods"], allow=args.allow_diverged)


if __name__ == "__main__":
  sys.exit(main())
