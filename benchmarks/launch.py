r"""Multi-process MNIST-1D training on ``jax.distributed``: one launcher, N workers.

From the repository root::

  python -m benchmarks.launch --processes 2 --devices-per-process 2 \
      --method dense,qsgd4,onebit,dgc --config quick --steps 5
  python -m benchmarks.launch --config benchmarks/configs/params2m.py --method dense,onebit
  python -m benchmarks.launch --method dgc --steps 500 --checkpoint-every 50  # resumable

``--config`` takes a name (``benchmarks/configs``, then ``examples/mnist1d/configs``) or a
config file's path. What the launcher does, checks and writes, and what it says when a
worker dies: docs/guides/multiprocess.md. The launcher side is :func:`launch`,
:func:`run_processes`, :func:`check_identical`, :func:`summary`, :func:`workdir_lock` and
:func:`failure_line`; the worker side :func:`train_worker` (``examples/mnist1d/train.py``
on a mesh over every process's devices), which prints its result as one stdout line
starting with :data:`RESULT_MARKER`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
import contextlib
import dataclasses
import fcntl
import importlib
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

# Lines of a failing worker's stderr quoted in the launcher's error.
TAIL_LINES = 30

#: Seconds before a lost peer fails the job (``--fault-timeout``).
DEFAULT_FAULT_TIMEOUT = common.DEFAULT_FAULT_TIMEOUT

Prefix = Callable[[int], Sequence[str]]
Env = Mapping[str, str] | Callable[[int], Mapping[str, str]]


# ----------------------------------------------------------------------------- config


def parse_methods(text: str) -> tuple[str, ...]:
  """``"dense,onebit"`` -> ``("dense", "onebit")``, each one of ``train.ALL_METHODS``."""
  methods = common.parse_methods(text, train.ALL_METHODS, "--method")
  if len(set(methods)) != len(methods):
    raise ValueError(f"--method: repeated method in {text!r}")
  return methods


def _benchmark_config_names() -> list[str]:
  return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if not p.stem.startswith("_"))


def config_names() -> list[str]:
  """``--config`` names: the modules of ``benchmarks/configs`` and of
  ``examples/mnist1d/configs``."""
  return sorted(set(_benchmark_config_names()) | set(example_configs.names()))


def load_config(
  name: str,
  *,
  steps: int | None = None,
  seed: int | None = None,
  batch: int | None = None,
  checkpoint_every: int | None = None,
):
  """The config ``name``'s ``get_config()`` with the command-line overrides applied.

  ``name`` is a module of ``benchmarks/configs`` or (when not found there) of
  ``examples/mnist1d/configs``, or the path of a ``.py`` file with ``get_config()``.
  """
  if name.endswith(".py"):
    module = example_configs.load(name)
  elif name in _benchmark_config_names():
    module = importlib.import_module(f"benchmarks.configs.{name}")
  elif name in example_configs.names():
    module = example_configs.load(name)
  else:
    raise ValueError(
      f"--config: unknown {name!r}; choose from {','.join(config_names())} "
      "or give the path of a config file"
    )
  given = argparse.Namespace(steps=steps, batch=batch, seed=seed, checkpoint_every=checkpoint_every)
  overrides = common.flag_overrides(
    given,
    (
      ("steps", "num_steps", 1),
      ("batch", "per_device_batch_size", 1),
      ("seed", "seed", None),
      ("checkpoint_every", "checkpoint_every", 0),
    ),
  )
  return dataclasses.replace(module.get_config(), **overrides)


# ----------------------------------------------------------------------------- worker


# The worker side's distributed set-up, shared with the trainers (examples/common.py).
cpu_platform_selected = common.cpu_platform_selected
check_fault_timeout = common.check_fault_timeout
collective_timeout_flags = common.collective_timeout_flags
init_distributed = common.init_distributed
#: ``params_digest(params)``: sha256 over the leaves' shapes, dtypes and bytes.
params_digest = common.params_digest


def train_method(
  method: str,
  config,
  *,
  model,
  init_params,
  data,
  mesh,
  workdir: str | None = None,
  evaluate: bool = False,
  profile: int = 0,
) -> dict[str, Any]:
  """Trains ``method`` with the demo's ``train.train_method`` on a mesh spanning processes.

  Every process must call it with the same arguments (each jitted call is a collective).
  With ``config.checkpoint_every`` the run checkpoints to and resumes from
  ``workdir/checkpoints/<method>/`` (``train.train_method``).

  Returns:
    ``train.train_method``'s record (``start_step``, ``losses`` of every step,
    ``step_times_s`` of the steps run now, ``params_sha256``, ``local_copies_identical``,
    bytes, ``test_accuracy`` None unless ``evaluate``, ``phases`` with ``profile``),
    with ``method``, ``num_steps``, ``final_loss`` and ``median_step_time_s`` (the steps
    after the first; None when this run took no step, its checkpoint being the last).
  """
  record = train.train_method(
    method,
    config,
    model=model,
    init_params=init_params,
    data=data,
    mesh=mesh,
    workdir=workdir,
    evaluate=evaluate,
    profile=profile,
  )
  times = record["step_times_s"]
  return {
    "method": method,
    "num_steps": config.num_steps,
    "median_step_time_s": statistics.median(times[1:] or times) if times else None,
    "final_loss": record["losses"][-1],
    **record,
  }


def train_worker(
  config, methods: Sequence[str], workdir: str, *, evaluate: bool = False, profile: int = 0
) -> dict[str, Any]:
  """This process's part of training every method in turn; ``jax.distributed`` is up.

  Returns:
    ``{"process_id", "num_processes", "num_devices", "local_devices", "platform",
    "num_params", "global_batch", "init_params_sha256", "methods": {method: record}}``
    with :func:`train_method`'s records.
  """
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
  for method in methods:
    r = train_method(
      method,
      config,
      model=model,
      init_params=init_params,
      data=data,
      mesh=mesh,
      workdir=workdir,
      evaluate=evaluate,
      profile=profile,
    )
    result["methods"][method] = r
    median = r["median_step_time_s"]
    print(
      f"[process {pid}] {method}: {r['num_steps']} steps (from step {r['start_step']}), "
      f"final loss {r['final_loss']:.4f}, median step "
      f"{'n/a' if median is None else f'{1e3 * median:.1f} ms'}, "
      f"compile {r['compile_time_s']:.1f} s, params {r['params_sha256'][:16]}",
      flush=True,
    )
  return result


def write_result(result: dict[str, Any], workdir: str) -> str:
  """Writes ``WORKDIR/worker{i}.json``, prints the marked stdout line; returns the path."""
  path = os.path.join(workdir, f"worker{result['process_id']}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(RESULT_MARKER + json.dumps(result), flush=True)
  return path


def die_with_parent() -> None:
  """Linux: this process gets SIGKILL when its parent (the launcher) dies, even by
  SIGKILL, so no worker outlives it. Elsewhere nothing."""
  if not sys.platform.startswith("linux"):
    return
  import ctypes  # pylint: disable=import-outside-toplevel

  pr_set_pdeathsig = 1
  ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def run_worker(args: argparse.Namespace) -> None:
  """Worker mode: join the job, train, report, leave together with the others.

  On an error the worker prints it and exits at once with code 1, skipping
  ``jax.distributed``'s shutdown barrier (which would wait for a lost peer).
  """
  die_with_parent()
  with common.exit_at_once_on_error():
    config = load_config(
      args.config,
      steps=args.steps,
      seed=args.seed,
      batch=args.batch,
      checkpoint_every=args.checkpoint_every,
    )
    methods = parse_methods(args.method)
    init_distributed(
      args.coordinator,
      args.num_processes,
      args.process_id,
      devices_per_process=args.devices_per_process,
      fault_timeout=args.fault_timeout or None,
    )
    result = train_worker(config, methods, args.workdir, evaluate=args.eval, profile=args.profile)
    write_result(result, args.workdir)
  jax.distributed.shutdown()  # a barrier: no process leaves while others still run


# ----------------------------------------------------------------------------- launcher


class LaunchError(RuntimeError):
  """A worker failed, or the workers timed out; ``outputs`` holds what they printed,
  ``failed`` the worker that failed first (None on a timeout or a missing result)."""

  def __init__(
    self,
    message: str,
    outputs: Sequence[WorkerOutput] = (),
    *,
    failed: WorkerOutput | None = None,
    timed_out: bool = False,
  ):
    super().__init__(message)
    self.outputs = list(outputs)
    self.failed = failed
    self.timed_out = timed_out


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

  def tail(self, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of stderr (of stdout when stderr is empty)."""
    return "\n".join((self.stderr or self.stdout)[-lines:])


check_coordinator = common.check_coordinator


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port free now on ``host`` (on every local address if ``host`` is not local)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    try:
      s.bind((host, 0))
    except OSError:  # e.g. an address of another network namespace
      s.bind(("", 0))
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
  """The flags of the worker command line shared by all processes (for :func:`launch`).

  ``fault_timeout`` None leaves the workers' default (:data:`DEFAULT_FAULT_TIMEOUT`);
  0 gives JAX's and XLA's own timeouts.
  """
  methods = methods if isinstance(methods, str) else ",".join(methods)
  parse_methods(methods)
  if config.endswith(".py"):
    config = os.path.abspath(config)  # a path the workers find wherever they start
  # Fail here, not N times.
  load_config(config, steps=steps, seed=seed, batch=batch, checkpoint_every=checkpoint_every)
  if fault_timeout:
    check_fault_timeout(fault_timeout)
  elif fault_timeout is not None and fault_timeout != 0:
    raise ValueError(f"--fault-timeout must be >= 0, got {fault_timeout}")
  args = ["--method", methods, "--config", config]
  for flag, value in (
    ("--devices-per-process", devices_per_process),
    ("--steps", steps),
    ("--seed", seed),
    ("--batch", batch),
    ("--workdir", workdir),
    ("--checkpoint-every", checkpoint_every),
    ("--fault-timeout", fault_timeout),
  ):
    if value is not None:
      args += [flag, str(value)]
  if profile < 0:
    raise ValueError(f"--profile must be >= 0, got {profile}")
  return args + (["--eval"] if evaluate else []) + (["--profile", str(profile)] if profile else [])


def worker_command(
  args: Sequence[str],
  *,
  process_id: int,
  num_processes: int,
  coordinator: str,
  prefix: Prefix | None = None,
) -> list[str]:
  """``[*prefix(i), python, -m, benchmarks.launch, *args, --worker, ...]``."""
  command = [
    sys.executable,
    "-m",
    MODULE,
    *args,
    "--worker",
    "--process-id",
    str(process_id),
    "--num-processes",
    str(num_processes),
    "--coordinator",
    coordinator,
  ]
  return [*(prefix(process_id) if prefix is not None else ()), *command]


def worker_env(process_id: int, env: Env | None) -> dict[str, str]:
  """This environment, ``env`` (or ``env(process_id)``) on top, the repo on PYTHONPATH."""
  out = dict(os.environ)
  out.update(env(process_id) if callable(env) else (env or {}))
  path = out.get("PYTHONPATH")
  out["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
  out.setdefault("PYTHONUNBUFFERED", "1")
  return out


_ECHO_LOCK = threading.Lock()


def _read_lines(pipe, lines: list[str], echo, label: str) -> None:
  """Reader thread: appends each line of ``pipe`` to ``lines``, echoing it if asked."""
  for line in pipe:
    line = line.rstrip("\n")
    lines.append(line)
    if echo is not None and not line.startswith(RESULT_MARKER):
      with _ECHO_LOCK:  # whole lines: the threads of stdout and stderr share a terminal
        echo.write(f"{label} {line}\n")
        echo.flush()
  pipe.close()


def _kill(procs: Sequence[subprocess.Popen], grace: float = 2.0) -> None:
  """SIGTERM, then SIGKILL after ``grace`` seconds, to each still-running worker's group.

  (Once in ``jax.distributed``, a worker's preemption notifier catches SIGTERM: only
  the SIGKILL stops it. The SIGTERM is for prefixes that relay it, like sudo.)
  """
  for sig in (signal.SIGTERM, signal.SIGKILL):
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
      try:
        os.killpg(p.pid, sig)  # the worker's own session: it and its children only
      except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + grace
    for p in alive:
      try:
        p.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
    if all(p.poll() is not None for p in procs):
      return


def run_processes(
  commands: Sequence[Sequence[str]],
  *,
  env: Env | None = None,
  timeout: float | None = None,
  stream: bool = False,
  poll_interval: float = 0.05,
  pass_fds: Sequence[int] = (),
) -> list[WorkerOutput]:
  """Runs ``commands[i]`` as worker ``i``; all succeed, or all are killed.

  Each worker runs in its own session (Ctrl-C reaches only this process, which then
  kills them). With ``stream``, lines are echoed as they come, prefixed ``[wI]``, and
  the workers' pids are printed as they start. ``pass_fds`` stay open in the workers
  (e.g. the workdir lock's, so that it is held while any worker lives).

  Raises:
    LaunchError: a worker exited non-zero (the others are killed at once), or
      ``timeout`` seconds passed (all are killed).
    KeyboardInterrupt: after killing the workers.
  """
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
        with _ECHO_LOCK:
          print(f"[launch] worker {out.process_id}: pid {p.pid}", file=sys.stderr, flush=True)
      for pipe, lines, echo in (
        (p.stdout, out.stdout, sys.stdout),
        (p.stderr, out.stderr, sys.stderr),
      ):
        t = threading.Thread(
          target=_read_lines,
          daemon=True,
          args=(pipe, lines, echo if stream else None, f"[w{out.process_id}]"),
        )
        t.start()
        readers.append(t)
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    failed = None
    while failed is None and any(p.poll() is None for p in procs):
      failed = _root_failure(outputs, procs)
      if failed is None and deadline is not None and time.monotonic() > deadline:
        _finish(procs, readers, outputs)
        raise LaunchError(
          f"workers timed out after {timeout:g} s; last output:\n" + _tails(outputs),
          outputs,
          timed_out=True,
        )
      time.sleep(poll_interval)
    failed = failed or _root_failure(outputs, procs)
    if failed is not None:
      failed.failed_after_s = time.monotonic() - start
    _finish(procs, readers, outputs)
    if failed is not None:
      raise LaunchError(
        f"worker {failed.process_id} exited with code "
        f"{failed.returncode}; its output ends with:\n{failed.tail()}",
        outputs,
        failed=failed,
      )
    return outputs
  finally:
    _kill(procs)  # on any exception (Ctrl-C included) no worker outlives the launcher


def _root_failure(outputs, procs) -> WorkerOutput | None:
  """The worker whose failure is the cause, of those that exited non-zero so far.

  A worker killed by a signal comes first: when one dies, its peers see the closed
  connection and exit with an error of their own, often within the same poll
  interval, and naming a peer's "lost peer" exit would hide the death that caused it.
  """
  failed = [(p.returncode, o) for o, p in zip(outputs, procs) if p.poll()]
  signalled = [o for rc, o in failed if rc < 0]
  return (signalled or [o for _, o in failed] or [None])[0]


def _finish(procs, readers, outputs) -> None:
  """Kills the workers still running, drains their pipes, records exit codes."""
  _kill(procs)
  for t in readers:
    t.join(timeout=5.0)
  for out, p in zip(outputs, procs):
    out.returncode = p.returncode


def _tails(outputs: Sequence[WorkerOutput]) -> str:
  return "\n".join(
    f"--- worker {o.process_id} (exit {o.returncode}) ---\n{o.tail(10)}" for o in outputs
  )


def worker_results(
  commands: Sequence[Sequence[str]],
  marker: str,
  *,
  timeout: float,
  stream: bool = False,
  every: bool = False,
) -> Any:
  """Runs ``commands`` (:func:`run_processes`) and returns the JSON that process 0 (or,
  with ``every``, each process, in a list) printed on one stdout line after ``marker``."""
  outputs = run_processes(commands, timeout=timeout, stream=stream)
  results = []
  for out in outputs if every else outputs[:1]:
    line = next((x for x in out.stdout if x.startswith(marker)), None)
    if line is None:
      raise RuntimeError(f"worker {out.process_id} gave no result:\n" + out.tail())
    results.append(json.loads(line[len(marker) :]))
  return results if every else results[0]


def parse_result(output: WorkerOutput) -> dict[str, Any]:
  """The JSON of the worker's last :data:`RESULT_MARKER` line."""
  for line in reversed(output.stdout):
    if line.startswith(RESULT_MARKER):
      return json.loads(line[len(RESULT_MARKER) :])
  raise LaunchError(
    f"worker {output.process_id} exited without a result line; its "
    f"output ends with:\n{output.tail()}",
    [output],
  )


def launch(
  args: Sequence[str],
  *,
  processes: int,
  prefix: Prefix | None = None,
  env: Env | None = None,
  coordinator: str | None = None,
  coordinator_host: str = "127.0.0.1",
  timeout: float | None = 600.0,
  stream: bool = False,
  pass_fds: Sequence[int] = (),
) -> list[dict[str, Any]]:
  """Runs ``processes`` workers of this module and returns their results.

  Args:
    args: worker flags shared by all processes (see :func:`worker_args`); the launcher
      appends ``--worker --process-id i --num-processes N --coordinator ADDRESS``.
    processes: N, the number of worker processes.
    prefix: ``process_id -> argv`` put before worker ``i``'s command, e.g.
      ``lambda i: ["ip", "netns", "exec", f"ns{i}"]``.
    env: variables set on top of this environment, for all workers or per worker
      (``process_id -> mapping``). The repository goes on ``PYTHONPATH``.
    coordinator: ``HOST:PORT`` of process 0's coordination service; by default
      ``coordinator_host`` with a port free here.
    coordinator_host: host of the default coordinator address.
    timeout: seconds before every worker is killed (None: no limit).
    stream: echo the workers' output as it comes, prefixed ``[wI]``.
    pass_fds: file descriptors left open in the workers (:func:`run_processes`).

  Returns:
    The workers' results (see :func:`train_worker`), ordered by process id.

  Raises:
    LaunchError: a worker failed, gave no result, or the timeout passed; every worker
      has been killed, and the message quotes the failing worker's output.
  """
  if processes < 1:
    raise ValueError(f"processes must be positive, got {processes}")
  if timeout is not None and timeout <= 0:
    raise ValueError(f"timeout must be positive, got {timeout}")
  if coordinator is None:
    coordinator = f"{coordinator_host}:{free_port(coordinator_host)}"
  check_coordinator(coordinator)
  commands = [
    worker_command(
      args, process_id=i, num_processes=processes, coordinator=coordinator, prefix=prefix
    )
    for i in range(processes)
  ]
  outputs = run_processes(commands, env=env, timeout=timeout, stream=stream, pass_fds=pass_fds)
  return [parse_result(o) for o in outputs]


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
  lines = [
    f"{len(results)} processes x {r0['local_devices']} {r0['platform']} devices, "
    f"{r0['num_params']:,} parameters, global batch {r0['global_batch']}. Median step:"
    " wall time of the steps after the first, in process order.",
    "",
    "| method | final loss | test acc (%) | median step (ms) | bytes recv/device/step |"
    " ratio vs dense | params sha256 | identical |",
    "|---|---:|---:|---:|---:|---:|---|---|",
  ]
  for method, m in r0["methods"].items():
    runs = [r["methods"][method] for r in results]
    loss = f"{m['final_loss']:.4f}"
    if m.get("diverged"):  # the same in every process: global losses and parameters
      loss = common.diverged_note(m["nonfinite_step"])
    times = " / ".join(
      "n/a" if run["median_step_time_s"] is None else f"{1e3 * run['median_step_time_s']:.1f}"
      for run in runs
    )
    same = len({run["params_sha256"] for run in runs}) == 1 and all(
      run["local_copies_identical"] for run in runs
    )
    acc = "n/a" if m["test_accuracy"] is None else f"{100 * m['test_accuracy']:.1f}"
    recv, ratio = common.bytes_cells(m)
    lines.append(
      f"| {method} | {loss} | {acc} | {times} | {recv} | {ratio} |"
      f" {m['params_sha256'][:16]} | {'yes' if same else 'NO'} |"
    )
  return "\n".join(lines) + phase_table(results)


PHASE_COLUMNS = (*jc.PhaseProfile.PHASES, "idle")  # the columns of a phase table


def phase_row(label: str, phases: dict[str, Any]) -> str:
  """One row of a phase table: ``label``'s cells, the step, then each phase (ms)."""
  return (
    f"| {label} | {phases['step_ms']:.1f} | "
    + " | ".join(f"{phases[c]:.1f}" for c in PHASE_COLUMNS)
    + " |"
  )


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
  return "\n".join(
    [
      "",
      "",
      "Where a step's time goes (ms per step, jc.profile_phases over the profiled "
      "steps; exchange includes waiting for the other processes):",
      "",
      "| method | process | step | " + " | ".join(PHASE_COLUMNS) + " |",
      "|---|---:|---:|" + "---:|" * len(PHASE_COLUMNS),
      *rows,
    ]
  )


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
  """Command-line flags of both modes."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=2, help="N worker processes")
  parser.add_argument(
    "--devices-per-process", type=int, default=1, help="CPU devices per process (not used on GPU)"
  )
  parser.add_argument(
    "--method",
    default="dense",
    help=f"comma-separated methods of {','.join(train.ALL_METHODS)}, trained in turn",
  )
  parser.add_argument(
    "--config",
    default="default",
    help=f"one of {','.join(config_names())} (benchmarks/configs, "
    "examples/mnist1d/configs), or the path of a .py file providing "
    "get_config()",
  )
  parser.add_argument("--steps", type=int, default=None, help="override num_steps")
  parser.add_argument("--batch", type=int, default=None, help="override per_device_batch_size")
  parser.add_argument(
    "--seed",
    type=int,
    default=None,
    help="override the init/shuffling seed (the data set stays fixed)",
  )
  parser.add_argument(
    "--workdir", default="runs/mnist1d_launch", help="output directory (worker{i}.json, data cache)"
  )
  parser.add_argument(
    "--eval", action="store_true", help="evaluate test accuracy after each method"
  )
  parser.add_argument(
    "--timeout", type=float, default=600.0, help="seconds before all workers are killed"
  )
  parser.add_argument(
    "--profile",
    type=int,
    default=0,
    metavar="STEPS",
    help="after training, profile STEPS more steps and split their "
    "time into gradient/encode/exchange/decode/update",
  )
  parser.add_argument(
    "--coordinator",
    default=None,
    help="HOST:PORT of the coordinator (default: 127.0.0.1, free port)",
  )
  parser.add_argument(
    "--checkpoint-every",
    type=int,
    default=None,
    metavar="N",
    help="checkpoint every N steps (and at the last) in WORKDIR/checkpoints/METHOD with"
    " Orbax; re-running the same command resumes from the latest complete checkpoint"
    " (0: off, the default)",
  )
  common.add_fault_timeout_flag(parser, "worker")
  parser.add_argument(
    common.ALLOW_DIVERGED_FLAG,
    action="store_true",
    help="exit 0 even when a method diverged (went non-finite; exit code 1 otherwise)",
  )
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--num-processes", type=int, default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker and (
    args.process_id is None or args.num_processes is None or args.coordinator is None
  ):
    parser.error("--worker needs --process-id, --num-processes and --coordinator")
  return args


LOCK_NAME = "launch.lock"


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


@contextlib.contextmanager
def workdir_lock(workdir: str):
  """Holds ``WORKDIR/launch.lock`` for one launch at a time; yields its descriptor.

  The lock is an exclusive ``flock`` on the file, which records the owner's pid and
  host. The kernel drops it when the last process holding the descriptor ends (pass it
  to the workers: the lock then lasts while any of them lives), so a lock left by a
  killed launch is stale by construction: it is taken over, with a note naming the
  previous owner.

  Raises:
    WorkdirLockedError: another live launch holds it (the message names its pid).
  """
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
    if owner:  # the previous owner ended without releasing it: killed
      pid = owner.split()[1] if owner.startswith("pid ") else "?"
      state = "not running" if pid.isdigit() and not _pid_alive(int(pid)) else "lock released"
      print(f"[launch] taking over the stale lock of {owner} ({state}): {path}", file=sys.stderr)
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


# What a failed worker's stderr says, most specific first: (pattern, cause); ``{0}`` is
# the pattern's group. The coordination service names a process that stopped sending
# heartbeats (dead, or cut off); gloo names a collective that waited too long.
FAILURE_CAUSES = (
  (
    re.compile(r"Task (\d+) heartbeat timeout"),
    "lost peer: process {0} sent no heartbeat within the heartbeat timeout (dead or cut off)",
  ),
  (
    re.compile(r"(stopped sending heartbeats)"),
    "lost peer: a process sent no heartbeat within the heartbeat timeout (dead or cut off)",
  ),
  (
    re.compile(r"Timed out waiting (\d+)ms for \w+ operation"),
    "timeout: a collective waited {0} ms for its peers",
  ),
  (re.compile(r"(heartbeat)", re.I), "lost peer: heartbeats to the coordinator failed"),
  (
    re.compile(r"(connection (closed|reset|refused)|broken pipe|socket closed)", re.I),
    "lost peer: a connection to it was closed",
  ),
  (
    re.compile(r"(distributed service detected fatal errors)"),
    "the coordination service reported a failed process",
  ),
)


def failure_cause(*stderrs: Sequence[str]) -> str | None:
  """The most specific of :data:`FAILURE_CAUSES` found in the stderr lines, searched
  in the order given (the failed worker's first), or None."""
  for pattern, cause in FAILURE_CAUSES:
    for lines in stderrs:
      for line in reversed(lines):
        found = pattern.search(line)
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
  if not checkpoint_every:
    where = "no checkpoints kept (--checkpoint-every N keeps them)"
    resume = f"rerun from step 0: {command}"
  elif all(step is None for step in latest.values()):
    where = f"no complete checkpoint in {os.path.join(workdir, 'checkpoints')}"
    resume = f"rerun (starts at step 0): {command}"
  else:
    where = "last complete checkpoint: " + ", ".join(
      f"{m} step {'none' if step is None else step}" for m, step in latest.items()
    )
    where += f" ({os.path.join(workdir, 'checkpoints')})"
    resume = f"resume with the same command: {command}"
  return f"{describe_failure(error)}; {where}; {resume}"


def run_launcher(args: argparse.Namespace, command: str = "") -> list[dict[str, Any]]:
  """Launcher mode: lock the workdir, start the workers, check their parameters, print
  a summary. ``command`` (the command line that resumes) goes into a failure's line."""
  workdir = os.path.abspath(args.workdir)
  forwarded = worker_args(
    args.method,
    config=args.config,
    devices_per_process=args.devices_per_process,
    steps=args.steps,
    seed=args.seed,
    batch=args.batch,
    workdir=workdir,
    evaluate=args.eval,
    profile=args.profile,
    checkpoint_every=args.checkpoint_every,
    fault_timeout=args.fault_timeout,
  )
  start = time.perf_counter()
  with workdir_lock(workdir) as lock:
    try:
      results = launch(
        forwarded,
        processes=args.processes,
        coordinator=args.coordinator,
        timeout=args.timeout,
        stream=True,
        pass_fds=(lock,),
      )
    except LaunchError as e:
      line = failure_line(
        e,
        workdir=workdir,
        methods=parse_methods(args.method),
        checkpoint_every=args.checkpoint_every,
        command=command or f"python -m {MODULE} ...",
      )
      raise LaunchError(line, e.outputs, failed=e.failed, timed_out=e.timed_out) from e
  print(summary(results))
  print(
    f"wall time {time.perf_counter() - start:.1f} s; results in "
    f"{os.path.join(workdir, 'worker*.json')}"
  )
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
