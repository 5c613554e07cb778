r"""How long the multi-process launcher takes to notice a lost worker, and what it says.

Two faults, each injected into a 2-process run of ``benchmarks.launch`` (MNIST-1D
``quick`` config, one CPU device per process, checkpoints on) once its first
checkpoint is complete:

- ``kill``: ``kill -9`` of worker 1. The launcher is its parent: it sees the exit.
- ``partition``: the veth between two network namespaces (one worker in each) is set
  down. Both workers stay alive; only ``jax.distributed``'s heartbeats and the
  collective timeout (``--fault-timeout``) can tell. Needs root and ``ip``.

It prints a Markdown table: per fault and ``--fault-timeout``, the seconds from the
fault to the launcher's error, and the launcher's one-line diagnosis.

  python -m benchmarks.fault                        # kill, and partition if root
  sudo python -m benchmarks.fault --faults partition --fault-timeouts 10,30
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
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
from benchmarks import network

#: The partition test's own namespaces, veths and addresses (not the network benchmark's).
NAMESPACES = ("jcfault0", "jcfault1")
VETHS = ("jcfveth0", "jcfveth1")
ADDRESSES = ("10.231.78.1", "10.231.78.2")

STEPS = 100_000  # more than run before the fault: the run is cut, never finishes
CHECKPOINT_EVERY = 20


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
  """Polls ``predicate`` every 0.1 s; raises TimeoutError naming ``what`` after ``timeout``."""
  deadline = time.monotonic() + timeout
  while not predicate():
    if time.monotonic() > deadline:
      raise TimeoutError(f"no {what} after {timeout:g} s")
    time.sleep(0.1)


def first_checkpoint(workdir: str, method: str) -> Callable[[], bool]:
  """Whether ``method`` has a complete checkpoint in ``workdir`` (a predicate)."""
  return lambda: launch.complete_checkpoints(workdir, [method])[method] is not None


def launch_args(
  workdir: str,
  fault_timeout: int,
  *,
  steps: int = STEPS,
  checkpoint_every: int = CHECKPOINT_EVERY,
  method: str = "dgc",
) -> list[str]:
  """The flags of the faulted run (``python -m benchmarks.launch`` takes them too)."""
  return launch.worker_args(
    method,
    config="quick",
    devices_per_process=1,
    steps=steps,
    workdir=workdir,
    checkpoint_every=checkpoint_every,
    fault_timeout=fault_timeout,
  )


def launch_command(workdir: str, fault_timeout: int, **kwargs) -> list[str]:
  """The launcher's command line of the faulted run."""
  return [
    sys.executable,
    "-m",
    launch.MODULE,
    "--processes",
    "2",
    *launch_args(workdir, fault_timeout, **kwargs),
  ]


def measure_kill(
  workdir: str, fault_timeout: int, *, timeout: float = 300, **kwargs
) -> dict[str, Any]:
  """Runs the launcher's command line, kills worker 1 with SIGKILL after the first
  checkpoint; returns the seconds to the launcher's exit, its exit code, its last
  stderr line (and all of them), its workers' pids and those that outlived it.
  ``kwargs`` go to :func:`launch_args`."""
  command = launch_command(workdir, fault_timeout, **kwargs)
  proc = subprocess.Popen(
    command,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    cwd=launch.REPO_ROOT,
    start_new_session=True,
  )
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
  reader.start()
  try:
    wait_for(first_checkpoint(workdir, "dgc"), timeout, "checkpoint")
    pids = worker_pids(lines)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    proc.wait(timeout)
    detected = time.monotonic() - start
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  reader.join(5)
  return {
    "fault": "kill",
    "fault_timeout": fault_timeout,
    "detected_s": detected,
    "returncode": proc.returncode,
    "line": lines[-1].rstrip("\n") if lines else "",
    "stderr": lines,
    "survivors": [p for p in pids if alive(p)],
    "pids": pids,
  }


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
  failure: list[BaseException] = []
  with network.Link(NAMESPACES, VETHS, ADDRESSES) as link:

    def run():
      try:
        launch.launch(
          launch_args(workdir, fault_timeout),
          processes=2,
          prefix=link.worker_prefix,
          coordinator=f"{ADDRESSES[0]}:{network.free_port()}",
          env={"JAX_PLATFORMS": "cpu"},
          timeout=timeout,
        )
      except BaseException as e:  # pylint: disable=broad-exception-caught
        failure.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(first_checkpoint(workdir, "dgc"), timeout, "checkpoint")
    link.set_up(False)
    start = time.monotonic()
    thread.join(timeout)
    detected = time.monotonic() - start
  if not failure:
    raise RuntimeError("the partitioned run did not fail")
  error = failure[0]
  if not isinstance(error, launch.LaunchError):
    raise error
  line = launch.failure_line(
    error,
    workdir=workdir,
    methods=["dgc"],
    checkpoint_every=CHECKPOINT_EVERY,
    command="(the same command)",
  )
  return {
    "fault": "partition",
    "fault_timeout": fault_timeout,
    "detected_s": detected,
    "returncode": error.failed.returncode if error.failed else None,
    "line": line,
    "survivors": [o.pid for o in error.outputs if o.pid and alive(o.pid)],
    "pids": [o.pid for o in error.outputs],
  }


def table(rows: list[dict[str, Any]]) -> str:
  """Markdown: fault, --fault-timeout, seconds to the error, the diagnosis."""
  lines = [
    "| fault | --fault-timeout (s) | detected after (s) | workers left | launcher's line |",
    "|---|---:|---:|---:|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['fault']} | {r['fault_timeout']} | {r['detected_s']:.1f} | "
      f"{len(r['survivors'])} | {r['line'].split('; ')[0]} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  """Measures each fault at each timeout; prints the table. Exit 2 if a fault cannot run."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--faults", default="kill,partition", help="comma-separated: kill,partition")
  parser.add_argument(
    "--fault-timeouts",
    default=str(launch.DEFAULT_FAULT_TIMEOUT),
    help="comma-separated --fault-timeout values (s)",
  )
  args = parser.parse_args(argv)
  faults = [f for f in args.faults.split(",") if f]
  unknown = set(faults) - {"kill", "partition"}
  if unknown:
    parser.error(f"unknown faults {sorted(unknown)}")
  timeouts = [int(t) for t in args.fault_timeouts.split(",") if t]
  missing = network.missing_requirements()
  if "partition" in faults and missing:
    print(f"partition: cannot run ({'; '.join(missing)})", file=sys.stderr)
    faults.remove("partition")
    if not faults:
      return 2
  rows = []
  for fault in faults:
    for seconds in timeouts:
      workdir = tempfile.mkdtemp(prefix=f"jaxcomp_fault_{fault}_")
      try:
        measure = measure_kill if fault == "kill" else measure_partition
        rows.append(measure(workdir, seconds))
        print(f"{fault}, --fault-timeout {seconds}: {rows[-1]['line']}", flush=True)
      finally:
        shutil.rmtree(workdir, ignore_errors=True)
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
