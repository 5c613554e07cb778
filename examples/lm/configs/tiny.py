"""Tiny configuration for tests: a ~40K-parameter model, a few steps, every method."""

from __future__ import annotations

import dataclasses

from examples.lm.configs import default


def get_config() -> default.Config:
  """Returns a configuration that trains every method in seconds."""
  return dataclasses.replace(
    default.get_config(),
    width=32,
    depth=2,
    num_heads=2,
    seq_len=32,
    per_device_batch_size=2,
    num_steps=8,
    warmup_steps=2,
    eval_every=4,
    eval_batches=1,
    diloco_sync_every=4,  # two syncs in the 8 updates: DiLoCo's rows report sent bytes
  )
