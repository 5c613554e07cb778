"""Large configuration: a ~19M-parameter model (6 blocks of width 512)."""

from __future__ import annotations

import dataclasses

from examples.lm.configs import default


def get_config() -> default.Config:
  """Returns the ~19M-parameter configuration."""
  return dataclasses.replace(
    default.get_config(),
    width=512,
    depth=6,
    num_heads=8,
    learning_rate=1e-3,
    warmup_steps=200,
  )
