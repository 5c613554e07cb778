"""Quick configuration for the smoke test: tiny data and model, a few steps, all methods."""

from __future__ import annotations

import dataclasses

from examples.mnist1d.configs import default


def get_config() -> default.Config:
  """Returns a configuration that runs every method in seconds.

  The model keeps two compressed kernels, few because compile time grows with their
  number: Conv 8->128 (k8) and Dense 128->64, 8192 values each, 95% of the 17k
  parameters, so the byte counts stay meaningful. 8192 = 8 devices x 1024 values, so
  the two-phase chunks need no padding to whole buckets.
  """
  return dataclasses.replace(
    default.get_config(),
    num_samples=400,  # 320 train / 80 test
    conv_features=(8, 128),
    conv_kernels=(5, 8),
    conv_strides=(1, 2),
    hidden=64,
    per_device_batch_size=4,
    num_steps=10,
    warmup_steps=2,
    eval_every=5,
  )
