"""About 20M parameters, for network benchmarks of the multi-process launcher
(``python -m benchmarks.launch --config params20m``)."""

from __future__ import annotations

import dataclasses

from examples.mnist1d.configs import default


def get_config() -> default.Config:
  """Returns a wider CNN (last conv 1,024, hidden 18,944): 20,032,394 parameters.

  97% of the parameters sit in the first Dense kernel (19.4M values): a dense exchange
  moves 80 MB, and a forward pass costs about 24M multiply-adds per example (``params2m``:
  2.8M), hence only 10 steps, with ``params2m``'s 4-step warm-up (after which DGC sends at
  its steady 99.9% sparsity) and lower peak learning rate.
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
