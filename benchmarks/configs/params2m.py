"""About 2M parameters, for network benchmarks of the multi-process launcher
(``python -m benchmarks.launch --config params2m``)."""

from __future__ import annotations

import dataclasses

from examples.mnist1d.configs import default


def get_config() -> default.Config:
  """Returns the default CNN with a 13,824-unit hidden layer: 2,001,930 parameters.

  95% of the parameters sit in the two Dense kernels (both compressed by default), so a
  step stays cheap on a CPU while a dense exchange moves 8 MB. 20 steps with a 4-step
  warm-up (after which DGC sends at its steady 99.9% sparsity) keep a benchmark short;
  the default's peak learning rate made the loss jump at the end of this warm-up.
  """
  return dataclasses.replace(
    default.get_config(),
    hidden=13824,
    per_device_batch_size=16,
    num_steps=20,
    warmup_steps=4,
    learning_rate=0.05,
    eval_every=20,
  )
