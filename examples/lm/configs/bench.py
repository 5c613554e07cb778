"""Benchmark configuration: a ~0.13M-parameter model that trains in minutes on a CPU.

Below the ~1M of ``small``: this machine's measurements (docs/benchmarks.md) run
every method for a few hundred updates, and the time-to-loss benchmark runs them
over a throttled link, on two shared cores.
"""

from __future__ import annotations

import dataclasses

from examples.lm.configs import default


def get_config() -> default.Config:
  """Returns the ~0.13M-parameter configuration (2 blocks of width 64)."""
  return dataclasses.replace(
    default.get_config(),
    width=64,
    depth=2,
    num_heads=2,
    seq_len=64,
    per_device_batch_size=8,
    num_steps=300,
    warmup_steps=30,
    eval_every=25,
    eval_batches=2,
  )
