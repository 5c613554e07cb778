"""Faults in multi-process training (benchmarks/launch.py): detection, diagnosis, resume.

The multi-process runs are fresh processes under timeouts (a hang fails the test): the
launcher's command line, as a user runs it, or ``launch.launch`` for workers in network
namespaces. The diagnosis is read from stderr lines that jax.distributed and gloo print.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("mnist1d")
pytest.importorskip("orbax.checkpoint")

from benchmarks import fault  # noqa: E402
from benchmarks import launch  # noqa: E402
from examples.mnist1d import train  # noqa: E402
from examples.mnist1d.configs import quick  # noqa: E402

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _run_launcher(command, timeout=400) -> subprocess.CompletedProcess:
  return subprocess.run(
    command, capture_output=True, text=True, env=ENV, cwd=launch.REPO_ROOT, timeout=timeout
  )


def _params_sha256(workdir) -> set[str]:
  return {
    json.loads((pathlib.Path(workdir) / f"worker{i}.json").read_text())["methods"]["dgc"][
      "params_sha256"
    ]
    for i in range(2)
  }


@pytest.mark.slow
@pytest.mark.once
def test_killed_worker_then_same_command_resumes_bit_identical(tmp_path):
  # DGC's state has per-device residuals and typed keys; 200 steps with a checkpoint
  # every 10 cannot end in the moment between the first checkpoint and the kill.
  steps, every = 200, 10
  whole = _run_launcher(fault.launch_command(str(tmp_path / "whole"), 30, steps=steps))
  assert whole.returncode == 0, whole.stderr[-3000:]
  (expected,) = _params_sha256(tmp_path / "whole")

  workdir = str(tmp_path / "cut")
  killed = fault.measure_kill(workdir, 30, steps=steps, checkpoint_every=every)
  assert killed["returncode"] == 1
  line = killed["line"]
  assert line.startswith(f"error: worker 1 (pid {killed['pids'][1]}) was killed by SIGKILL"), line
  assert "last complete checkpoint: dgc step " in line and "resume with the same command" in line
  assert killed["detected_s"] < 10  # the launcher is the parent: it sees the exit
  assert killed["survivors"] == []  # the other worker was killed, by pid
  resume = line.split("resume with the same command: ")[1]
  checkpoint = int(line.split("dgc step ")[1].split()[0])
  assert 0 < checkpoint < steps and checkpoint % every == 0

  command = fault.launch_command(workdir, 30, steps=steps, checkpoint_every=every)
  assert resume.split()[3:] == command[3:]  # the line names the command that was run
  resumed = _run_launcher(command)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert _params_sha256(workdir) == {expected}
  record = json.loads((pathlib.Path(workdir) / "worker0.json").read_text())["methods"]["dgc"]
  assert record["start_step"] >= checkpoint  # resumed, not restarted
  assert (
    len(record["losses"]) == steps and len(record["step_times_s"]) == steps - record["start_step"]
  )


def _partition_unavailable() -> str | None:
  if os.geteuid() != 0:
    return "needs root (ip netns, ip link)"
  for tool in ("ip", "tc", "taskset"):
    if subprocess.run(["which", tool], capture_output=True).returncode:
      return f"needs the {tool!r} command"
  probe = subprocess.run(["ip", "netns", "add", "jcfaultprobe"], capture_output=True, text=True)
  if probe.returncode:
    return f"cannot create a network namespace: {probe.stderr.strip()}"
  subprocess.run(["ip", "netns", "del", "jcfaultprobe"], capture_output=True)
  return None


@pytest.mark.slow
@pytest.mark.once
def test_partitioned_link_is_detected_within_the_fault_timeout(tmp_path):
  reason = _partition_unavailable()
  if reason:
    pytest.skip(reason)
  seconds = 10
  result = fault.measure_partition(str(tmp_path), seconds, timeout=300)
  # Both workers are alive and cut off: only the heartbeats (and the collective
  # timeout) tell. Detection takes at most the timeout plus a heartbeat period.
  assert result["detected_s"] < 2 * seconds, result
  assert "lost peer" in result["line"] or "timeout" in result["line"], result["line"]
  assert "last complete checkpoint: dgc step " in result["line"]
  assert result["survivors"] == []
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  assert not set(fault.NAMESPACES) & set(out.split())  # the link is torn down


def test_second_launch_on_a_busy_workdir_refuses(tmp_path):
  workdir = str(tmp_path)
  # A live owner: another process holds the lock (a launch and its workers would).
  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import sys, time\n"
      "from benchmarks import launch\n"
      "with launch.workdir_lock(sys.argv[1]):\n"
      "  print('locked', flush=True)\n"
      "  time.sleep(120)\n",
      workdir,
    ],
    stdout=subprocess.PIPE,
    text=True,
    env=ENV,
    cwd=launch.REPO_ROOT,
  )
  try:
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(
      launch.WorkdirLockedError, match=f"in use by another launch \\(pid {holder.pid} "
    ):
      with launch.workdir_lock(workdir):
        pass
    second = _run_launcher(
      [
        sys.executable,
        "-m",
        launch.MODULE,
        "--config",
        "quick",
        "--steps",
        "1",
        "--workdir",
        workdir,
      ],
      timeout=120,
    )
    assert second.returncode == 1
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"pid {holder.pid}" in last and "--workdir" in last
    assert "[launch] worker" not in second.stderr  # refused before starting any worker
  finally:
    holder.kill()
    holder.wait()
  # The holder died by SIGKILL without releasing: its lock is stale and taken over.
  with launch.workdir_lock(workdir) as fd:
    assert os.pread(fd, 256, 0).decode().startswith(f"pid {os.getpid()} ")
  assert (tmp_path / launch.LOCK_NAME).read_text() == ""  # released by its owner


def test_stale_lock_is_taken_over(tmp_path, capsys):
  dead = subprocess.Popen(["true"])
  dead.wait()
  (tmp_path / launch.LOCK_NAME).write_text(f"pid {dead.pid} host h since 2026-01-01T00:00:00\n")
  with launch.workdir_lock(str(tmp_path)):
    pass
  assert f"stale lock of pid {dead.pid} host h" in capsys.readouterr().err


def _output(pid, returncode, stderr=(), process_id=0):
  out = launch.WorkerOutput(process_id, ["python"], returncode=returncode, pid=pid)
  out.stderr, out.failed_after_s = list(stderr), 12.5
  return out


# Lines as jax.distributed, orbax and gloo print them (abridged).
HEARTBEAT = (
  "jax.errors.JaxRuntimeError: INTERNAL: Barrier failed because: task is set to ERROR: "
  "UNAVAILABLE: Task 1 heartbeat timeout. This indicates that the remote task has failed"
)
FATAL = (
  "F1125 22:12:21.271550   13401 client.h:80] Terminating process because the JAX "
  "distributed service detected fatal errors. This most likely indicates that another task died"
)
UNHEALTHY = (
  "E1125 22:36:02.416077   23490 coordination_service.cc:1549] Use error polling to propagate"
  " the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped"
  " sending heartbeats):"
)
GLOO_TIMEOUT = (
  "ValueError: UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/"
  "unbound_buffer.cc:81] Timed out waiting 8000ms for recv operation to complete"
)


@pytest.mark.parametrize(
  "own, other, cause",
  [
    ([HEARTBEAT], [], "lost peer: process 1 sent no heartbeat within the heartbeat timeout"),
    ([FATAL], [HEARTBEAT], "lost peer: process 1 sent no heartbeat"),  # named by the other
    ([FATAL], [], "the coordination service reported a failed process"),
    ([UNHEALTHY, FATAL], [], "lost peer: a process sent no heartbeat within the heartbeat timeout"),
    (["x", GLOO_TIMEOUT, "y"], [], "timeout: a collective waited 8000 ms for its peers"),
    (["Connection closed by peer [10.0.0.2]:5000"], [], "lost peer: a connection to it was closed"),
    (["Traceback", "ValueError: bad"], [], None),
  ],
)
def test_failure_cause_reads_the_stderr(own, other, cause):
  got = launch.failure_cause(own, other)
  assert got is None if cause is None else got.startswith(cause), got


def test_failure_line_names_worker_checkpoint_and_command(tmp_path):
  workdir = str(tmp_path)
  for step in ("4", "8", "12.orbax-checkpoint-tmp-1764108000"):  # 12: a torn save
    os.makedirs(os.path.join(train.checkpoint_dir(workdir, "dgc"), step))
  assert launch.complete_checkpoints(workdir, ["dense", "dgc"]) == {"dense": None, "dgc": 8}

  outputs = [_output(101, -signal.SIGABRT, [FATAL]), _output(102, -6, [HEARTBEAT], 1)]
  error = launch.LaunchError("x", outputs, failed=outputs[0])
  line = launch.failure_line(
    error, workdir=workdir, methods=["dense", "dgc"], checkpoint_every=4, command="python -m X"
  )
  assert line == (
    "worker 0 (pid 101) aborted (SIGABRT) 12.5 s after the start: lost peer: process 1 sent no"
    " heartbeat within the heartbeat timeout (dead or cut off); last complete checkpoint: dense"
    f" step none, dgc step 8 ({workdir}/checkpoints); resume with the same command: python -m X"
  )
  assert "\n" not in line

  killed = [_output(7, -signal.SIGKILL, [], 1), _output(8, 1, [HEARTBEAT])]
  error = launch.LaunchError("x", killed, failed=killed[0])
  line = launch.failure_line(
    error, workdir=workdir, methods=["dgc"], checkpoint_every=0, command="C"
  )
  # A killed worker's cause is the kill, not what the others then saw.
  assert line == (
    "worker 1 (pid 7) was killed by SIGKILL 12.5 s after the start; no checkpoints kept"
    " (--checkpoint-every N keeps them); rerun from step 0: C"
  )


def test_fault_flags_reach_the_workers():
  args = launch.worker_args("dgc", checkpoint_every=5, fault_timeout=12)
  assert args[args.index("--checkpoint-every") + 1] == "5"
  assert args[args.index("--fault-timeout") + 1] == "12"
  assert "--fault-timeout" not in launch.worker_args("dgc")  # the workers' default
  assert launch.parse_args([]).fault_timeout == launch.DEFAULT_FAULT_TIMEOUT <= 60
  assert launch.collective_timeout_flags(12) == ["--xla_cpu_collective_timeout_seconds=12"]
  for bad in (-1, 1.5):
    with pytest.raises(ValueError, match="fault-timeout"):
      launch.worker_args("dgc", fault_timeout=bad)
  with pytest.raises(ValueError, match="checkpoint-every"):
    launch.worker_args("dgc", checkpoint_every=-1)


def test_xla_knows_the_collective_timeout_flag():
  # XLA aborts on an unknown XLA_FLAGS entry: the flag must exist in this jaxlib.
  code = "import jax; print(jax.jit(lambda x: x + 1)(1))"
  env = {**ENV, "XLA_FLAGS": " ".join(launch.collective_timeout_flags(7))}
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
  )
  assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr[-2000:]


def test_checkpoint_of_other_settings_is_refused():
  config = quick.get_config()
  saved = train.run_fingerprint("dgc", config, 4, True)
  train.check_fingerprint(saved, train.run_fingerprint("dgc", config, 4, True), "D")
  # How often to checkpoint and which methods run do not change the trajectory.
  other = dataclasses.replace(config, checkpoint_every=7, methods=("dgc",))
  train.check_fingerprint(saved, train.run_fingerprint("dgc", other, 4, True), "D")
  changed = dataclasses.replace(config, num_steps=11)
  with pytest.raises(ValueError, match=r"belongs to another run \(num_steps: 10 there, 11 now\)"):
    train.check_fingerprint(saved, train.run_fingerprint("dgc", changed, 4, True), "D")
  with pytest.raises(ValueError, match=r"num_devices: 4 there, 2 now"):
    train.check_fingerprint(saved, train.run_fingerprint("dgc", config, 2, True), "D")
  with pytest.raises(ValueError, match="records no run settings"):
    train.check_fingerprint(None, saved, "D")


def test_worker_error_exits_at_once(tmp_path):
  # A worker that fails (here: no coordinator to join) exits with code 1 and its
  # traceback, without waiting in jax.distributed's shutdown barrier.
  start = time.monotonic()
  out = _run_launcher(
    [
      sys.executable,
      "-m",
      launch.MODULE,
      "--worker",
      "--process-id",
      "0",
      "--num-processes",
      "2",
      "--coordinator",
      "127.0.0.1:1",
      "--config",
      "nope",
      "--workdir",
      str(tmp_path),
    ],
    timeout=120,
  )
  assert out.returncode == 1 and "unknown 'nope'" in out.stderr
  assert time.monotonic() - start < 60


@pytest.mark.slow
def test_diloco_resumes_bit_identical(tmp_path):
  """DiLoCo's per-device params (one row per replica) and state (each replica's AdamW
  moments, the exchange's residuals and keys) survive a checkpoint taken between syncs:
  syncs at 3 and 6, checkpoints at 5 and 8; the resumed run (from 5, through the sync
  at 6) ends with the uninterrupted run's bytes, every device's row of every leaf."""
  ocp = pytest.importorskip("orbax.checkpoint")
  config = dataclasses.replace(
    quick.get_config(), num_steps=8, checkpoint_every=5, diloco_sync_every=3
  )
  mesh, data, model, init_params = train.setup(config, str(tmp_path))
  run = dict(model=model, init_params=init_params, data=data, mesh=mesh, evaluate=False)
  ckpts = pathlib.Path(train.checkpoint_dir(str(tmp_path / "run"), "diloco_qsgd4"))
  first = train.train_method("diloco_qsgd4", config, workdir=str(tmp_path / "run"), **run)
  assert sorted(p.name for p in ckpts.iterdir()) == ["5", "8"]
  os.rename(ckpts / "8", tmp_path / "uninterrupted8")
  second = train.train_method("diloco_qsgd4", config, workdir=str(tmp_path / "run"), **run)
  assert (first["start_step"], second["start_step"]) == (0, 5)
  assert second["params_sha256"] == first["params_sha256"]  # the anchor
  assert second["losses"] == first["losses"]
  with ocp.StandardCheckpointer() as ckptr:
    at5 = ckptr.restore(ckpts / "5" / "state")
    rows = [np.asarray(leaf) for leaf in jax.tree.leaves(at5["params"])]
    assert all(r.shape[0] == mesh.size for r in rows)
    assert any((r != r[:1]).any() for r in rows)  # the replicas had drifted apart
    chex.assert_trees_all_equal(
      ckptr.restore(ckpts / "8" / "state"), ckptr.restore(tmp_path / "uninterrupted8" / "state")
    )
