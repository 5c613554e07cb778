"""Multi-process training (benchmarks/launch.py): 2 processes x 2 CPU devices.

The workers are separate processes on jax.distributed with gloo collectives; they set
their own device count (this process's 8 CPU devices from conftest do not apply).
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
import time

import jax
import pytest

pytest.importorskip("flax")
pytest.importorskip("mnist1d")
pytest.importorskip("tqdm")

from benchmarks import launch  # noqa: E402
from examples.mnist1d import input_pipeline  # noqa: E402
from examples.mnist1d import models  # noqa: E402
from examples.mnist1d import train  # noqa: E402

METHODS = ("dense", "qsgd4", "onebit", "dgc")
STEPS = 3


@pytest.mark.slow
def test_two_processes_end_with_identical_params(tmp_path):
  # One launch trains the four methods in turn: the start-up (imports, data set,
  # jax.distributed) is paid once; compiling the four train steps dominates. Not `once`:
  # the two jax lines' multi-process runtimes differ (jax 0.12's CPU trace loses events).
  workdir = str(tmp_path)
  args = launch.worker_args(
    METHODS, config="quick", devices_per_process=2, steps=STEPS, workdir=workdir, profile=2
  )
  results = launch.launch(args, processes=2, timeout=400, env={"JAX_PLATFORMS": "cpu"})

  assert [r["process_id"] for r in results] == [0, 1]
  launch.check_identical(results)  # every method, every device of every process
  for r in results:
    assert (r["num_processes"], r["num_devices"], r["local_devices"]) == (2, 4, 2)
    assert r["num_params"] == 17274 and r["global_batch"] == 4 * 4
    assert list(r["methods"]) == list(METHODS)
    assert os.path.exists(os.path.join(workdir, f"worker{r['process_id']}.json"))

  for method in METHODS:
    m = results[0]["methods"][method]
    assert {r["methods"][method]["params_sha256"] for r in results} == {m["params_sha256"]}
    assert m["params_sha256"] != results[0]["init_params_sha256"], method
    assert m["params_change_l2"] > 0, method
    assert len(m["losses"]) == len(m["step_times_s"]) == STEPS
    assert all(math.isfinite(loss) for loss in m["losses"]), method
    assert not m["diverged"] and m["exchanged"], method
    assert all(t > 0 for t in m["step_times_s"]) and m["median_step_time_s"] > 0
  # --profile: each process split two more steps by phase (jc.profile_phases). The CPU
  # profiler loses events: jax 0.12's under jax.distributed those of collectives and the
  # ops after them, either line's under load (rarely) all of a trace. A profile that lost
  # events must say so (untraced); on jax 0.10 each method has at least one complete one.
  complete = set()
  for r in results:
    for method in METHODS:
      ph = r["methods"][method]["phases"]
      assert ph["calls"] == 2 and ph["step_ms"] > 0, method
      if ph["untraced"]:
        traced = [ph[p] for p in ("gradient", "encode", "exchange", "decode", "update")]
        assert ph["gradient"] > 0 or max(traced) == 0, method  # lost: after it, or all
        continue
      complete.add(method)
      assert ph["gradient"] > 0 and ph["exchange"] > 0, method
      if method != "dense":
        assert ph["encode"] > 0 and ph["decode"] > 0, method
      else:
        assert ph["encode"] == ph["decode"] == 0
  if jax.__version_info__ < (0, 12):
    assert complete == set(METHODS)
  assert "Where a step's time goes" in launch.summary(results)
  digests = {results[0]["methods"][m]["params_sha256"] for m in METHODS}
  assert len(digests) == len(METHODS)  # the exchanges really differ

  ratio = {m: results[0]["methods"][m]["ratio"] for m in METHODS}
  assert ratio["dense"] == pytest.approx(1.0)
  assert 5 < ratio["qsgd4"] < ratio["onebit"] < ratio["dgc"]

  # The processes fed the single-process trainer's global batch: the first step's loss
  # (before any update) is the mean loss of that batch at the shared initial params.
  config = dataclasses.replace(launch.load_config("quick"), num_steps=STEPS)
  data = input_pipeline.load_dataset(config, workdir)  # the workers' cached copy
  model = models.create_model(config)
  params = jax.device_get(jax.jit(model.init)(jax.random.key(config.seed), data["x"][:1])["params"])
  assert launch.params_digest(params) == results[0]["init_params_sha256"]
  x, y = next(
    input_pipeline.train_batches(
      data["x"],
      data["y"],
      num_devices=4,
      per_device_batch_size=config.per_device_batch_size,
      seed=config.seed,
    )
  )
  first = float(train.cross_entropy(model, params, x.reshape(-1, x.shape[-1]), y.reshape(-1)))
  for method in METHODS:
    assert results[0]["methods"][method]["losses"][0] == pytest.approx(first, rel=1e-5)


def test_failing_worker_kills_the_others_and_reports_its_stderr():
  def prefix(i):
    return ["sh", "-c", "echo boom >&2; exit 3"] if i == 0 else ["sh", "-c", "sleep 60"]

  start = time.monotonic()
  with pytest.raises(launch.LaunchError, match=r"worker 0 exited with code 3(.|\n)*boom") as info:
    launch.launch(["--method", "dense"], processes=2, prefix=prefix, timeout=60)
  assert time.monotonic() - start < 30
  codes = [o.returncode for o in info.value.outputs]
  assert codes[0] == 3 and codes[1] < 0  # the sleeping worker was killed


def test_timeout_kills_every_worker():
  start = time.monotonic()
  with pytest.raises(launch.LaunchError, match="timed out") as info:
    launch.launch([], processes=2, prefix=lambda i: ["sh", "-c", "sleep 60"], timeout=1)
  assert time.monotonic() - start < 30
  assert all(o.returncode < 0 for o in info.value.outputs)


def test_worker_without_result_is_an_error():
  with pytest.raises(launch.LaunchError, match="without a result line"):
    launch.launch([], processes=1, prefix=lambda i: ["true"], timeout=60)


def test_prefix_env_and_coordinator_reach_the_command():
  # The builders launch() uses, as a network benchmark would call it.
  env = lambda i: {"WORKER_TAG": f"tag{i}"}
  commands = launch.worker_commands(
    launch.MODULE,
    ["--method", "dense", "--worker"],
    processes=2,
    coordinator="10.0.0.1:1234",
    prefix=lambda i: ["ip", "netns", "exec", f"ns{i}"],
  )
  for i in range(2):
    assert launch.worker_env(i, env)["WORKER_TAG"] == f"tag{i}"
    assert commands[i][:4] == ["ip", "netns", "exec", f"ns{i}"]
    assert commands[i][4:7] == [sys.executable, "-m", launch.MODULE]
  assert commands[1][-7:] == [
    "--worker",
    "--num-processes",
    "2",
    "--coordinator",
    "10.0.0.1:1234",
    "--process-id",
    "1",
  ]
  assert launch.REPO_ROOT.as_posix() in launch.worker_env(0, None)["PYTHONPATH"]


@pytest.mark.parametrize("bad", ["127.0.0.1", ":80", "host:0", "host:port", "host:70000"])
def test_bad_coordinator_is_rejected(bad):
  with pytest.raises(ValueError, match="HOST:PORT"):
    launch.launch([], processes=1, coordinator=bad)


def test_bad_worker_flags_are_rejected_before_launch():
  with pytest.raises(ValueError, match="unknown"):
    launch.worker_args("dense,nope")
  with pytest.raises(ValueError, match="unknown"):
    launch.worker_args("dense", config="nope")
  with pytest.raises(ValueError, match="positive"):
    launch.worker_args("dense", steps=0)
  with pytest.raises(ValueError, match="repeated"):
    launch.worker_args("dense,dense")


def test_configs_by_name_and_by_path(monkeypatch):
  # Names: the benchmarks' configs, then the example's; paths: any get_config() file.
  assert launch.load_config("params2m").hidden == 13824
  assert launch.load_config("quick").num_steps == 10
  assert {"default", "quick", "params2m", "params20m"} <= set(launch.config_names())
  monkeypatch.chdir(launch.REPO_ROOT)
  path = "benchmarks/configs/params20m.py"
  assert launch.load_config(path, steps=3).num_steps == 3
  args = launch.worker_args("dense", config=path)
  assert args[3] == str(launch.REPO_ROOT / path)  # absolute: the workers may start elsewhere
  with pytest.raises(ValueError, match="no such file"):
    launch.load_config("benchmarks/configs/nope.py")


def test_free_port_is_bindable():
  port = launch.free_port()
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", port))


@pytest.mark.slow
def test_network_psum_worker_agrees_on_its_repeats():
  # benchmarks.network times psums with a budget; both processes must issue the same
  # number of psums (process 0 decides and broadcasts), or one would hang.
  import json  # pylint: disable=import-outside-toplevel

  coordinator = f"127.0.0.1:{launch.free_port()}"
  commands = [
    [
      sys.executable,
      "-m",
      "benchmarks.network",
      "--psum-worker",
      "--process-id",
      str(i),
      "--num-processes",
      "2",
      "--coordinator",
      coordinator,
      "--psum-sizes",
      "4096,65536",
      "--seconds-per-size",
      "0.05",
    ]
    for i in range(2)
  ]
  outputs = launch.run_processes(commands, timeout=300, env={"JAX_PLATFORMS": "cpu"})
  line = next(x for x in outputs[0].stdout if x.startswith(launch.RESULT_MARKER))
  result = json.loads(line[len(launch.RESULT_MARKER) :])
  for name in ("psum", "all_gather"):  # the model fits a link to each
    samples = result[name]
    assert [s["bytes"] for s in samples] == [4096, 65536]
    assert all(3 <= len(s["times_s"]) <= 15 and s["median_s"] > 0 for s in samples)


def test_xla_combines_all_reduces_not_all_gathers():
  # Why jaxcomp fuses payloads itself. If a jax release starts combining all-gathers on
  # CPU too, this fails and the docs' reason for gather_tree should be revisited.
  # (The probe that printed these counts was benchmarks/studies/collective_probe.py,
  # removed after 16da27a.)
  import jax  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  k = min(4, jax.local_device_count())
  tree = [jnp.ones((k, k, 64 + i)) for i in range(6)]  # six independent leaves
  ops = {
    "all-reduce": lambda x: lax.psum(x, "b"),
    "all-gather": lambda x: lax.all_gather(x, "b"),
    "all-to-all": lambda x: lax.all_to_all(x, "b", 0, 0),
  }
  counts = {}
  for name, op in ops.items():
    f = jax.pmap(
      lambda t, op=op: [op(x) for x in t], axis_name="b", devices=jax.local_devices()[:k]
    )
    hlo = f.lower(tree).compile().as_text()
    counts[name] = hlo.count(f"{name}(") + hlo.count(f"{name}-start(")
  assert counts["all-reduce"] == 1
  assert counts["all-gather"] == 6 and counts["all-to-all"] == 6


def _worker_result(pid, **methods):
  base = {
    "final_loss": 0.5,
    "test_accuracy": None,
    "median_step_time_s": 0.01,
    "bytes_received": 1000.0,
    "ratio": 2.0,
    "params_sha256": "ab" * 32,
    "local_copies_identical": True,
    "nonfinite_step": None,
    "diverged": False,
    "first_exchange_step": 1,
    "exchanged": True,
  }
  return {
    "process_id": pid,
    "local_devices": 2,
    "platform": "cpu",
    "num_params": 10,
    "global_batch": 4,
    "methods": {m: {**base, **r} for m, r in methods.items()},
  }


def test_launcher_marks_diverged_and_unexchanged_rows_and_fails_the_exit_code(monkeypatch, capsys):
  nan = float("nan")
  diverged = {"final_loss": nan, "nonfinite_step": 7, "diverged": True}
  unsynced = {"exchanged": False, "first_exchange_step": 10}
  results = [_worker_result(i, dense={}, onebit=diverged, diloco=unsynced) for i in (0, 1)]
  table = launch.summary(results)
  row = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| ")}
  assert "| dense | 0.5000 | n/a |" in row["dense"]
  assert "| onebit | diverged at step 7 | n/a |" in row["onebit"]
  assert "| none sent (first exchange at step 10) | n/a |" in row["diloco"]

  # The exit code: 1 when a method diverged, unless --allow-diverged; 0 otherwise.
  monkeypatch.setattr(launch, "run_launcher", lambda args, command: results)
  assert launch.main(["--method", "dense,onebit,diloco"]) == 1
  assert "onebit at step 7" in capsys.readouterr().err
  assert launch.main(["--method", "dense,onebit,diloco", "--allow-diverged"]) == 0
  sound = [_worker_result(i, dense={}) for i in (0, 1)]
  monkeypatch.setattr(launch, "run_launcher", lambda args, command: sound)
  assert launch.main(["--method", "dense"]) == 0
