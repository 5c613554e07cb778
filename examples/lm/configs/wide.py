"""Wide configuration: ~6.4M parameters in 8 blocks of width 256, float32 compute.

``deep`` at twice the width, for the sharded methods' step time over a link: 26 MB of
float32 weights to gather and gradients to reduce-scatter per step against the compute
of one sequence per device (``--batch 1``). Its matmuls run in float32: on a CPU
without fast bf16 kernels the bf16 casts add compute that a GPU would not pay, and the
step would measure this CPU rather than the exchange.
"""

from __future__ import annotations

import dataclasses

from examples.lm.configs import deep
from examples.lm.configs import default


def get_config() -> default.Config:
  """Returns the ~6.4M-parameter configuration (8 blocks of width 256, float32)."""
  return dataclasses.replace(deep.get_config(), width=256, num_heads=4, compute_dtype="float32")
