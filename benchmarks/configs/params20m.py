"""About 20M parameters, for network benchmarks of the multi-process launcher
(``python -m benchmarks.launch --config params20m``)."""

from __future__ import annotations

import dataclasses

from examples.mnist1d.configs import default


def get_config() -> default.Config:
  """Returns a wider CNN (last conv 1,024, hidden 18,944): 20,032,394 parameters.

  Conv 32/k5, 64/k3/s2, 128/k3/s2, 1024/k3 (425k parameters), max pool, Dense
  1,024 -> 18,944 -> 10: 97% of the parameters sit in the first Dense kernel (19.4M
  values), so a step costs about 24M multiply-adds per example forward, 16 examples per
  device, while a dense exchange moves 80 MB. On a 2-core CPU (2 processes x 1 device)
  a dense step takes about 0.8 s and a 1-bit one 1.5 s, hence only 10 steps, with a
  4-step warm-up (after which DGC sends at its steady 99.9% sparsity) and the lower peak
  learning rate of ``params2m``.
  """
  return dataclasses.replace(
    default.get_config(),
    conv_features=(32, 64, 128, 1024),
    hidden=18944,
    per_device_batch_size=16,
    num_steps=10,
    warmup_steps=4,
    learning_rate=0.05,
    eval_every=10,
  )
