"""Small configuration: a ~0.9M-parameter model, the measurements' config."""

from __future__ import annotations

import dataclasses

from examples.lm.configs import default


def get_config() -> default.Config:
  """Returns the ~0.9M-parameter configuration (4 blocks of width 128)."""
  return dataclasses.replace(
    default.get_config(),
    width=128,
    depth=4,
    num_heads=4,
    seq_len=64,
    per_device_batch_size=4,
    num_steps=300,
    warmup_steps=30,
    eval_every=25,
  )
