"""Deep configuration: ~1.6M parameters in 8 blocks of width 128, the sharded measurements.

``small`` with twice the blocks: per-layer FSDP's peak memory and bytes are measured on a
model of at least 8 layers (``benchmarks/sharded.py --model lm``).
"""

from __future__ import annotations

import dataclasses

from examples.lm.configs import default
from examples.lm.configs import small


def get_config() -> default.Config:
  """Returns the ~1.6M-parameter configuration (8 blocks of width 128)."""
  return dataclasses.replace(small.get_config(), depth=8)
