"""benchmarks.lm_network: the scaled-rate mapping, its flags and worker command lines.

(The 2-process smoke run, ``python -m benchmarks.lm_network --smoke``, takes minutes of
compilation on two cores and is left to the command line.)
"""

import dataclasses

import pytest

pytest.importorskip("flax", minversion="0.12")

from benchmarks import lm_network  # noqa: E402
from examples.lm.configs import bench  # noqa: E402


def test_model_flops_counts_matmuls_and_attention():
  config = dataclasses.replace(bench.get_config(), per_device_batch_size=2, accumulation_steps=3)
  tokens = 2 * 3 * config.seq_len
  expected = tokens * (6 * 1000 + 12 * config.depth * config.seq_len * config.width)
  assert lm_network.model_flops(config, 1000) == expected


def test_scaled_rate_keeps_the_compute_to_communication_ratio():
  flops, cpu_step, util = 1e12, 0.5, 0.4
  t_gpu = flops / (lm_network.H100_BF16_FLOPS * util)
  rate = lm_network.scaled_rate_bits(100e9, flops, cpu_step, util)
  bits = 8e6  # any message: its share of the step is the same on both machines
  assert (bits / rate) / cpu_step == pytest.approx((bits / 100e9) / t_gpu)
  assert lm_network.tc_rate(2.5e6) == "2500kbit"
  with pytest.raises(ValueError, match="utilisation"):
    lm_network.scaled_rate_bits(1e9, flops, cpu_step, 0.0)
  with pytest.raises(ValueError, match="step time"):
    lm_network.scaled_rate_bits(1e9, flops, 0.0, 0.4)


def test_flags_and_commands(capsys):
  with pytest.raises(SystemExit):
    lm_network.parse_args(["--help"])
  assert "--target-step" in capsys.readouterr().out
  args = lm_network.parse_args(["--smoke"])
  assert (args.config, args.rates, args.steps % args.eval_every) == ("tiny", "none", 0)
  with pytest.raises(SystemExit):
    lm_network.parse_args(["--steps", "100", "--target-step", "200"])
  commands = lm_network.worker_commands(["--config", "tiny"], coordinator="h:1")
  assert [c[c.index("--process-id") + 1] for c in commands] == ["0", "1"]
  assert all(c[1:3] == ["-m", "examples.lm.main"] for c in commands)


def test_tolerance_flag_and_the_table_marks_gaps_and_divergence():
  with pytest.raises(SystemExit):
    lm_network.parse_args(["--tolerance", "1.5"])
  args = lm_network.parse_args(["--tolerance", "0.02", "--steps", "20", "--target-step", "20"])
  history = {"step": [0, 10, 20], "val_loss": [5.0, 3.0, 2.0], "time_s": [0, 1.0, 2.0]}

  def row(val, target_step, target_time, diverged=False, received=1000.0):
    return {
      "history": history,
      "train_time_s": 2.0,
      "target_step": target_step,
      "target_time_s": target_time,
      "val_loss": val,
      "bytes_received": received,
      "diverged": diverged,
    }

  results = {
    "dense": row(2.0, 20, 2.0, received=4000.0),
    "fast": row(2.0, 10, 0.5),
    "short": row(2.2, None, None),
    "broken": row(float("nan"), None, None, diverged=True),
  }
  by_rate = {"10mbit": {"label": "10mbit", "results": {"results": results}}}
  table = lm_network.summarize(by_rate, 2.04, args)
  assert "plus 2%" in table
  lines = {line.split("|")[2].strip(): line for line in table.splitlines() if "| 10mbit |" in line}
  assert "| 4.00x |" in lines["fast"] and "| 4x |" in lines["fast"]  # speed-up, fewer bytes
  assert "not within 20" in lines["short"] and "+7.8%" in lines["short"]  # 2.2 / 2.04 - 1
  assert "broken **diverged**" in lines
