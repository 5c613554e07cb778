"""Faults in the multi-process transformer trainer (examples/lm): kill -9, then resume.

Two processes of ``python -m examples.lm.main`` under ``jax.distributed`` (gloo, one CPU
device each), started as a user starts them (the same flags in each, no launcher:
``benchmarks.fault.measure_lm_kill``), fresh processes under timeouts (a hang fails the
test).
"""

from __future__ import annotations

import json
import pathlib
import signal

import pytest

pytest.importorskip("flax", minversion="0.12")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

from benchmarks import fault  # noqa: E402
from benchmarks import launch  # noqa: E402
from examples.lm import main  # noqa: E402

ENV = {"JAX_PLATFORMS": "cpu"}

# The tiny config cut to one block (compile time grows with the number of leaves).
CONFIG = """
import dataclasses
from examples.lm.configs import tiny

def get_config():
  return dataclasses.replace(tiny.get_config(), depth=1)
"""

STEPS, EVERY, FAULT_TIMEOUT = 200, 10, 10


def _digests(outputs) -> set[str]:
  """The params sha256 that every process printed for its own copy."""
  return {line.split()[-1] for o in outputs for line in o.stdout if "params sha256" in line}


def _result(workdir) -> dict:
  return json.loads((pathlib.Path(workdir) / "results.json").read_text())["results"]["onebit"]


@pytest.mark.slow
@pytest.mark.once
def test_killed_lm_process_then_same_commands_resume_bit_identical(tmp_path):
  # 1-bit SGD: per-device error-feedback residuals in the state of a 2-process run.
  config = tmp_path / "one_block.py"
  config.write_text(CONFIG)
  run = dict(config=str(config), steps=STEPS, checkpoint_every=EVERY)
  whole = launch.run_processes(
    fault.lm_commands(str(tmp_path / "whole"), FAULT_TIMEOUT, **run), env=ENV, timeout=400
  )
  (expected,) = _digests(whole)
  assert _result(tmp_path / "whole")["params_sha256"] == expected

  workdir = str(tmp_path / "cut")
  killed = fault.measure_lm_kill(workdir, FAULT_TIMEOUT, **run)  # raises if cut too late
  assert killed["killed_returncode"] == -signal.SIGKILL
  assert killed["returncode"] != 0, (tmp_path / "cut" / "process0.log").read_text()[-3000:]
  assert killed["detected_s"] < 2 * FAULT_TIMEOUT + 5, killed  # no hang: it left by itself
  assert killed["survivors"] == []
  checkpoint = launch.complete_checkpoints(workdir, ["onebit"])["onebit"]
  assert 0 < checkpoint < STEPS and checkpoint % EVERY == 0

  # The same commands again (the coordinator's port is free again).
  resumed = launch.run_processes(killed["commands"], env=ENV, timeout=400)
  assert _digests(resumed) == {expected}  # both processes, bit-identical to the whole run
  record = _result(workdir)
  assert record["params_sha256"] == expected
  assert checkpoint <= record["start_step"] < STEPS  # resumed, not restarted
  assert any("onebit: resuming from step" in line for line in resumed[0].stdout)


def test_fault_timeout_flag():
  parser = main.build_parser()
  args = parser.parse_args(["--fault-timeout", "12", "--checkpoint-every", "5"])
  assert args.fault_timeout == 12 and main.get_config(args).checkpoint_every == 5
  assert parser.parse_args([]).fault_timeout == launch.DEFAULT_FAULT_TIMEOUT <= 60
  with pytest.raises(ValueError, match="--fault-timeout must be >= 0"):  # before JAX starts
    main.init_devices(parser.parse_args(["--fault-timeout", "-1", "--coordinator", "h:1"]))
  with pytest.raises(SystemExit):
    parser.parse_args(["--fault-timeout", "1.5"])
