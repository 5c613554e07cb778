r"""How long the multi-process launcher takes to notice a lost worker, and what it says.

Each fault hits a 2-process run once its first checkpoint is complete: ``kill`` (``kill
-9`` of a :mod:`benchmarks.launch` worker), ``partition`` (the veth between two namespaces
set down; root), ``lm_kill`` and ``lm_kill0`` (``kill -9`` of process 1 or 0 of
``examples.lm.main``, no launcher). Results: docs/benchmarks.md, "Detecting a lost worker".

  python -m benchmarks.fault                        # kill, and partition if root
  sudo python -m benchmarks.fault --faults partition --fault-timeouts 10,30
  python -m benchmarks.fault --faults lm_kill,lm_kill0 --fault-timeouts 10,30
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from concurrent import futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks import launch
from benchmarks import lm_network
from benchmarks import network
from benchmarks._timing import ints
from benchmarks._timing import md_head
from benchmarks._timing import md_row

#: The partition test's own namespaces, veths and addresses (not the network benchmark's).
NAMESPACES = ("jcfault0", "jcfault1")
VETHS = ("jcfveth0", "jcfveth1")
ADDRESSES = ("10.231.78.1", "10.231.78.2")

STEPS = 100_000  # more than run before the fault: the run is cut, never finishes
CHECKPOINT_EVERY = 20
LM_STEPS = 2_000  # the transformer's run (a tc-free schedule: it is cut long before)


def launch_args(
  workdir: str, fault_timeout: int, *, steps: int = STEPS, checkpoint_every: int = CHECKPOINT_EVERY
) -> list[str]:
  """The flags of the faulted run (``python -m benchmarks.launch`` takes them too)."""
  run = dict(config="quick", devices_per_process=1, workdir=workdir, fault_timeout=fault_timeout)
  return launch.worker_args("dgc", steps=steps, checkpoint_every=checkpoint_every, **run)


def launch_command(workdir: str, fault_timeout: int, **kwargs) -> list[str]:
  """The launcher's command line of the faulted run."""
  args = launch_args(workdir, fault_timeout, **kwargs)
  return [sys.executable, "-m", launch.MODULE, "--processes", "2", *args]


def _start(command: list[str], **kwargs) -> subprocess.Popen:
  """Starts ``command`` on CPU from the repository root, in a session of its own."""
  env = launch.worker_env(0, {"JAX_PLATFORMS": "cpu"})
  return subprocess.Popen(command, env=env, cwd=launch.REPO_ROOT, start_new_session=True, **kwargs)


def _cut(procs, fault: Callable[[], None], wait, workdir: str, method: str, timeout: float):
  """Calls ``fault`` once ``method`` has a complete checkpoint (polled every 0.1 s; a
  TimeoutError after ``timeout``); returns the seconds that ``wait(timeout)`` took.
  Whatever of ``procs`` (ours) is still running is then killed."""
  try:
    deadline = time.monotonic() + timeout
    while launch.complete_checkpoints(workdir, [method])[method] is None:
      if time.monotonic() > deadline:
        raise TimeoutError(f"no checkpoint after {timeout:g} s")
      time.sleep(0.1)
    fault()
    start = time.monotonic()
    wait(timeout)
    return time.monotonic() - start
  finally:
    launch.kill_groups(procs)


def _result(fault, fault_timeout, detected, returncode, line, pids, **extra) -> dict[str, Any]:
  """A table row: ``pids`` the run's processes, ``survivors`` those still alive."""
  return {
    "fault": fault,
    "fault_timeout": fault_timeout,
    "detected_s": detected,
    "returncode": returncode,
    "line": line,
    **extra,
    "survivors": [p for p in pids if p and alive(p)],
    "pids": pids,
  }


def measure_kill(
  workdir: str, fault_timeout: int, *, timeout: float = 300, **kwargs
) -> dict[str, Any]:
  """Runs the launcher's command line, kills worker 1 with SIGKILL after the first
  checkpoint; returns the seconds to the launcher's exit, its exit code, its last
  stderr line (and all of them), its workers' pids and those that outlived it.
  ``kwargs`` go to :func:`launch_args`."""
  command = launch_command(workdir, fault_timeout, **kwargs)
  proc = _start(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
  reader.start()
  pids: list[int] = []

  def kill():
    pids.extend(worker_pids(lines))
    os.kill(pids[1], signal.SIGKILL)

  detected = _cut([proc], kill, proc.wait, workdir, "dgc", timeout)
  reader.join(5)
  line = lines[-1].rstrip("\n") if lines else ""
  return _result("kill", fault_timeout, detected, proc.returncode, line, pids, stderr=lines)


def lm_commands(
  workdir: str,
  fault_timeout: int,
  *,
  config: str = "tiny",
  steps: int = LM_STEPS,
  checkpoint_every: int = CHECKPOINT_EVERY,
) -> list[list[str]]:
  """The 2 processes' command lines of the transformer trainer (``examples.lm.main``) with
  1-bit SGD, as a user runs them: the same flags in each, a coordinator on a free local port."""
  flags = ["--config", config, "--methods", "onebit", "--steps", str(steps)]
  flags += ["--eval-every", str(steps), "--checkpoint-every", str(checkpoint_every)]
  flags += ["--fault-timeout", str(fault_timeout), "--workdir", workdir]
  return lm_network.worker_commands(flags, coordinator=f"127.0.0.1:{launch.free_port()}")


def measure_lm_kill(
  workdir: str, fault_timeout: int, *, timeout: float = 300, victim: int = 1, **kwargs
) -> dict[str, Any]:
  """Starts the 2 LM processes (:func:`lm_commands`; logs ``WORKDIR/process{i}.log``),
  SIGKILLs process ``victim`` after the first checkpoint and times the other's exit: no
  launcher, the survivor notices alone (``victim=0`` takes the coordinator down too).
  Returns the seconds to the survivor's exit, its exit code, one line (its exit and the
  cause its output names), the commands (rerun them to resume) and the survivors. A
  RuntimeError if a process ended before the kill (the run was too short), TimeoutExpired
  if the survivor outlived the kill by ``timeout`` (a hang)."""
  os.makedirs(workdir, exist_ok=True)
  commands = lm_commands(workdir, fault_timeout, **kwargs)
  logs = [os.path.join(workdir, f"process{i}.log") for i in range(2)]
  procs = []
  for command, log in zip(commands, logs):
    with open(log, "w") as f:
      procs.append(_start(command, stdout=f, stderr=subprocess.STDOUT))

  def kill():
    if any(p.poll() is not None for p in procs):
      raise RuntimeError(f"a process ended before the kill: {[p.poll() for p in procs]}")
    os.kill(procs[victim].pid, signal.SIGKILL)

  survivor = procs[1 - victim]
  detected = _cut(procs, kill, survivor.wait, workdir, "onebit", timeout)
  with open(logs[1 - victim], errors="replace") as f:
    cause = launch.failure_cause(f.read().splitlines())
  rc = survivor.returncode
  how = f"exited with code {rc}" if rc >= 0 else f"was ended by {signal.Signals(-rc).name}"
  line = f"process {1 - victim} {how}" + (f": {cause}" if cause else "")
  fault = "lm_kill" if victim == 1 else f"lm_kill{victim}"
  pids = [p.pid for p in procs]
  killed_rc = procs[victim].returncode
  return _result(
    fault, fault_timeout, detected, rc, line, pids, killed_returncode=killed_rc, commands=commands
  )


def worker_pids(lines: list[str]) -> list[int]:
  """The pids of the ``[launch] worker I: pid P`` lines, by worker."""
  found = {}
  for line in lines:
    if line.startswith("[launch] worker ") and ": pid " in line:
      head, pid = line.rsplit(": pid ", 1)
      found[int(head.split()[-1])] = int(pid)
  return [found[i] for i in sorted(found)]


def alive(pid: int) -> bool:
  """Whether ``pid`` is a live process (a zombie counts as gone)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (FileNotFoundError, ProcessLookupError):
    return False


def measure_partition(workdir: str, fault_timeout: int, timeout: float = 300) -> dict[str, Any]:
  """Runs 2 workers in two namespaces, sets their veth down after the first checkpoint;
  returns the seconds to the launcher's error and its one-line diagnosis."""
  link = network.open_link(NAMESPACES, VETHS, ADDRESSES)
  with link, futures.ThreadPoolExecutor(1) as pool:
    run = pool.submit(
      launch.launch,
      launch_args(workdir, fault_timeout),
      processes=2,
      prefix=link.worker_prefix,
      coordinator=f"{ADDRESSES[0]}:{launch.free_port()}",
      env={"JAX_PLATFORMS": "cpu"},
      timeout=timeout,
    )
    detected = _cut([], lambda: link.set_up(False), run.exception, workdir, "dgc", timeout)
  error = run.exception()
  if not isinstance(error, launch.LaunchError):
    raise error or RuntimeError("the partitioned run did not fail")
  where = dict(workdir=workdir, methods=["dgc"], checkpoint_every=CHECKPOINT_EVERY)
  line = launch.failure_line(error, **where, command="(the same command)")
  rc = error.failed.returncode if error.failed else None
  return _result("partition", fault_timeout, detected, rc, line, [o.pid for o in error.outputs])


def table(rows: list[dict[str, Any]]) -> str:
  """Markdown: fault, --fault-timeout, seconds to the error, the diagnosis."""
  head = "fault | --fault-timeout (s) | detected after (s) | workers left | launcher's line"
  lines = [md_head(head, "lrrrl")]
  for r in rows:
    cells = r["fault"], r["fault_timeout"], f"{r['detected_s']:.1f}", len(r["survivors"])
    lines.append(md_row(*cells, r["line"].split("; ")[0]))
  return "\n".join(lines)


MEASURES = {
  "kill": measure_kill,
  "partition": measure_partition,
  "lm_kill": measure_lm_kill,  # process 1
  "lm_kill0": lambda workdir, seconds: measure_lm_kill(workdir, seconds, victim=0),
}


def main(argv=None) -> int:
  """Measures each fault at each timeout; prints the table. Exit 2 if a fault cannot run."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--faults", default="kill,partition", help=",".join(MEASURES))
  parser.add_argument(
    "--fault-timeouts", type=ints, default=str(launch.DEFAULT_FAULT_TIMEOUT), help="seconds"
  )
  args = parser.parse_args(argv)
  faults = [f for f in args.faults.split(",") if f]
  unknown = set(faults) - set(MEASURES)
  if unknown:
    parser.error(f"unknown faults {sorted(unknown)}")
  if "partition" in faults and network.cannot_run("partition"):
    faults.remove("partition")
    if not faults:
      return 2
  rows = []
  for fault in faults:
    for seconds in args.fault_timeouts:
      workdir = tempfile.mkdtemp(prefix=f"jaxcomp_fault_{fault}_")
      try:
        rows.append(MEASURES[fault](workdir, seconds))
        print(f"{fault}, --fault-timeout {seconds}: {rows[-1]['line']}", flush=True)
      finally:
        shutil.rmtree(workdir, ignore_errors=True)
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
